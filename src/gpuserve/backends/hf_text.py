"""Text pairs, SPLADE pooling and tokenisation for the ``huggingface`` backend.

Pairs (a cross-encoder's query and passage, a classifier's text pair): each row is
tokenised as the model was trained on, ``[CLS] first [SEP] second [SEP]`` for BERT, cut to
``max_length`` tokens. **The first text (the query) is kept whole where it fits**: a row
whose first text leaves room for at least one token of the second is cut in the second text
only (``only_second``); a row whose first text alone is too long is cut longest-first (both
sides, the longer one first), as sentence-transformers' ``CrossEncoder`` always does. For a
query shorter than half of ``max_length`` minus the special tokens the two agree.

Admission (:func:`admit_pairs`): both sides go through the model's
:class:`~gpuserve.text.truncation.PrefixTruncator` (each side cut before tokenisation to a
prefix holding at least its first ``max_length`` tokens, which is all a pair can keep of it),
and a row's cost is its pair's tokens after truncation. Without truncation a pair over
``max_length`` is refused with 400.

SPLADE (:func:`splade`): per text, ``max over tokens of log(1 + relu(logits))`` of the masked-LM
head, padding masked out, the ``k`` largest term weights kept.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuserve.backends.base import Admitted, Token
from gpuserve.backends.text_admission import admit_texts
from gpuserve.errors import InvalidInputError
from gpuserve.text.truncation import PrefixTruncator


def pair_lengths(
    firsts: list[int], seconds: list[int], single: int, pair: int, max_length: int
) -> list[int]:
    """Tokens of each pair after truncation.

    Args:
        firsts / seconds: Tokens of each side measured alone, ``single`` special tokens
            included.
        single / pair: Special tokens the tokenizer adds to one text / to a pair.
        max_length: The model's limit, tokens.
    """
    return [
        min(max_length, a - single + b - single + pair)
        for a, b in zip(firsts, seconds, strict=True)
    ]


def admit_pairs(
    truncator: PrefixTruncator,
    pair_specials: int,
    strict: bool,
    inputs: dict[str, np.ndarray],
    name: str,
    pair_name: str,
) -> Admitted:
    """The admission step of a pair model (see the module docstring); a request without
    ``pair_name`` is admitted as single texts.

    Raises:
        InvalidInputError: as :func:`~gpuserve.backends.text_admission.admit_texts`; the two inputs
            with different row counts; with ``strict``, a pair longer than ``max_length``.
    """
    first = admit_texts(truncator, inputs, name)
    if pair_name not in inputs:
        return first  # single texts: the truncator (strict or not) has judged them
    second = admit_texts(truncator, first.inputs or inputs, pair_name)
    if len(first.lengths) != len(second.lengths):
        raise InvalidInputError(
            f"inputs '{name}' and '{pair_name}' must have the same rows, got "
            f"{len(first.lengths)} and {len(second.lengths)}"
        )
    specials, limit = truncator.specials, truncator.max_length
    if strict:  # a side cut before tokenisation is itself over the limit
        cut = set(_cut_rows(first, inputs, name)) | set(_cut_rows(second, inputs, pair_name))
        for row, (a, b) in enumerate(zip(first.lengths, second.lengths, strict=True)):
            total = a - specials + b - specials + pair_specials
            if row in cut or total > limit:
                raise InvalidInputError(
                    f"inputs '{name}'/'{pair_name}' row {row}: the pair has more than "
                    f"max_length {limit} tokens (truncation is off)"
                )
    lengths = pair_lengths(
        list(first.lengths), list(second.lengths), specials, pair_specials, limit
    )
    return Admitted(tuple(lengths), second.inputs or first.inputs)


def _cut_rows(admitted: Admitted, inputs: dict[str, np.ndarray], name: str) -> list[int]:
    """Rows of ``name`` the admission step replaced (cut before tokenisation)."""
    if admitted.inputs is None:
        return []
    before = inputs[name].reshape(-1)
    after = admitted.inputs[name].reshape(-1)
    return [i for i in range(before.size) if before[i] is not after[i]]


def encode_pairs(
    tokenizer: Any,
    pair_tokenizer: Any,
    firsts: list[str],
    seconds: list[str],
    max_length: int,
    padding: str,
) -> Any:
    """Tokenise pairs (see :func:`pair_rows`) into padded ``pt`` tensors.

    Args:
        tokenizer: The transformers tokenizer (pads the rows).
        pair_tokenizer: The ``tokenizers.Tokenizer`` :func:`pair_rows` encodes with.

    Returns:
        The tokenizer's ``BatchEncoding``: ``input_ids`` etc. int64 ``[B, L]``.
    """
    rows = pair_rows(pair_tokenizer, firsts, seconds, max_length)
    return tokenizer.pad(rows, padding=padding, max_length=max_length, return_tensors="pt")


def pair_rows(
    tokenizer: Any,
    firsts: list[str],
    seconds: list[str],
    max_length: int,
    direction: str = "right",
) -> list[dict[str, list[int]]]:
    """Tokenise pairs (see the module docstring), unpadded: per pair, in input order, a dict
    of ``input_ids``, ``token_type_ids`` and ``attention_mask`` lists.

    Args:
        tokenizer: A ``tokenizers.Tokenizer`` owned by the caller's thread (its truncation
            is set here, call by call; padding must be off): the Rust core a transformers
            tokenizer calls, without its per-row Python conversions and offsets (about
            0.7x the time of calling the transformers tokenizer, same ids).
        max_length: The model's limit, tokens, special tokens included.
        direction: The tokenizer's truncation side.

    Each distinct first text is measured once (a rerank request repeats its query in every
    row).
    """
    pair_specials = int(tokenizer.num_special_tokens_to_add(True))
    distinct = list(dict.fromkeys(firsts))
    heads = tokenizer.encode_batch_fast(distinct, add_special_tokens=False)
    fitting = {
        text: len(head.ids) + pair_specials < max_length
        for text, head in zip(distinct, heads, strict=True)
    }
    rows: list[Any] = [None] * len(firsts)
    for strategy, chosen in (("only_second", True), ("longest_first", False)):
        index = [i for i, text in enumerate(firsts) if fitting[text] is chosen]
        if not index:
            continue
        tokenizer.enable_truncation(max_length, strategy=strategy, direction=direction)
        encoded = tokenizer.encode_batch_fast(
            [(firsts[i], seconds[i]) for i in index], add_special_tokens=True
        )
        for i, encoding in zip(index, encoded, strict=True):
            rows[i] = {
                "input_ids": encoding.ids,
                "token_type_ids": encoding.type_ids,
                "attention_mask": encoding.attention_mask,
            }
    return rows


def splade(logits: Any, attention_mask: Any, top_k: int) -> tuple[Any, Any]:
    """SPLADE pooling of a masked-LM head, row by row (one ``[L, V]`` at a time).

    Args:
        logits: float ``[B, L, V]``.
        attention_mask: int ``[B, L]``, 1 for real tokens.
        top_k: Terms kept per row (at most ``V``).

    Returns:
        (indices int64 ``[B, k]``, weights float32 ``[B, k]``), weights descending; zero
        weights where a row has fewer than ``k`` non-zero terms.
    """
    import torch

    k = min(top_k, int(logits.shape[-1]))
    values, indices = [], []
    for row in range(int(logits.shape[0])):
        mask = attention_mask[row].to(torch.float32).unsqueeze(-1)
        weights = torch.log1p(torch.relu(logits[row].float())) * mask
        pooled = weights.max(dim=0).values
        top = torch.topk(pooled, k)
        values.append(top.values)
        indices.append(top.indices)
    if not values:
        empty = torch.zeros((0, k))
        return empty.to(torch.int64), empty
    return torch.stack(indices).to(torch.int64), torch.stack(values)


def tokenize(tokenizer: Any, texts: list[str], add_special_tokens: bool) -> list[list[Token]]:
    """The tokens of each text with a ``tokenizers.Tokenizer`` (no truncation, no padding)."""
    encodings = tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
    out = []
    for encoding in encodings:
        tokens = []
        for tid, text, special, (start, stop) in zip(
            encoding.ids,
            encoding.tokens,
            encoding.special_tokens_mask,
            encoding.offsets,
            strict=True,
        ):
            is_special = bool(special)
            tokens.append(
                Token(
                    int(tid),
                    str(text),
                    is_special,
                    None if is_special else int(start),
                    None if is_special else int(stop),
                )
            )
        out.append(tokens)
    return out
