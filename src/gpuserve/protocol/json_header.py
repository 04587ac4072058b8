"""Parsing the JSON part of an HTTP inference request, with strict duplicate-key detection.

orjson silently keeps the last of two equal keys, so a request with two ``"inputs"`` keys
would be half-ignored. A second parse with Python's :mod:`json` and an ``object_pairs_hook``
catches duplicates but costs several times orjson's parse, so it runs only when a cheap proof
that no key is repeated fails. The proof counts colons:

* In valid JSON, every colon outside a string separates one key from its value, so
  ``header.count(b":") == raw_keys + colons_inside_raw_strings``.
* orjson's result can only have *fewer* keys and strings than the raw text (a repeated key
  collapses, and the value it replaces is gone).
* So if the parsed document accounts for every colon byte, nothing was dropped.

Step 1 counts the parsed keys, skipping ``data`` arrays (a JSON tensor costs nothing) and
proves the typical request, whose strings hold no colon. Step 2 re-serializes the document
with orjson (C speed; it writes one colon per key plus the string colons, unescaped) and
compares colon counts; ``\\u003a`` escapes make step 2 unsound, so they skip it. Only a real
duplicate, or an escaped colon, pays for the exact second parse.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from gpuserve.errors import InvalidInputError
from gpuserve.protocol.shapes import json_type


class _DuplicateKeyError(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKeyError(key)
            seen.add(key)
    return result


def _count_keys(obj: dict[str, Any]) -> int:
    """Keys of ``obj`` and of objects nested in it; may under-count, never over-count.

    ``data`` arrays and arrays that do not start with an object or array (shapes) are not
    walked, so a JSON tensor costs nothing here.
    """
    count = len(obj)
    for key, value in obj.items():
        kind = type(value)
        if kind is dict:
            count += _count_keys(value)
        elif kind is list and value and key != "data":
            first = type(value[0])
            if first is dict or first is list:
                count += _count_keys_in_list(value)
    return count


def _count_keys_in_list(items: list[Any]) -> int:
    count = 0
    for item in items:
        kind = type(item)
        if kind is dict:
            count += _count_keys(item)
        elif kind is list:
            count += _count_keys_in_list(item)
    return count


def _has_no_duplicates(header: bytes | bytearray, document: dict[str, Any]) -> bool:
    """A cheap proof that no object of ``document`` lost a repeated key (False: not proven)."""
    colons = header.count(b":")
    if _count_keys(document) == colons:
        return True
    if b"\\u003a" in header or b"\\u003A" in header:
        return False  # an escaped colon is invisible to the byte count
    # orjson writes one colon per key plus the colons inside strings, unescaped
    try:
        return orjson.dumps(document).count(b":") == colons
    except orjson.JSONEncodeError:  # nested deeper than orjson writes
        return False


def _position(err: orjson.JSONDecodeError) -> str:
    return f"{err.msg} at line {err.lineno} column {err.colno} (char {err.pos})"


def _byte_offset(err: orjson.JSONDecodeError) -> int:
    """orjson reports character offsets; the header length is in bytes."""
    doc = err.doc
    return len(doc[: err.pos].encode()) if isinstance(doc, str) else err.pos


def _trailing_data_end(header: bytes | bytearray, bad_utf8_at: int) -> int | None:
    """Where a JSON document ends when invalid UTF-8 comes after it (binary data), else None.

    orjson checks the UTF-8 of the whole input before parsing, so a JSON document followed by
    raw tensor bytes first looks like an encoding error; parsing the valid prefix tells the two
    apart.
    """
    try:
        orjson.loads(header[:bad_utf8_at])
    except orjson.JSONDecodeError as err:
        if err.msg.startswith("unexpected content after document"):
            return _byte_offset(err)
        return None
    return bad_utf8_at


def _trailing_error(where: str, end: int, header_length: int | None) -> InvalidInputError:
    if header_length is None:
        return InvalidInputError(
            f"request body has data after the JSON document (from byte {end}); if it carries "
            f"binary tensor data, send the Inference-Header-Content-Length header with the "
            f"JSON length (the JSON appears to be {end} bytes)"
        )
    return InvalidInputError(
        f"{where} has data after the JSON document (from byte {end}); "
        f"Inference-Header-Content-Length must equal the JSON length exactly"
    )


def _parse_error(
    header: bytes | bytearray,
    err: orjson.JSONDecodeError,
    header_length: int | None,
    body_size: int,
) -> InvalidInputError:
    if header_length is None:
        where = "request body"
    else:
        where = (
            f"JSON header (the first {header_length} bytes of the {body_size}-byte body, "
            f"per Inference-Header-Content-Length: {header_length})"
        )
    if "UTF-8" in err.msg:
        try:
            header.decode()
        except UnicodeDecodeError as bad:
            end = _trailing_data_end(header, bad.start)
            if end is not None:
                return _trailing_error(where, end, header_length)
            return InvalidInputError(
                f"{where} is not valid UTF-8: byte 0x{header[bad.start]:02x} at position "
                f"{bad.start} ({bad.reason})"
            )
    if err.msg.startswith("unexpected content after document"):
        return _trailing_error(where, _byte_offset(err), header_length)
    return InvalidInputError(f"{where} is not valid JSON: {_position(err)}")


def parse_json_header(
    header: bytes | bytearray, header_length: int | None = None, body_size: int | None = None
) -> dict[str, Any]:
    """Parse the request's JSON document and require an object without repeated keys.

    Args:
        header: The JSON bytes (the whole body, or its first ``header_length`` bytes).
        header_length: The Inference-Header-Content-Length value, if the client sent one
            (only used in messages).
        body_size: Size of the whole body (only used in messages).

    Returns:
        The parsed object.

    Raises:
        InvalidInputError: empty, invalid UTF-8, invalid JSON (with its position), data
            after the document, not an object, or a key repeated in any object.
    """
    if not header:
        if header_length is None:
            raise InvalidInputError("request body is empty")
        raise InvalidInputError("Inference-Header-Content-Length is 0, so the JSON header is empty")
    try:
        document = orjson.loads(header)
    except orjson.JSONDecodeError as err:
        size = len(header) if body_size is None else body_size
        raise _parse_error(header, err, header_length, size) from None
    if type(document) is not dict:
        raise InvalidInputError(f"request body must be a JSON object, got {json_type(document)}")
    if not _has_no_duplicates(header, document):
        try:
            json.loads(header, object_pairs_hook=_reject_duplicates)
        except _DuplicateKeyError as dup:
            raise InvalidInputError(
                f"request JSON repeats the key {dup.key!r} in one object; each key may "
                f"appear only once"
            ) from None
        except RecursionError:
            raise InvalidInputError("request JSON is nested too deeply") from None
    return document
