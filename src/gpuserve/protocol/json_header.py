"""Parsing the JSON part of an HTTP inference request, with strict duplicate-key detection.

orjson silently keeps the last of two equal keys, so a request with two ``"inputs"`` keys
would be half-ignored. A second parse with Python's :mod:`json` and an ``object_pairs_hook``
catches duplicates but costs several times orjson's parse, so it runs only when a cheap proof
that no key is repeated fails. The proof counts colons:

* In valid JSON, every colon outside a string separates one key from its value, so
  ``header.count(b":") == raw_keys + colons_inside_strings``.
* orjson's result can only have *fewer* keys (duplicates collapse) and strings (the
  dropped values go away) than the raw text.
* So if the keys found in the parsed document (plus, without ``\\u003a`` escapes, the colons
  inside its strings) account for every colon byte, nothing was dropped: no duplicates.

Counting keys walks the parsed objects but skips ``data`` arrays, so a large JSON tensor is
not walked; the colon count is a C-speed byte scan. Typical numeric requests are proven by
the key count alone; requests whose strings contain colons need one pass over those strings;
only a real duplicate (or ``\\u003a`` escapes) pays for the second parse.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from gpuserve.errors import InvalidInputError
from gpuserve.protocol.tensors import json_type


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
    """Keys of ``obj`` and every object nested in it, except inside ``data`` arrays."""
    count = len(obj)
    for key, value in obj.items():
        kind = type(value)
        if kind is dict:
            count += _count_keys(value)
        elif kind is list and key != "data":
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


def _count_string_colons(obj: Any) -> int:
    """Colons inside the parsed strings (keys and values), never more than there are.

    Skipping a string makes the count smaller, which only sends the request to the exact
    check, so lists of numbers are skipped without looking at each element.
    """
    kind = type(obj)
    if kind is str:
        return obj.count(":")
    if kind is dict:
        return sum(key.count(":") + _count_string_colons(value) for key, value in obj.items())
    if kind is list and obj:
        first = type(obj[0])
        if first is str:
            try:
                return "".join(obj).count(":")
            except TypeError:  # mixed types: an invalid tensor, let the exact check decide
                return 0
        if first is list or first is dict:
            return sum(_count_string_colons(item) for item in obj)
    return 0


def _has_no_duplicates(header: bytes, document: dict[str, Any]) -> bool:
    colons = header.count(b":")
    keys = _count_keys(document)
    if keys == colons:
        return True
    if b"\\u003a" in header or b"\\u003A" in header:
        return False  # an escaped colon is invisible to the byte count
    return keys + _count_string_colons(document) == colons


def _position(err: orjson.JSONDecodeError) -> str:
    return f"{err.msg} at line {err.lineno} column {err.colno} (char {err.pos})"


def _parse_error(
    header: bytes, err: orjson.JSONDecodeError, header_length: int | None, body_size: int
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
            return InvalidInputError(
                f"{where} is not valid UTF-8: byte 0x{header[bad.start]:02x} at position "
                f"{bad.start} ({bad.reason})"
            )
    if err.msg.startswith("unexpected content after document"):
        if header_length is None:
            return InvalidInputError(
                f"request body has data after the JSON document (from char {err.pos}); "
                f"if it carries binary tensor data, send the Inference-Header-Content-Length "
                f"header with the JSON length ({err.pos} here)"
            )
        return InvalidInputError(
            f"{where} has data after the JSON document (from char {err.pos}); "
            f"Inference-Header-Content-Length must equal the JSON length exactly"
        )
    return InvalidInputError(f"{where} is not valid JSON: {_position(err)}")


def parse_json_header(
    header: bytes, header_length: int | None = None, body_size: int | None = None
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
