"""The per-row sequence ids of a batch, as the engine hands them to a backend.

The engine adds :data:`CORRELATION_INPUT` to the requests of ``python``-backend models that
name a ``sequence_id`` (see :mod:`gpuserve.engine.correlation`); the python backend reads it
with :func:`correlation_ids` (Triton's ``request.correlation_id()``) and takes it out with
:func:`without_correlation_input` before model code sees the inputs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: The input that carries the rows' sequence ids: ``object [rows]``, each an ``int`` or a
#: ``str`` (``b""`` on a sequence batch's filler row). A name no model input can collide with:
#: the double-underscore prefix is the server's.
CORRELATION_INPUT = "__gpuserve_correlation_id__"

#: What a row without a sequence id carries (Triton's correlation id 0).
NO_ID = 0


def sequence_id_of(parameters: dict[str, Any]) -> int | str | None:
    """A request's ``sequence_id`` parameter when it is a usable id (a non-zero integer or a
    non-empty string), else None."""
    value = parameters.get("sequence_id")
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return None
    return value if value else None


def correlation_ids(inputs: dict[str, np.ndarray], rows: int) -> list[int | str]:
    """The sequence id of each of a batch's ``rows`` (``NO_ID`` where there is none).

    Args:
        inputs: The batch's inputs, :data:`CORRELATION_INPUT` among them or not.
        rows: Rows in the batch.
    """
    ids = inputs.get(CORRELATION_INPUT)
    if ids is None:
        return [NO_ID] * rows
    return [_id(value) for value in ids.reshape(-1)[:rows]] + [NO_ID] * (rows - ids.size)


def _id(value: Any) -> int | str:
    if isinstance(value, bytes):  # a filler row's b""
        return value.decode("utf-8", "replace") if value else NO_ID
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, str):
        return value
    return NO_ID


def without_correlation_input(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``inputs`` without :data:`CORRELATION_INPUT` (the same dict when it has none)."""
    if CORRELATION_INPUT not in inputs:
        return inputs
    return {name: array for name, array in inputs.items() if name != CORRELATION_INPUT}
