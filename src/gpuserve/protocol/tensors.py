"""Validation and construction of input tensors, shared by the HTTP and gRPC codecs.

Everything a client sends about one input is checked here against the model's declared
:class:`~gpuserve.config.TensorSpec`: the datatype (exact match, no silent casting), the shape
(concrete, non-negative integers, batch dimension within ``1..max_batch_size``) and the data
(element count, element types and value ranges, byte sizes). Element counts are computed with
Python integers, so they cannot overflow, and are compared with the data actually received
before anything is allocated from the shape.

Policies:
    * Nested JSON ``data`` is flattened whatever its nesting (even ragged); only the total
      element count must equal the product of the shape. Numeric and BYTES data follow the
      same rule.
    * When the model batches, a batch dimension of 0 is refused; any other dimension declared
      ``-1`` may be 0 (an empty tensor such as ``[1, 0]``).
    * FP16/FP32 values beyond the type's finite range are refused rather than turned into
      infinity; values inside it are rounded to the nearest representable number.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from itertools import chain
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from gpuserve.errors import InvalidInputError
from gpuserve.protocol.binary import deserialize_bytes
from gpuserve.protocol.datatypes import DATATYPES, NUMPY_DTYPES

if TYPE_CHECKING:
    from gpuserve.config import ModelConfig, TensorSpec

_MAX_DIM = 2**63 - 1  # numpy dimensions are signed 64-bit
_INT_RANGES: dict[str, tuple[int, int]] = {
    name: (int(np.iinfo(dt).min), int(np.iinfo(dt).max))
    for name, dt in NUMPY_DTYPES.items()
    if dt.kind in "iu"
}
_FLOAT_MAX: dict[str, float] = {"FP16": 65504.0, "FP32": float(np.finfo(np.float32).max)}
# numpy < 2 wraps out-of-range Python ints on conversion instead of raising OverflowError
_NUMPY_WRAPS_INTS = np.lib.NumpyVersion(np.__version__) < "2.0.0"
_INT_ONLY = frozenset({int})
_REAL = frozenset({int, float})
_BOOL_ONLY = frozenset({bool})
_STR_ONLY = frozenset({str})
_JSON_TYPE_NAMES = {
    dict: "object",
    list: "array",
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type (``object``, ``array``, ``string``, ...)."""
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def show(value: Any, limit: int = 60) -> str:
    """A value as JSON text for a message, cut to ``limit`` characters."""
    try:
        text = orjson.dumps(value).decode()
    except TypeError:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_shape(shape: Sequence[Any]) -> str:
    """``[1, 16]``; non-integers shown as JSON (``[1, 16.0]``, ``["1", 16]``)."""
    return "[" + ", ".join(show(d, 30) for d in shape) + "]"


def declared_shape(spec: TensorSpec, max_batch_size: int) -> str:
    """The full shape a request must send, with ``-1`` for free dimensions."""
    dims = [-1, *spec.shape] if max_batch_size > 0 else list(spec.shape)
    return format_shape(dims)


def element_count(shape: Sequence[int]) -> int:
    """Number of elements of ``shape`` (exact, Python integers: no overflow)."""
    return math.prod(shape)


def check_datatype(spec: TensorSpec, name: str, datatype: Any) -> None:
    """Require the request's datatype to equal the declared one exactly.

    Raises:
        InvalidInputError: missing, not a V2 datatype, BF16, or a different datatype.
    """
    if datatype == spec.datatype:
        return
    if datatype is None:
        raise InvalidInputError(f"input {name!r}: 'datatype' is missing")
    if type(datatype) is not str:
        raise InvalidInputError(
            f"input {name!r}: 'datatype' must be a string such as {spec.datatype!r}, "
            f"got {json_type(datatype)} {show(datatype)}"
        )
    if datatype == "BF16":
        raise InvalidInputError(
            f"input {name!r}: datatype BF16 is not supported (no numpy equivalent); "
            f"the model expects {spec.datatype}"
        )
    if datatype not in DATATYPES:
        raise InvalidInputError(
            f"input {name!r}: datatype {show(datatype)} is not a KServe V2 datatype "
            f"(one of {', '.join(NUMPY_DTYPES)}); the model expects {spec.datatype}"
        )
    raise InvalidInputError(
        f"input {name!r}: datatype {datatype} does not match the model's {spec.datatype}"
    )


