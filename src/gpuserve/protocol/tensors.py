"""Validation and construction of input tensors, shared by the HTTP and gRPC codecs.

Everything a client sends about one input is checked against the model's declared
:class:`~gpuserve.config.TensorSpec`: the datatype (exact match, no silent casting) and the
shape (see :mod:`gpuserve.protocol.shapes`), then the data here (element count, element types
and value ranges, byte sizes). Element counts are Python integers, so they cannot overflow,
and are compared with the data actually received before anything is allocated from the shape.

Policies:
    * Nested JSON ``data`` is flattened whatever its nesting (even ragged); only the total
      element count must equal the product of the shape. Numeric and BYTES data follow the
      same rule.
    * When the model batches, a batch dimension of 0 is refused; any other dimension declared
      ``-1`` may be 0 (an empty tensor such as ``[1, 0]``).
    * FP16/FP32 values that would round to infinity are refused; others are rounded to the
      nearest representable number (so the shortest text of the largest finite value parses).
"""

from __future__ import annotations

import math
from itertools import chain
from typing import TYPE_CHECKING, Any

import numpy as np

from gpuserve.datatypes import NUMPY_DTYPES
from gpuserve.errors import InvalidInputError
from gpuserve.protocol.binary import deserialize_bytes
from gpuserve.protocol.shapes import (
    check_datatype,
    check_shape,
    described,
    element_count,
    format_shape,
    json_type,
    show,
    validate_request_shapes,
)

if TYPE_CHECKING:
    from gpuserve.config import ModelConfig, TensorSpec
    from gpuserve.protocol.limits import RequestLimits

__all__ = [
    "array_from_json",
    "array_from_raw",
    "build_input",
    "check_datatype",
    "check_shape",
    "element_count",
    "validate_request_shapes",
]

_INT_RANGES: dict[str, tuple[int, int]] = {
    name: (int(np.iinfo(dt).min), int(np.iinfo(dt).max))
    for name, dt in NUMPY_DTYPES.items()
    if dt.kind in "iu"
}
# Smallest magnitude that rounds to infinity (round-to-nearest-even: max + half an ulp),
# so that the shortest text of the largest finite value (e.g. 3.4028235e38) still parses.
_FLOAT_OVERFLOW: dict[str, float] = {"FP16": 65520.0, "FP32": (2 - 2**-24) * 2.0**127}
_FLOAT_MAX: dict[str, float] = {"FP16": 65504.0, "FP32": float(np.finfo(np.float32).max)}
_SMALL = 4096  # below this, Python's min/max beat numpy's per-call overhead
# numpy < 2 wraps out-of-range Python ints on conversion instead of raising OverflowError
_NUMPY_WRAPS_INTS = np.lib.NumpyVersion(np.__version__) < "2.0.0"
_INT_ONLY = frozenset({int})
_REAL = frozenset({int, float})
_BOOL_ONLY = frozenset({bool})
_STR_ONLY = frozenset({str})


def _flatten(data: list[Any], types: set[type]) -> tuple[list[Any], set[type]]:
    """Flatten nested lists (any depth, ragged allowed); also return the leaf types.

    Args:
        data: The nested list.
        types: ``set(map(type, data))``, which the caller has already computed.

    Each level costs C-speed passes (``map``/``chain``), not a Python loop per element,
    except for levels that mix lists and scalars.
    """
    while list in types:
        if len(types) == 1:
            data = list(chain.from_iterable(data))
        else:
            mixed: list[Any] = []
            for item in data:
                if type(item) is list:
                    mixed.extend(item)
                else:
                    mixed.append(item)
            data = mixed
        types = set(map(type, data))
    return data, types


def _bad_element(name: str, datatype: str, flat: list[Any], allowed: frozenset[type]) -> None:
    index, value = next((i, v) for i, v in enumerate(flat) if type(v) not in allowed)
    if datatype in _INT_RANGES and type(value) is float and value.is_integer():
        # orjson reads integers beyond the 64-bit range as floats
        low, high = _INT_RANGES[datatype]
        if not low <= value <= high:
            raise InvalidInputError(
                f"input {name!r}: element {index} ({show(value)}) is out of range for "
                f"{datatype} ({low}..{high})"
            )
    wanted = {
        "BOOL": "JSON booleans (true/false)",
        "BYTES": "JSON strings",
        "FP16": "JSON numbers",
        "FP32": "JSON numbers",
        "FP64": "JSON numbers",
    }.get(datatype, "JSON integers")
    raise InvalidInputError(
        f"input {name!r}: {datatype} data must be {wanted}; element {index} is "
        f"{show(value)} ({json_type(value)})"
    )


