"""Streaming detokenisation and stop strings: token ids in, whole characters out.

:class:`IncrementalDetokenizer` turns one sequence's tokens into text as they are generated.
A byte-level BPE token can end in the middle of a UTF-8 character (an emoji or a CJK character
is often two to four tokens); decoding it alone gives ``"\\ufffd"``. The detokenizer keeps a
small window of recent tokens and, per new token, decodes the window with and without the
held tokens and emits the difference once it no longer ends in ``"\\ufffd"`` (the offset-window
technique: two decodes of a few tokens per step, whatever the output's length). Everything
it emits, then :meth:`IncrementalDetokenizer.flush`, adds up to
``tokenizer.decode(output_ids, skip_special_tokens=...)`` (byte-level BPE tokenizers such as
GPT-2's, Llama 3's, SmolLM's and Qwen's; SentencePiece tokenizers with byte fallback, such as
Llama 2's, too, for any valid UTF-8 text). One exception: byte-fallback tokens that never form
valid UTF-8 (garbage a model should not produce) are replaced by ``"\ufffd"`` all together by
``decode``, a context no window can see; the stream then shows some of those bytes' neighbours
that ``decode`` replaced.

:class:`StopStrings` watches that text for the request's stop strings, holding back text that
could be the beginning of one until the next text tells.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

#: What a decode of an incomplete UTF-8 sequence ends with.
REPLACEMENT = "\ufffd"

#: Prompt tokens read as context when ``context_from_prompt`` is set.
_PROMPT_CONTEXT_TOKENS = 6


class TokenDecoder(Protocol):
    """The one method of a tokenizer this module uses (Hugging Face's ``decode``)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str:
        """The text of ``token_ids``."""
        ...


class IncrementalDetokenizer:
    """One sequence's output text, a token at a time.

    Example::

        detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        for token in generated:
            send(detok.add(token))
        send(detok.flush())
    """

    def __init__(
        self,
        tokenizer: TokenDecoder,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
        *,
        context_from_prompt: bool = False,
    ) -> None:
        """
        Args:
            tokenizer: Decodes token ids (a Hugging Face tokenizer).
            prompt_ids: The sequence's prompt.
            skip_special_tokens: Leave special tokens out of the text (as ``decode`` does).
            context_from_prompt: Start the window in the prompt's last tokens, so the first
                output token is read as the middle of a text. For byte-level BPE tokenizers
                (GPT-2, Llama 3, SmolLM, Qwen) this changes nothing; for SentencePiece ones
                (Llama 2, Mistral) it keeps the output's leading space, which
                ``decode(output_ids)`` drops. False (the default): the text is exactly
                ``decode(output_ids)``.
        """
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:]) if context_from_prompt else []
        self._ids: list[int] = context
        # decode(ids[_prefix:_read]) was emitted (or is context); ids[_read:] are held
        self._prefix = 0
        self._read = len(context)
        self._prefix_text: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Take the next generated token; return the text it completes (possibly ``""``:
        the token ends inside a character, or decodes to nothing)."""
        self._ids.append(token_id)
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT):
            return ""
        new = text[len(self._prefix_text) :]
        # the emitted tokens become the context of the next ones; the window stays small
        self._prefix = self._read
        self._read = len(self._ids)
        self._prefix_text = None
        self._trim()
        return new

    def flush(self) -> str:
        """The text still held at the end of the sequence (an incomplete character decodes
        as ``"\\ufffd"`` here, as ``decode`` gives it)."""
        if self._read >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read
        self._read = len(self._ids)
        self._prefix_text = None
        self._trim()
        return text[len(prefix_text) :]

    def _trim(self) -> None:
        """Forget the tokens before the window (they are never decoded again)."""
        if self._prefix > 0:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0


class StopStrings:
    """Finds a request's stop strings in its streamed text.

    ``feed`` returns the text that is safe to send now; text that could be the start of a
    stop string is held until later text settles it. When stop strings overlap, the one whose
    end comes first wins (the one a character-by-character reader meets first; at equal ends
    the longer), so the result does not depend on how the text was split into pieces.
    """

    def __init__(self, stops: Sequence[str], include_in_output: bool = False) -> None:
        """
        Args:
            stops: The stop strings, none empty.
            include_in_output: Keep the matched stop string at the end of the output
                (else the output ends right before it).

        Raises:
            ValueError: An empty stop string.
        """
        if any(not stop for stop in stops):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(dict.fromkeys(stops))
        self._include = include_in_output
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """Whether a stop string was found."""
        return self._stopped

    def feed(self, text: str) -> tuple[str, bool]:
        """Take the next piece of output text.

        Returns:
            The text to send now, and whether a stop string ended the output (then nothing
            more is ever returned: ``feed`` gives ``("", True)``, ``flush`` ``""``).
        """
        if self._stopped:
            return "", True
        if not self._stops:
            return text, False
        buffer = self._held + text
        match = self._first_match(buffer)
        if match is not None:
            start, end = match
            self._stopped = True
            self._held = ""
            return buffer[: end if self._include else start], True
        keep = self._partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """The held text, at the end of the output (no stop string was completed)."""
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _first_match(self, buffer: str) -> tuple[int, int] | None:
        """(start, end) of the stop string that ends first in ``buffer``, or None."""
        best: tuple[int, int] | None = None
        for stop in self._stops:
            start = buffer.find(stop)
            if start < 0:
                continue
            end = start + len(stop)
            if best is None or end < best[1] or (end == best[1] and start < best[0]):
                best = (start, end)
        return best

    def _partial_suffix(self, buffer: str) -> int:
        """Length of the longest end of ``buffer`` that is a proper beginning of a stop."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest
