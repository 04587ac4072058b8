"""Pure helpers of the sequence batcher: a request's sequence flags, and the tensors the
server adds to each row (control inputs, implicit state).

A request names its sequence with the request parameters Triton's clients send
(``tritonclient`` over HTTP and gRPC alike): ``sequence_id`` (a non-zero unsigned 64-bit
integer or a non-empty string; 0 and ``""`` mean "no sequence"), ``sequence_start`` and
``sequence_end`` (booleans, default false).

Every array here has one row (the request's): shape ``[1, ...]`` when the model batches
(``max_batch_size > 0``), else the declared shape itself (a control input is then ``[1]``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuserve.config.sequence import ControlInput, StateSpec
from gpuserve.datatypes import numpy_dtype
from gpuserve.errors import InvalidInputError

#: A sequence id as the client sent it: an integer or a string (distinct ids even when equal
#: as text, as in Triton).
SequenceId = int | str

_UINT64_MAX = 2**64 - 1


@dataclass(slots=True, frozen=True)
class SequenceFlags:
    """A request's place in its sequence.

    Attributes:
        id: The sequence id.
        start: The request starts the sequence (a live one with this id restarts).
        end: The request ends it (the server releases it once the request has run).
    """

    id: SequenceId
    start: bool
    end: bool


def sequence_flags(parameters: dict[str, Any], model: str) -> SequenceFlags:
    """The sequence flags of a request to the sequence model ``model``.

    Raises:
        InvalidInputError: no ``sequence_id`` (or 0 / ``""``), an id that is neither an
            unsigned 64-bit integer nor a string, or flags that are not booleans.
    """
    raw = parameters.get("sequence_id")
    if raw is None or raw == 0 or raw == "":
        raise InvalidInputError(
            f"model '{model}' is a sequence model: every request needs parameter "
            "'sequence_id' (a non-zero integer or a non-empty string), with "
            "'sequence_start': true on the first request of a sequence"
        )
    if isinstance(raw, bool) or not isinstance(raw, (int, str)):
        raise InvalidInputError(
            f"parameter 'sequence_id': expected a non-zero integer or a non-empty string, "
            f"got {raw!r}"
        )
    if isinstance(raw, int) and not 0 < raw <= _UINT64_MAX:
        raise InvalidInputError(
            f"parameter 'sequence_id': {raw} is not an unsigned 64-bit integer (1..2^64-1)"
        )
    return SequenceFlags(
        raw, _flag(parameters, "sequence_start"), _flag(parameters, "sequence_end")
    )


def _flag(parameters: dict[str, Any], key: str) -> bool:
    value = parameters.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidInputError(f"parameter '{key}': expected true or false, got {value!r}")
    return value


def check_corrid(control: ControlInput, sequence_id: SequenceId, model: str) -> None:
    """Check that ``sequence_id`` fits the model's CORRID control datatype.

    Raises:
        InvalidInputError: a string id for a numeric CORRID that is not a decimal integer
            in range, or an integer out of the datatype's range.
    """
    datatype = control.dtype_name
    if datatype == "BYTES":
        return
    value = _as_int(sequence_id)
    low, high = _int_range(datatype)
    if value is None or not low <= value <= high:
        raise InvalidInputError(
            f"parameter 'sequence_id': {sequence_id!r} does not fit model '{model}' ("
            f"correlation id input {control.name!r} is {datatype}: an integer in "
            f"{low}..{high})"
        )


@functools.cache
def _int_range(datatype: str) -> tuple[int, int]:
    info = np.iinfo(numpy_dtype(datatype))
    return int(info.min), int(info.max)


def _as_int(sequence_id: SequenceId) -> int | None:
    if isinstance(sequence_id, int):
        return sequence_id
    text = sequence_id.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    return None


def control_array(control: ControlInput, flags: SequenceFlags, batched: bool) -> np.ndarray:
    """The value of ``control`` for one row: shape ``[1, 1]`` (batched) or ``[1]``.

    START/END carry the request's flags, READY is always true (a row holds a request), CORRID
    the sequence id (as bytes for BYTES).
    """
    shape = (1, 1) if batched else (1,)
    dtype = numpy_dtype(control.dtype_name)
    if control.kind == "corrid":
        if control.dtype_name == "BYTES":
            return np.full(shape, str(flags.id).encode(), dtype=object)
        value = _as_int(flags.id)
        return np.full(shape, value if value is not None else 0, dtype=dtype)
    if control.kind == "start":
        on = flags.start
    elif control.kind == "end":
        on = flags.end
    else:  # ready
        on = True
    false, true = control.values
    return np.full(shape, true if on else false, dtype=dtype)


def initial_state(state: StateSpec, batched: bool) -> np.ndarray:
    """The zeros a sequence's ``state`` starts with (``[1, *start_shape]`` when batched)."""
    shape = state.start_shape
    return np.zeros((1, *shape) if batched else shape, dtype=numpy_dtype(state.datatype))


def state_shape(array: np.ndarray, batched: bool) -> tuple[int, ...]:
    """A state array's shape without its batch dimension (rows of different states' shapes
    cannot be stacked into one batch)."""
    return tuple(array.shape[1:]) if batched else tuple(array.shape)