def _out_of_range(name: str, datatype: str, flat: list[int]) -> InvalidInputError:
    low, high = _INT_RANGES[datatype]
    index, value = next((i, v) for i, v in enumerate(flat) if not low <= v <= high)
    return InvalidInputError(
        f"input {name!r}: element {index} ({value}) is out of range for {datatype} ({low}..{high})"
    )


def _reshape(array: np.ndarray, shape: tuple[int, ...], name: str) -> np.ndarray:
    try:
        return array.reshape(shape)
    except ValueError as err:  # e.g. an empty tensor whose other dims exceed numpy's limits
        raise InvalidInputError(
            f"input {name!r}: shape {format_shape(shape)} cannot be represented: {err}"
        ) from None


def _narrow_floats(name: str, datatype: str, flat: list[Any], limit: float) -> np.ndarray:
    """FP16/FP32 from JSON numbers, refusing values that would round to infinity."""
    dtype = NUMPY_DTYPES[datatype]
    if len(flat) <= _SMALL:
        overflow = max(flat) >= limit or min(flat) <= -limit
        array = None
    else:
        wide = np.array(flat, dtype=np.float64)  # JSON numbers always fit in float64
        overflow = bool(np.abs(wide).max() >= limit)
        array = None if overflow else wide.astype(dtype)
    if overflow:
        index, value = next((i, v) for i, v in enumerate(flat) if abs(v) >= limit)
        raise InvalidInputError(
            f"input {name!r}: element {index} ({show(value)}) is out of range for {datatype} "
            f"(largest finite magnitude {_FLOAT_MAX[datatype]:g})"
        )
    return np.array(flat, dtype=dtype) if array is None else array


def _not_a_list(name: str, data: Any) -> InvalidInputError:
    hint = f" (wrap it in a list: [{show(data)}])" if type(data) is str else ""
    return InvalidInputError(
        f"input {name!r}: 'data' must be a JSON array, got {described(data)}{hint}"
    )


def array_from_json(spec: TensorSpec, name: str, shape: tuple[int, ...], data: Any) -> np.ndarray:
    """Build an input array from JSON ``data`` (already parsed by orjson).

    Args:
        spec: The declared input; its datatype gives the numpy dtype.
        name: Input name, for messages.
        shape: The validated request shape (see :func:`check_shape`).
        data: Flat or nested list of elements (nesting is flattened; see module policies).

    Returns:
        An array of the declared dtype with ``shape``; BYTES gives an ``object`` array of
        ``bytes`` (strings UTF-8 encoded).

    Raises:
        InvalidInputError: ``data`` is not a list, the element count differs from the
            shape's, or an element has the wrong JSON type or is out of range.
    """
    if type(data) is not list:
        raise _not_a_list(name, data)
    types = set(map(type, data))
    flat = data
    if list in types:
        flat, types = _flatten(data, types)
    count = math.prod(shape)
    if len(flat) != count:
        raise InvalidInputError(
            f"input {name!r}: shape {format_shape(shape)} needs {count} elements, got {len(flat)}"
        )
    datatype = spec.datatype
    dtype = NUMPY_DTYPES[datatype]
    if datatype in _INT_RANGES:
        if not types <= _INT_ONLY:
            _bad_element(name, datatype, flat, _INT_ONLY)
        try:
            array = np.array(flat, dtype=dtype)
        except OverflowError:
            raise _out_of_range(name, datatype, flat) from None
        if _NUMPY_WRAPS_INTS and count:  # pragma: no cover
            low, high = _INT_RANGES[datatype]  # numpy 1.x wraps instead of raising
            if min(flat) < low or max(flat) > high:
                raise _out_of_range(name, datatype, flat)
    elif datatype == "BYTES":
        if not types <= _STR_ONLY:
            _bad_element(name, datatype, flat, _STR_ONLY)
        array = np.empty(count, dtype=object)
        array[:] = list(map(str.encode, flat))
    elif datatype == "BOOL":
        if not types <= _BOOL_ONLY:
            _bad_element(name, datatype, flat, _BOOL_ONLY)
        array = np.array(flat, dtype=dtype)
    else:
        if not types <= _REAL:
            _bad_element(name, datatype, flat, _REAL)
        limit = _FLOAT_OVERFLOW.get(datatype)
        if limit is not None and count:
            array = _narrow_floats(name, datatype, flat, limit)
        else:
            array = np.array(flat, dtype=dtype)
    try:
        return array.reshape(shape)
    except ValueError:
        return _reshape(array, shape, name)


