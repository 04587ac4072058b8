"""The wire form of BYTES tensors, shared by the HTTP binary extension and gRPC raw contents.

A serialized BYTES tensor is its elements in row-major order, each written as a 4-byte
little-endian unsigned length followed by that many bytes. Fixed-size datatypes need no helper
here: their wire form is the little-endian array itself (``np.frombuffer`` / the array's
buffer).
"""

from __future__ import annotations

import struct

import numpy as np

from gpuserve.errors import BackendError, InvalidInputError

_U32 = struct.Struct("<I")
_MAX_ELEMENT_BYTES = 0xFFFFFFFF


def _present(data: bytes, total: int) -> int:
    """How many whole elements ``data`` (``total`` bytes) holds from its start."""
    pos = found = 0
    while pos + 4 <= total:
        (length,) = _U32.unpack_from(data, pos)
        if pos + 4 + length > total:
            break
        pos += 4 + length
        found += 1
    return found


def _fewer(name: str, model: str, count: int, got: int, size_label: str, total: int) -> str:
    # Triton's words (its qa tests compare them), then the byte size
    return (
        f"expected {count} string elements for inference input '{name}' for model "
        f"'{model}', got {got} ({size_label} {total})"
    )


def deserialize_bytes(
    buffer: memoryview | bytes,
    count: int,
    name: str,
    size_label: str = "binary_data_size",
    model: str = "",
) -> list[bytes]:
    """Split a serialized BYTES tensor into its elements.

    Args:
        buffer: Exactly the bytes of this tensor (its ``binary_data_size`` bytes): per
            element a uint32 little-endian length, then that many bytes.
        count: Element count the request's shape asks for (product of the shape).
        name: Input name, for messages.
        size_label: How messages name the buffer's size (``binary_data_size`` over HTTP,
            ``raw_input_contents size`` over gRPC).
        model: The model's name, for messages.

    Returns:
        ``count`` ``bytes`` objects, row-major (the caller reshapes them).

    Too few or too many elements are refused in Triton's words: ``expected 16 string
    elements for inference input 'INPUT1' for model 'm', got 14`` / ``unexpected number of
    string elements 17 for inference input 'INPUT1' for model 'm', expecting 16``.

    Raises:
        InvalidInputError: the buffer holds fewer or more than ``count`` elements, an
            element's length runs past the end, or bytes are left over.
    """
    total = len(buffer)
    data = bytes(buffer)  # one copy; slicing bytes is cheaper per element than a memoryview
    # Every element costs at least its 4-byte prefix: refuse impossible counts before looping.
    if count * 4 > total:
        got = _present(data, total)
        raise InvalidInputError(_fewer(name, model, count, got, size_label, total))
    unpack = _U32.unpack_from
    out: list[bytes] = []
    append = out.append
    pos = 0
    for index in range(count):
        if pos + 4 > total:
            if pos == total:  # the elements ended: fewer than the shape asks for
                raise InvalidInputError(_fewer(name, model, count, index, size_label, total))
            raise InvalidInputError(
                f"input {name!r}: BYTES element {index} starts at byte {pos} but its 4-byte "
                f"length prefix runs past the end of {size_label} {total}"
            )
        (length,) = unpack(data, pos)
        pos += 4
        end = pos + length
        if end > total:
            raise InvalidInputError(
                f"input {name!r}: BYTES element {index} declares {length} bytes but only "
                f"{total - pos} remain of {size_label} {total}"
            )
        append(data[pos:end])
        pos = end
    if pos != total:
        if total - pos >= 4 and pos + 4 + _U32.unpack_from(data, pos)[0] <= total:
            raise InvalidInputError(  # at least one more whole element: Triton's words
                f"unexpected number of string elements {count + 1} for inference input "
                f"'{name}' for model '{model}', expecting {count} ({size_label} {total}, "
                f"{count} elements use {pos} bytes)"
            )
        raise InvalidInputError(
            f"input {name!r}: {count} BYTES elements use {pos} bytes but {size_label} is "
            f"{total}; {total - pos} bytes are left over"
        )
    return out


