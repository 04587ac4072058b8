"""``multipart/form-data`` bodies (RFC 7578), as the ``openai`` client uploads files.

Only what an upload needs: the boundary from the ``Content-Type`` header, then each part's
``Content-Disposition`` name (and filename) and its bytes. A file's bytes are a
:class:`memoryview` into the body, never copied.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpuserve.errors import InvalidInputError

_BOUNDARY = re.compile(rb'boundary="?([^";]{1,200})"?', re.I)
_NAME = re.compile(rb';\s*name="([^"]*)"', re.I)
_FILENAME = re.compile(rb';\s*filename="([^"]*)"', re.I)
#: Most parts in one body (an upload has two or three).
MAX_PARTS = 64


@dataclass(frozen=True, slots=True)
class Part:
    """One part of a form.

    Attributes:
        name: The form field's name.
        filename: The file's name for a file field, else None.
        data: The part's bytes (a view into the body).
    """

    name: str
    filename: str | None
    data: memoryview


def boundary(content_type: bytes | None) -> bytes:
    """The boundary of a ``multipart/form-data`` content type.

    Raises:
        InvalidInputError: not ``multipart/form-data``, or no boundary.
    """
    if content_type is None or not content_type.lower().startswith(b"multipart/form-data"):
        raise InvalidInputError("the body must be multipart/form-data (a file upload)")
    match = _BOUNDARY.search(content_type)
    if match is None:
        raise InvalidInputError("the multipart/form-data content type has no boundary")
    return match.group(1)


def parse_form(body: bytes | bytearray, content_type: bytes | None) -> list[Part]:
    """The parts of a ``multipart/form-data`` body.

    Raises:
        InvalidInputError: the body is not a well-formed form (message says where).
    """
    delimiter = b"--" + boundary(content_type)
    view = memoryview(body)
    start = body.find(delimiter)
    if start < 0:
        raise InvalidInputError("the multipart body has no part")
    parts: list[Part] = []
    position = start + len(delimiter)
    while True:
        if body[position : position + 2] == b"--":
            return parts  # the closing delimiter
        if body[position : position + 2] != b"\r\n":
            raise InvalidInputError("the multipart body is malformed after a boundary")
        head_end = body.find(b"\r\n\r\n", position + 2)
        if head_end < 0:
            raise InvalidInputError("a multipart part has no end of headers")
        head = bytes(body[position + 2 : head_end])
        data_start = head_end + 4
        data_end = body.find(b"\r\n" + delimiter, data_start)
        if data_end < 0:
            raise InvalidInputError("a multipart part has no closing boundary")
        parts.append(_part(head, view[data_start:data_end]))
        if len(parts) > MAX_PARTS:
            raise InvalidInputError(f"the multipart body has more than {MAX_PARTS} parts")
        position = data_end + 2 + len(delimiter)


def _part(head: bytes, data: memoryview) -> Part:
    disposition = None
    for line in head.split(b"\r\n"):
        key, _, value = line.partition(b":")
        if key.strip().lower() == b"content-disposition":
            disposition = value
    if disposition is None:
        raise InvalidInputError("a multipart part has no Content-Disposition header")
    name = _NAME.search(disposition)
    if name is None:
        raise InvalidInputError("a multipart part has no field name")
    filename = _FILENAME.search(disposition)
    return Part(
        name.group(1).decode("utf-8", "replace"),
        None if filename is None else filename.group(1).decode("utf-8", "replace"),
        data,
    )