def array_from_raw(
    spec: TensorSpec,
    name: str,
    shape: tuple[int, ...],
    raw: memoryview | bytes,
    size_label: str = "binary_data_size",
    model: str = "",
) -> np.ndarray:
    """Build an input array from its raw little-endian bytes (no copy for fixed-size types).

    Args:
        spec: The declared input.
        name: Input name, for messages.
        shape: The validated request shape.
        raw: Exactly this tensor's bytes.
        size_label: How messages name the byte size (``binary_data_size`` over HTTP,
            ``raw_input_contents size`` over gRPC).
        model: The model's name, for messages.

    Returns:
        For fixed-size types a (possibly read-only, possibly unaligned) view of ``raw``;
        for BYTES an ``object`` array of ``bytes``.

    Raises:
        InvalidInputError: the byte size does not match the shape, malformed BYTES
            elements, or BOOL bytes other than 0 and 1.
    """
    datatype = spec.datatype
    count = element_count(shape)
    if datatype == "BYTES":
        items = deserialize_bytes(raw, count, name, size_label, model)
        array = np.empty(count, dtype=object)
        array[:] = items
        return _reshape(array, shape, name)
    dtype = NUMPY_DTYPES[datatype]
    need = count * dtype.itemsize
    if len(raw) != need:
        raise InvalidInputError(  # Triton's words first (its qa tests compare them)
            f"input byte size mismatch for input '{name}' for model '{model}'. Expected "
            f"{need}, got {len(raw)} (input {name!r}: {size_label} {len(raw)} does not match "
            f"shape {format_shape(shape)} {datatype} = {need} bytes)"
        )
    if datatype == "BOOL" and need and np.frombuffer(raw, dtype=np.uint8).max() > 1:
        raise InvalidInputError(
            f"input {name!r}: BOOL bytes must be 0 or 1, got "
            f"{int(np.frombuffer(raw, dtype=np.uint8).max())}"
        )
    return _reshape(np.frombuffer(raw, dtype=dtype), shape, name)


def build_input(
    spec: TensorSpec,
    name: str,
    datatype: Any,
    shape: Any,
    *,
    json_data: Any = None,
    raw: memoryview | bytes | None = None,
    config: ModelConfig,
    size_label: str = "binary_data_size",
    limits: RequestLimits | None = None,
) -> np.ndarray:
    """Validate one input and build its array: datatype, then shape, then data.

    Exactly one of ``json_data`` (parsed JSON ``data``) and ``raw`` (the tensor's bytes)
    must be given. ``limits`` (None: none) are checked on the shape before the data is
    read, and on BYTES element lengths after.

    Args:
        spec: The declared input (V2 datatype, shape without the batch dimension).
        name: Input name, for messages.
        datatype: The request's ``datatype`` as received (see :func:`check_datatype`).
        shape: The request's ``shape`` as received (see :func:`check_shape`).
        json_data: The input's JSON ``data`` (flat or nested list), or None.
        raw: Exactly this input's bytes (HTTP binary extension or gRPC
            ``raw_input_contents``), or None.
        config: The model's configuration (its ``max_batch_size``).
        size_label: How messages name the byte size of ``raw``.
        limits: Server-wide size limits, or None for none.

    Returns:
        An array of shape ``tuple(shape)`` (batch dimension first when the model batches)
        and the numpy dtype of ``spec.datatype``: ``object`` holding ``bytes`` for BYTES,
        ``bool`` for BOOL, e.g. ``float32`` for FP32. From ``raw`` it may be a read-only
        view of the request's buffer.

    Raises:
        InvalidInputError: any check fails; the message names the input.
    """
    if json_data is not None and type(json_data) is not list:
        raise _not_a_list(name, json_data)  # a structural error: report it first
    check_datatype(spec, name, datatype)
    dims = check_shape(spec, name, shape, config.max_batch_size)
    if limits is not None:
        limits.check_elements(name, dims)
    if raw is not None:
        array = array_from_raw(spec, name, dims, raw, size_label, config.name or "")
    elif json_data is None:
        raise InvalidInputError(f"input {name!r}: no data (JSON 'data' or binary) was given")
    else:
        array = array_from_json(spec, name, dims, json_data)
    if limits is not None and spec.datatype == "BYTES":
        limits.check_bytes(name, array)
    return array
