"""Decoding a BYTES tensor into one string per row, for the text models and backends.

Moved out of :mod:`gpuserve.models.sentence_embedding` (which still re-exports it) so that
backends and the built-in models both use it without importing each other.
"""

from __future__ import annotations

import numpy as np


def decode_texts(values: np.ndarray) -> list[str]:
    """Turn a BYTES tensor into strings, one per row.

    Args:
        values: numpy ``object`` array [B, 1] (or [B]) of ``bytes`` (``str`` is accepted too).

    Returns:
        B strings. Invalid UTF-8 is decoded with ``errors="replace"`` (each bad byte becomes
        U+FFFD, which the BERT tokenizer drops) rather than failing the whole batch. Served
        requests never bring any here: the admission step refuses them, one request at a
        time (:func:`~gpuserve.backends.text_admission.admit_texts`); this covers calls that
        skip admission, such as another model's.

    Raises:
        ValueError: ``values`` has more than one element per row.
        TypeError: an element is neither ``bytes`` nor ``str``.
    """
    if values.ndim == 0 or values.size != values.shape[0]:
        raise ValueError(f"expected one string per row, got shape {list(values.shape)}")
    texts = []
    for item in values.reshape(-1):
        if isinstance(item, bytes):
            texts.append(item.decode("utf-8", errors="replace"))
        elif isinstance(item, str):
            texts.append(item)
        else:
            raise TypeError(f"expected bytes or str elements, got {type(item).__name__}")
    return texts
