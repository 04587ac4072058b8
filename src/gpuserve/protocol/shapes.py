"""Checks of a client's datatype and shape against a model's declared input.

Shared by the HTTP and gRPC codecs. A well-formed shape is compared with the declared one by
:func:`gpuserve.engine.checks.check_input_shape`, which every runner also applies to every
request it takes (one message for one mistake, whatever the path). Element counts are Python
integers, so they cannot overflow. Policy: when the model batches, a batch dimension of 0 is
refused; any other dimension declared ``-1`` may be 0 (an empty tensor such as ``[1, 0]``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import orjson

from gpuserve.datatypes import DATATYPES, NUMPY_DTYPES
from gpuserve.engine.checks import batch_of, check_input_shape
from gpuserve.errors import InvalidInputError

if TYPE_CHECKING:
    from gpuserve.config import ModelConfig, TensorSpec

_MAX_DIM = 2**63 - 1  # numpy dimensions are signed 64-bit
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
    """The JSON name of a parsed value's type, for messages.

    Args:
        value: A value as orjson parses it (dict, list, str, int, float, bool or None).

    Returns:
        ``object``, ``array``, ``string``, ``integer``, ``number``, ``boolean`` or ``null``;
        the Python type's name for anything else.
    """
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def described(value: Any) -> str:
    """A value's JSON type and text for a message: ``string "abc"``, ``array [1, 2]``, and
    ``null`` alone (not ``null null``)."""
    if value is None:
        return "null"
    return f"{json_type(value)} {show(value)}"


def show(value: Any, limit: int = 60) -> str:
    """A value as JSON text for a message, cut to ``limit`` characters.

    Args:
        value: Any value; one orjson cannot write is shown with ``repr``.
        limit: Longest result, characters (a longer text ends in ``...``).

    Returns:
        At most ``limit`` characters.
    """
    try:
        text = orjson.dumps(value).decode()
    except TypeError:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_shape(shape: Sequence[Any]) -> str:
    """A shape as a message shows it: ``[1, 16]``.

    Args:
        shape: Dimensions as received; non-integers are shown as JSON (``[1, 16.0]``,
            ``["1", 16]``), each cut to 30 characters.

    Returns:
        The bracketed, comma-separated dimensions.
    """
    return "[" + ", ".join(show(d, 30) for d in shape) + "]"


def element_count(shape: Sequence[int]) -> int:
    """Number of elements of ``shape``.

    Args:
        shape: Non-negative dimensions, batch dimension included when there is one.

    Returns:
        The product of the dimensions, exact (Python integers: no overflow); 1 for ``()``.
    """
    return math.prod(shape)


def check_datatype(spec: TensorSpec, name: str, datatype: Any) -> None:
    """Require the request's datatype to equal the declared one exactly.

    Args:
        spec: The declared input; ``spec.datatype`` is a V2 datatype such as ``FP32``.
        name: Input name, for messages.
        datatype: As received (should be a string such as ``"FP32"``; anything is checked).

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
            f"got {described(datatype)}"
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
            f"input {name!r}: 'shape' must be an array of integers, got {described(shape)}"
        )
    for dim in shape:
        if type(dim) is float and dim.is_integer() and abs(dim) > _MAX_DIM:
            # JSON parsers read an integer beyond 64 bits as a float: say what it was
            raise InvalidInputError(
                f"input {name!r}: shape {format_shape(shape)} has a dimension above 2^63-1"
            )
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
    check_input_shape(spec, name, shape, max_batch_size)
    return tuple(shape)


def _listing(names: list[str]) -> str:
    return "[" + ",".join(f"'{name}'" for name in names) + "]"


def missing_inputs_error(
    given: list[str], config: ModelConfig, model_name: str | None = None
) -> InvalidInputError:
    """A request without all the model's required inputs, refused in Triton's words (its qa
    tests compare them): ``expected 2 inputs but got 1 inputs for model 'm'. Got input(s)
    ['A'], but missing required input(s) ['B']. Please provide all required input(s).``
    (``expected number of inputs between 2 and 3`` when some are optional).

    Args:
        given: The names of the inputs the request carries, in its order.
        config: The model's configuration (its ``inputs``; its ``name`` unless
            ``model_name`` is given).
        model_name: The model the request names.
    """
    required = [spec.name for spec in config.inputs if not spec.optional]
    missing = [name for name in required if name not in given]
    total = len(config.inputs)
    expected = (
        f"{total} inputs"
        if len(required) == total
        else f"number of inputs between {len(required)} and {total}"
    )
    return InvalidInputError(
        f"expected {expected} but got {len(given)} inputs for model "
        f"'{model_name or config.name or ''}'. Got "
        f"input(s) {_listing(given)}, but missing required input(s) {_listing(missing)}. "
        "Please provide all required input(s)."
    )


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
            raise missing_inputs_error(list(shapes), config)
    if config.max_batch_size <= 0:
        return None
    return batch_of(shapes)