def check_shape(spec: TensorSpec, name: str, shape: Any, max_batch_size: int) -> tuple[int, ...]:
    """Validate a client-sent shape against the declared one.

    Args:
        spec: The declared input (shape without the batch dimension, ``-1`` = any).
        name: Input name, for messages.
        shape: As received: must be a list (or tuple) of non-negative integers.
        max_batch_size: The model's; when > 0 the shape is ``[batch] + dims`` with
            ``1 <= batch <= max_batch_size``.

    Returns:
        The shape as a tuple of ints.

    Raises:
        InvalidInputError: the message names the input, the shape received and the
            declared shape.
    """
    if type(shape) is not list and type(shape) is not tuple:
        if shape is None:
            raise InvalidInputError(f"input {name!r}: 'shape' is missing")
        raise InvalidInputError(
            f"input {name!r}: 'shape' must be an array of integers, got "
            f"{json_type(shape)} {show(shape)}"
        )
    for dim in shape:
        if type(dim) is not int:
            raise InvalidInputError(
                f"input {name!r}: shape {format_shape(shape)} must hold only integers; "
                f"{show(dim)} is a {json_type(dim)}"
            )
        if dim < 0:
            raise InvalidInputError(
                f"input {name!r}: shape {format_shape(shape)} has a negative dimension; "
                f"shapes sent by a client must be concrete non-negative integers"
            )
        if dim > _MAX_DIM:
            raise InvalidInputError(
                f"input {name!r}: shape {format_shape(shape)} has a dimension above 2^63-1"
            )
    dims = spec.shape
    batched = max_batch_size > 0
    if len(shape) != len(dims) + batched:
        batch_note = f" (the first dimension is the batch, 1..{max_batch_size})" if batched else ""
        raise InvalidInputError(
            f"input {name!r}: shape {format_shape(shape)} has {len(shape)} dimensions but "
            f"the model expects {len(dims) + batched}: "
            f"{declared_shape(spec, max_batch_size)}{batch_note}"
        )
    if batched:
        batch = shape[0]
        if batch == 0:
            raise InvalidInputError(
                f"input {name!r}: shape {format_shape(shape)}: batch dimension 0 is not "
                f"allowed (must be 1..max_batch_size, here 1..{max_batch_size})"
            )
        if batch > max_batch_size:
            raise InvalidInputError(
                f"input {name!r}: shape {format_shape(shape)}: batch dimension {batch} "
                f"exceeds max_batch_size {max_batch_size}"
            )
    for index, want in enumerate(dims, start=batched):
        if want != -1 and shape[index] != want:
            raise InvalidInputError(
                f"input {name!r}: shape {format_shape(shape)} does not match the model's "
                f"{declared_shape(spec, max_batch_size)}: dimension {index} is "
                f"{shape[index]}, expected {want}"
            )
    return tuple(shape)


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
        hint = f" (wrap it in a list: [{show(data)}])" if type(data) is str else ""
        raise InvalidInputError(
            f"input {name!r}: 'data' must be a JSON array, got {json_type(data)} {show(data)}{hint}"
        )
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
        limit = _FLOAT_MAX.get(datatype)
        if limit is not None and count:
            with np.errstate(over="ignore"):
                array = np.array(flat, dtype=dtype)
            if not np.isfinite(array).all():
                index = int(np.flatnonzero(~np.isfinite(array))[0])
                raise InvalidInputError(
                    f"input {name!r}: element {index} ({show(flat[index])}) is out of range "
                    f"for {datatype} (largest magnitude {limit:g})"
                )
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
) -> np.ndarray:
    """Build an input array from its raw little-endian bytes (no copy for fixed-size types).

    Args:
        spec: The declared input.
        name: Input name, for messages.
        shape: The validated request shape.
        raw: Exactly this tensor's bytes.
        size_label: How messages name the byte size (``binary_data_size`` over HTTP,
            ``raw_input_contents size`` over gRPC).

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
        items = deserialize_bytes(raw, count, name, size_label)
        array = np.empty(count, dtype=object)
        array[:] = items
        return _reshape(array, shape, name)
    dtype = NUMPY_DTYPES[datatype]
    need = count * dtype.itemsize
    if len(raw) != need:
        raise InvalidInputError(
            f"input {name!r}: {size_label} {len(raw)} does not match shape "
            f"{format_shape(shape)} {datatype} = {need} bytes"
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
) -> np.ndarray:
    """Validate one input and build its array: datatype, then shape, then data.

    Exactly one of ``json_data`` (parsed JSON ``data``) and ``raw`` (the tensor's bytes)
    must be given.

    Raises:
        InvalidInputError: any check fails; the message names the input.
    """
    check_datatype(spec, name, datatype)
    dims = check_shape(spec, name, shape, config.max_batch_size)
    if raw is not None:
        return array_from_raw(spec, name, dims, raw, size_label)
    if json_data is None:
        raise InvalidInputError(f"input {name!r}: no data (JSON 'data' or binary) was given")
    return array_from_json(spec, name, dims, json_data)


def validate_request_shapes(shapes: Mapping[str, Sequence[int]], config: ModelConfig) -> int | None:
    """Cross-input checks once every input is built.

    Args:
        shapes: Input name -> validated shape, for the inputs the request carries; every
            name must be a declared input (the codecs refuse unknown names first).
        config: The model's configuration.

    Returns:
        The request's batch size (rows) when the model batches, else None.

    Raises:
        InvalidInputError: a required input is missing, or inputs disagree on the batch
            dimension.
    """
    if len(shapes) != len(config.inputs):
        missing = [s.name for s in config.inputs if not s.optional and s.name not in shapes]
        if missing:
            raise InvalidInputError(
                f"missing required input(s) {', '.join(map(repr, missing))}; the model's "
                f"inputs are {', '.join(repr(s.name) for s in config.inputs)}"
            )
    if config.max_batch_size <= 0:
        return None
    batch = None
    for shape in shapes.values():
        if batch is None:
            batch = shape[0]
        elif shape[0] != batch:
            listing = ", ".join(f"{name!r} has {dims[0]}" for name, dims in shapes.items())
            raise InvalidInputError(
                f"inputs disagree on the batch dimension ({listing}); every input of one "
                f"request must have the same batch size"
            )
    return batch
