"""A cap on the size of an HTTP request's head (request line and headers): 431 beyond it.

uvicorn offers a head-size limit only for its h11 implementation
(``h11_max_incomplete_event_size``); with httptools, which gpuserve uses for speed, a client
could send headers without end and the server would buffer them all. This protocol counts the
request line and each header as the parser delivers them and, past ``max_header_bytes``,
answers ``431 Request Header Fields Too Large`` with a JSON error and closes the connection,
before the application sees the request. Because httptools holds a header back until it is
complete, the bytes of a head still incomplete after a read are counted too (with slack for
the tail of a previous request in the same read), so one endless header is cut off as well
and the memory held for a head stays bounded.
"""

from __future__ import annotations

import logging
from typing import Any

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)


class _HeadTooLarge(httptools.HttpParserError):
    """Raised from a parser callback to stop parsing an oversized head."""


class HeadLimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a limit on the request head (see the module).

    Attributes:
        max_header_bytes: The limit; set on the subclass :func:`head_limited_protocol` makes.
    """

    max_header_bytes: int = 64 * 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # a connection starts by sending a request head
        self._head_bytes = 0  # request line + headers of the current head, as parsed
        self._pending_bytes = 0  # bytes read while the current head was incomplete
        self._too_large = False

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = 0
        self._pending_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def _count(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > self.max_header_bytes:
            self._too_large = True
            raise _HeadTooLarge("request head too large")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._in_head or self._too_large or self.transport.is_closing():
            return
        self._pending_bytes += len(data)
        if self._pending_bytes > 2 * self.max_header_bytes + 65536:
            self._refuse_head()

    def send_400_response(self, msg: str) -> None:
        if self._too_large:  # the parser stopped at our callback's error
            self._refuse_head()
        else:
            super().send_400_response(msg)

    def _refuse_head(self) -> None:
        limit = self.max_header_bytes
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "-"
        logger.warning(
            "refused a request from %s: request line and headers exceed %d bytes", client, limit
        )
        body = orjson.dumps(
            {
                "error": f"request line and headers exceed the limit of {limit} bytes "
                "(max_header_bytes)"
            }
        )
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n"
            b"connection: close\r\n\r\n" + body
        )
        self.transport.close()
        self._in_head = False
        self._too_large = True


def head_limited_protocol(max_header_bytes: int) -> type[HeadLimitedHttpToolsProtocol]:
    """The protocol class to give uvicorn (``Config(http=...)``) for this limit."""
    return type(
        "HeadLimitedHttpToolsProtocol",
        (HeadLimitedHttpToolsProtocol,),
        {"max_header_bytes": max_header_bytes},
    )