def _not_bytes(name: str, item: object) -> BackendError:
    return BackendError(
        f"output {name!r} is declared BYTES but holds an element of type "
        f"{type(item).__name__} ({item!r:.40}); elements must be bytes or str"
    )


def _check_kind(array: np.ndarray, name: str) -> None:
    if array.dtype.kind not in "OSU":
        raise BackendError(
            f"output {name!r} is declared BYTES but the model returned a {array.dtype} array"
        )


def _to_bytes(item: object, name: str) -> bytes:
    if isinstance(item, bytes):
        return bytes(item)
    if isinstance(item, str):
        return item.encode()
    raise _not_bytes(name, item)


def _to_text(item: object, name: str) -> str:
    if isinstance(item, str):
        return str(item)
    if isinstance(item, bytes):
        return item.decode()
    raise _not_bytes(name, item)


def bytes_elements(array: np.ndarray, name: str) -> list[bytes]:
    """Flatten a BYTES output (``object`` of bytes/str, ``S`` or ``U`` array) to bytes, row-major.

    Args:
        array: The model's output, any shape; dtype ``object`` (``bytes``/``str`` elements),
            ``S`` or ``U``.
        name: Output name, for messages.

    Returns:
        ``array.size`` ``bytes`` objects in row-major order (``str`` elements UTF-8 encoded).

    Raises:
        BackendError: the array is numeric, or an element is neither bytes nor str.
    """
    _check_kind(array, name)
    items = array.ravel().tolist()
    if array.dtype.kind == "S":
        return items
    try:
        return [x if type(x) is bytes else x.encode() for x in items]
    except AttributeError:  # an element that is neither: take the slow, exact path
        return [_to_bytes(x, name) for x in items]


def bytes_as_text(array: np.ndarray, name: str) -> list[str]:
    """A BYTES output as JSON strings (UTF-8 decoded), row-major.

    Args:
        array: The model's output, any shape; dtype ``object`` (``bytes``/``str`` elements),
            ``S`` or ``U``.
        name: Output name, for messages.

    Returns:
        ``array.size`` ``str`` objects in row-major order.

    Raises:
        BackendError: an element is not valid UTF-8 (JSON cannot carry it; the client must
            request this output with ``binary_data``), or is neither bytes nor str.
    """
    _check_kind(array, name)
    items = array.ravel().tolist()
    if array.dtype.kind == "U":
        return items
    try:
        try:
            return [x if type(x) is str else x.decode() for x in items]
        except AttributeError:
            return [_to_text(x, name) for x in items]
    except UnicodeDecodeError:
        raise BackendError(
            f"output {name!r} has bytes that are not valid UTF-8, which JSON cannot carry; "
            f"request it with parameters.binary_data = true"
        ) from None


def serialize_bytes(elements: list[bytes], name: str) -> bytes:
    """Length-prefix and concatenate BYTES elements (the inverse of :func:`deserialize_bytes`).

    Args:
        elements: The tensor's elements, row-major (see :func:`bytes_elements`).
        name: Output name, for messages.

    Returns:
        The wire form: per element a 4-byte little-endian uint32 length, then its bytes;
        ``4 * len(elements) + sum(map(len, elements))`` bytes in all.

    Raises:
        BackendError: an element is longer than 4 GiB - 1, which the prefix cannot express.
    """
    try:
        prefixes = list(map(_U32.pack, map(len, elements)))
    except struct.error:
        raise BackendError(
            f"output {name!r} has an element longer than {_MAX_ELEMENT_BYTES} bytes"
        ) from None
    parts: list[bytes] = [b""] * (2 * len(elements))
    parts[0::2] = prefixes
    parts[1::2] = elements
    return b"".join(parts)
