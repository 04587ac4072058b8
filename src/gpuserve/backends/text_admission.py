"""The admission step of a text model: each row's tokens, counted (and long rows cut) before
tokenisation by the model's :class:`~gpuserve.text.truncation.PrefixTruncator`, as the
backend contract's :class:`~gpuserve.backends.base.Admitted`.

Here rather than in :mod:`gpuserve.text`: the text helpers know nothing of the backend
contract (``text`` sits below ``backends``), and every text model (the ``huggingface``
backend, the built-in models) reaches this step through the backends.
"""

from __future__ import annotations

import numpy as np

from gpuserve.backends.base import Admitted
from gpuserve.errors import InvalidInputError
from gpuserve.text.truncation import PrefixTruncator, RowLength, length_problem


def admit_texts(truncator: PrefixTruncator, inputs: dict[str, np.ndarray], name: str) -> Admitted:
    """The admission step of a text model: each row's tokens, and the rows cut before
    tokenisation (:mod:`gpuserve.text.truncation`).

    Args:
        truncator: The model's truncator.
        inputs: The request's inputs; ``inputs[name]`` is BYTES [B, 1] (or [B]).
        name: The input holding one text per row.

    Returns:
        ``lengths``: B token counts (special tokens included, after truncation);
        ``inputs``: the request's inputs with the cut rows replaced (UTF-8), or None when no
        row was cut.

    Raises:
        InvalidInputError: the input is missing, holds more than one text per row or a row
            that is not UTF-8 (its row and byte offset); with a strict truncator, a row
            longer than ``max_length`` (its count and the limit) or longer than the
            character cap when its count could not be told within it.
    """
    values = inputs.get(name)
    if values is None:
        raise InvalidInputError(f"input '{name}' is missing; the model reads its texts there")
    if values.ndim == 0 or values.size != values.shape[0]:
        raise InvalidInputError(
            f"input '{name}': expected one text per row, got shape {list(values.shape)}"
        )
    flat = values.reshape(-1)
    try:
        rows = truncator.measure(_strict_texts(flat, name))
    except TypeError as err:
        raise InvalidInputError(f"input '{name}': {err}") from None
    if truncator.strict:
        _refuse_long(truncator, rows, name)
    lengths = tuple(row.tokens for row in rows)
    cut = [(index, row.text) for index, row in enumerate(rows) if row.text is not None]
    if not cut:
        return Admitted(lengths)
    replaced = values.copy()
    target = replaced.reshape(-1)
    for index, text in cut:
        target[index] = text.encode("utf-8")
    return Admitted(lengths, {**inputs, name: replaced})


def _strict_texts(flat: np.ndarray, name: str) -> list[bytes | str]:
    """The rows as text, decoded once (the truncator takes ``str`` as is). A row that is not
    UTF-8 is refused (400 naming the row and the byte) rather than embedded as what is left of
    it: the tokenizer drops replacement characters, so bytes that are not text would silently
    embed as the rest of the row (or as an empty string). Other element types pass through
    for the truncator to refuse."""
    texts: list[bytes | str] = []
    for index, item in enumerate(flat):
        if isinstance(item, bytes):
            try:
                item = item.decode("utf-8")
            except UnicodeDecodeError as err:
                where = f"input '{name}'" + (f" row {index}" if flat.size > 1 else "")
                raise InvalidInputError(
                    f"{where} is not valid UTF-8 (byte 0x{item[err.start]:02x} at offset "
                    f"{err.start}: {err.reason}); the model takes UTF-8 text"
                ) from None
        texts.append(item)
    return texts


def _refuse_long(truncator: PrefixTruncator, rows: list[RowLength], name: str) -> None:
    """Raise for the first row a model without truncation cannot take."""
    for index, row in enumerate(rows):
        where = f"input '{name}'" + (f" row {index}" if len(rows) > 1 else "")
        problem = length_problem(truncator, row, where)
        if problem is not None:
            raise InvalidInputError(problem)


__all__ = ["admit_texts"]
