"""Truncation before tokenisation: cut a long text to a prefix whose tokens, truncated to the
model's ``max_length``, are exactly those of the whole text.

A tokenizer truncates only after it has tokenised the whole text, so one 2 MB text costs
seconds of CPU before all but its first ``max_length`` tokens are thrown away (BC-28).
:class:`PrefixTruncator` bounds that work by the model's limit, not by the text's size:

1. At most ``4 x cap_chars`` bytes of a UTF-8 row are decoded (a cut backs off to a character
   boundary; invalid bytes become U+FFFD, as :func:`~gpuserve.text.decode.decode_texts`
   does).
2. A text of at most ``first_chars`` characters (default ``max_length x 8``) is tokenised whole:
   its count is exact and the row is kept as is.
3. A longer text is cut at the start of a whitespace run at or before ``first_chars`` characters
   (at exactly that many when the second half of the window has no whitespace) and the prefix is
   tokenised without truncation. When the first ``K`` content tokens (``K = max_length`` minus
   the special tokens the tokenizer adds) all belong to words before the prefix's last word, the
   only word the cut can have changed, they are the whole text's first ``K`` tokens: normalisers
   act per character, pre-tokenisers split left to right and the model encodes each word on its
   own. The row is replaced by the prefix up to the end of the last kept word (re-tokenised to
   check; the longer prefix when the check disagrees), and its count is ``max_length``.
4. Otherwise the bound grows fourfold, up to ``cap_chars`` (default ``max_length x 128``
   characters: 32,768 for ``max_length`` 256). **The cap is the one documented departure from
   full-text truncation**: a text whose first ``cap_chars`` characters hold fewer than ``K``
   tokens before their last word (over 128 characters per token: a multi-kilobyte "word" that
   WordPiece maps to one ``[UNK]`` anyway, or a whitespace run longer than the cap) is
   tokenised as its first ``cap_chars`` characters.

For a model without truncation (``strict``) the same prefix decides: more than ``K`` tokens
before the prefix's last word proves the text too long; a text that neither fits in
``cap_chars`` nor is proven too long within it is reported as over the cap (the caller refuses
it: a documented character cap).

Only right truncation (keep the beginning) is cut this way; a tokenizer truncating on the
left is measured on the whole text (:attr:`PrefixTruncator.cuts` is False).

Thread-safe: the truncator holds its own copy of the tokenizer (no truncation, no padding),
made at construction and only read afterwards, so any number of admission threads may call
it while the instance's CPU stage uses the model's own tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpuserve.text.encoded import EncodedTexts

#: Initial prefix, characters per token of ``max_length``.
FIRST_CHARS_PER_TOKEN = 8
#: Hard cap of the prefix, characters per token of ``max_length``.
CAP_CHARS_PER_TOKEN = 128
#: Longest UTF-8 encoding of one character, bytes.
_UTF8_MAX = 4
_GROWTH = 4
_SPACES = (" ", "\n", "\t", "\r", "\u3000", "\xa0")


@dataclass(frozen=True, slots=True)
class RowLength:
    """What truncation makes of one text.

    Attributes:
        tokens: Tokens the model embeds for it: special tokens included, after truncation
            to ``max_length`` (``min(full, max_length)``).
        text: The text to tokenise instead (cut before tokenisation), or None to keep the row.
        full: The whole text's token count when it was tokenised whole, else None.
        over_max: The whole text has more than ``max_length`` tokens (proven on a prefix
            when ``full`` is None).
        over_cap: A strict truncator could not tell within ``cap_chars`` characters whether
            the text fits (it has more characters than the cap).
        chars: Characters of the text that were looked at (for messages).
    """

    tokens: int
    text: str | None = None
    full: int | None = None
    over_max: bool = False
    over_cap: bool = False
    chars: int = 0


def decode_prefix(item: bytes | str, max_chars: int) -> tuple[str, bool]:
    """At least the first ``max_chars`` characters of one BYTES element (all when shorter).

    Args:
        item: UTF-8 ``bytes`` (invalid bytes decode to U+FFFD) or ``str``.
        max_chars: Characters wanted.

    Returns:
        ``(text, complete)``: the decoded text (possibly longer than ``max_chars``) and
        whether it is the whole element.

    Raises:
        TypeError: ``item`` is neither ``bytes`` nor ``str``.
    """
    if isinstance(item, str):
        return item, True
    if not isinstance(item, bytes):
        raise TypeError(f"expected bytes or str elements, got {type(item).__name__}")
    limit = max_chars * _UTF8_MAX
    if len(item) <= limit:
        return item.decode("utf-8", errors="replace"), True
    cut = limit
    while cut > 0 and (item[cut] & 0xC0) == 0x80:  # never split a character's bytes
        cut -= 1
    return item[:cut].decode("utf-8", errors="replace"), False


def whitespace_cut(text: str, bound: int) -> str:
    """``text`` cut to at most ``bound`` characters, at the start of a whitespace run in
    ``[bound // 2, bound]`` when there is one (the prefix then ends with a non-space), else at
    ``bound`` exactly."""
    if len(text) <= bound:
        return text
    low = bound // 2
    at = max(text.rfind(space, low, bound + 1) for space in _SPACES)
    if at < 0:
        return text[:bound]
    head = text[:at].rstrip()
    return head if len(head) > low // 2 else text[:bound]


class PrefixTruncator:
    """Token counts and cut texts for one tokenizer and ``max_length`` (see the module doc).

    Args:
        tokenizer: A ``tokenizers.Tokenizer`` (the model's; it is copied, never used).
        max_length: Longest tokenised input, tokens, special tokens included.
        strict: The model refuses longer texts instead of truncating them.
        direction: The model's truncation side, ``right`` (keeps the beginning) or ``left``.
        first_chars: First prefix, characters (default ``max_length x 8``).
        cap_chars: Longest prefix, characters (default ``max_length x 128``).
    """

    def __init__(
        self,
        tokenizer: Any,
        max_length: int,
        *,
        strict: bool = False,
        direction: str = "right",
        first_chars: int | None = None,
        cap_chars: int | None = None,
    ) -> None:
        own = self.copy_of(tokenizer)
        self.tokenizer = own
        #: Where texts tokenised whole within ``max_length`` leave their ids for the model's
        #: CPU stage (:mod:`gpuserve.text.encoded`), or None.
        self.encoded: EncodedTexts | None = None
        self.max_length = max_length
        self.strict = strict
        self.cuts = direction == "right"
        self.specials = int(own.num_special_tokens_to_add(False))
        self.keep = max(1, max_length - self.specials)
        self.first_chars = first_chars or max_length * FIRST_CHARS_PER_TOKEN
        self.cap_chars = max(self.first_chars, cap_chars or max_length * CAP_CHARS_PER_TOKEN)

    @staticmethod
    def copy_of(tokenizer: Any) -> Any:
        """A copy of a ``tokenizers.Tokenizer`` that shares no state with it, truncation and
        padding off."""
        own = type(tokenizer).from_str(tokenizer.to_str())
        own.no_truncation()
        own.no_padding()
        return own

    def measure(self, items: Sequence[bytes | str]) -> list[RowLength]:
        """One :class:`RowLength` per element, in order; equal elements are measured once
        (a rerank request repeats its query in each of its rows).

        Args:
            items: B elements of a BYTES input (UTF-8 ``bytes`` or ``str``).

        Raises:
            TypeError: an element is neither ``bytes`` nor ``str``.
        """
        for item in items:
            if not isinstance(item, (bytes, str)):
                raise TypeError(f"expected bytes or str elements, got {type(item).__name__}")
        distinct = list(dict.fromkeys(items))
        if len(distinct) == len(items):
            return self._measure(items)
        measured = dict(zip(distinct, self._measure(distinct), strict=True))
        return [measured[item] for item in items]

    def _measure(self, items: Sequence[bytes | str]) -> list[RowLength]:
        if not self.cuts:
            return self._whole([decode_prefix(item, 1 << 62)[0] for item in items])
        results: list[RowLength | _Exact | None] = [None] * len(items)
        texts: dict[int, tuple[str, bool]] = {}
        short: list[int] = []
        for row, item in enumerate(items):
            text, complete = decode_prefix(item, self.cap_chars)
            texts[row] = (text, complete)
            if complete and len(text) <= self.first_chars:
                short.append(row)
        if short:
            measured = self._whole([texts[r][0] for r in short])
            for row, whole in zip(short, measured, strict=True):
                results[row] = whole
        pending = [row for row in range(len(items)) if results[row] is None]
        bound = self.first_chars
        while pending:
            bound = min(bound, self.cap_chars)
            prefixes = [whitespace_cut(texts[row][0], bound) for row in pending]
            encodings = self.tokenizer.encode_batch(prefixes, add_special_tokens=False)
            retry: list[int] = []
            for row, prefix, encoding in zip(pending, prefixes, encodings, strict=True):
                text, complete = texts[row]
                last = bound >= self.cap_chars or (complete and prefix == text)
                judged = self._judge(prefix, encoding, text, complete, last)
                if judged is None:
                    retry.append(row)
                else:
                    results[row] = judged
            pending = retry
            bound *= _GROWTH
        return self._shorten(results)

    def _whole(self, texts: list[str]) -> list[RowLength]:
        encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=True)
        out = []
        encoded = self.encoded
        for text, encoding in zip(texts, encodings, strict=True):
            ids = encoding.ids
            full = len(ids)
            if encoded is not None and full <= self.max_length:
                encoded.put(text, ids)
            out.append(
                RowLength(
                    min(full, self.max_length),
                    full=full,
                    over_max=full > self.max_length,
                    chars=len(text),
                )
            )
        return out

    def _judge(
        self, prefix: str, encoding: Any, text: str, complete: bool, last: bool
    ) -> RowLength | _Exact | None:
        """The row's length from its prefix's encoding, or None to try a longer prefix."""
        ids = encoding.ids
        count = len(ids)
        if complete and prefix == text:  # the whole text: exact
            full = count + self.specials
            return RowLength(
                min(full, self.max_length),
                full=full,
                over_max=full > self.max_length,
                chars=len(text),
            )
        words = encoding.word_ids
        final = words[-1] if words else None
        before = count  # tokens of the words before the prefix's last word
        while before and words[before - 1] == final:
            before -= 1
        keep = self.keep
        if self.strict:
            if before > keep:
                return RowLength(self.max_length, over_max=True, chars=len(prefix))
            if last:
                return RowLength(self.max_length, over_cap=True, chars=len(prefix))
            return None
        if before >= keep:
            kept_word = words[keep - 1]
            stop = keep
            while stop < count and words[stop] == kept_word:
                stop += 1
            end = encoding.offsets[stop - 1][1]
            return _Exact(prefix, end, ids[:keep])
        if last:  # the documented cap: the first cap_chars characters stand for the text
            full = count + self.specials
            return RowLength(min(full, self.max_length), text=prefix, chars=len(prefix))
        return None

    def _shorten(self, results: list[RowLength | _Exact | None]) -> list[RowLength]:
        """Each exact cut as the prefix ending with its last kept word, when that tokenises to
        the same kept ids (one batch for all such rows), else as the whole prefix."""
        exact = [(row, r) for row, r in enumerate(results) if isinstance(r, _Exact)]
        if exact:
            heads = [cut.prefix[: cut.end] for _, cut in exact]
            encodings = self.tokenizer.encode_batch_fast(heads, add_special_tokens=False)
            for (row, cut), head, encoding in zip(exact, heads, encodings, strict=True):
                same = encoding.ids[: self.keep] == cut.kept
                text = head if same else cut.prefix
                results[row] = RowLength(self.max_length, text=text, chars=len(cut.prefix))
        return [r for r in results if isinstance(r, RowLength)]


@dataclass(frozen=True, slots=True)
class _Exact:
    """A prefix whose first ``keep`` tokens are the whole text's: where its last kept word
    ends (characters) and those token ids."""

    prefix: str
    end: int
    kept: list[int]


def length_problem(truncator: PrefixTruncator, row: RowLength, where: str) -> str | None:
    """Why a model without truncation refuses ``row`` (a 400 message starting with
    ``where``), or None when it fits."""
    limit = truncator.max_length
    if row.full is not None and row.over_max:
        return f"{where}: {row.full} tokens, more than max_length {limit} (truncation is off)"
    if row.over_max:
        return (
            f"{where}: more than max_length {limit} tokens (its first {row.chars} "
            "characters already have more; truncation is off)"
        )
    if row.over_cap:
        return (
            f"{where}: longer than {truncator.cap_chars} characters, the most a model "
            f"without truncation reads to count tokens (max_length {limit}); shorten it "
            "or enable truncation"
        )
    return None


def bounded_texts(truncator: PrefixTruncator, texts: list[str]) -> list[str]:
    """``texts`` with each one longer than ``truncator.first_chars`` characters cut before
    tokenisation (the CPU stage's guard for requests that did not go through admission,
    such as calls from other models: the work stays bounded and the result is the same).

    Returns:
        ``texts`` itself when no text is that long (the common case: one ``len`` per text).
    """
    limit = truncator.first_chars
    long = [index for index, text in enumerate(texts) if len(text) > limit]
    if not long or not truncator.cuts:
        return texts
    out = list(texts)
    for index, row in zip(long, truncator.measure([texts[i] for i in long]), strict=True):
        if row.text is not None:
            out[index] = row.text
    return out
