"""One complete HTTP request as the transport hands it to the request handler, and the
:class:`Handler` protocol the handler implements (see :mod:`gpuserve.server.http.connection`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from gpuserve.service.outcome import AccessRecord, log_access

if TYPE_CHECKING:
    from gpuserve.server.http.connection import HttpConnection

Headers = list[tuple[bytes, bytes]]

JSON = b"application/json"


class Handler(Protocol):
    """What answers requests: called on the event loop for each complete request."""

    def handle(self, request: HttpRequest) -> None: ...


class HttpRequest:
    """One complete HTTP request.

    Attributes:
        method: ``"GET"``, ``"POST"``, ... (str).
        path: The percent-decoded path, e.g. ``/v2/models/m/infer`` (str).
        query: The raw query string without ``?`` (bytes, may be empty).
        headers: ``(name, value)`` pairs in arrival order; names lower case (bytes).
        body: The whole body (bytes, or a bytearray when it arrived in several pieces;
            chunked transfer coding already removed).
        started_s: ``time.monotonic()`` when the request was complete (seconds).
        keep_alive: Whether the connection may carry another request after this one.
        access: Set by the handler for the access log (model, version, request), or None.
        on_gone: Set by the handler while the request's work is queued or runs (cancels its
            future or task): the connection calls it at once if the client goes away before
            the answer, so the work is dropped without waiting to be found out. None: nothing
            to stop.
    """

    __slots__ = (
        "access",
        "answer_coding",
        "answered",
        "body",
        "connection",
        "error",
        "headers",
        "keep_alive",
        "method",
        "on_gone",
        "path",
        "query",
        "started_s",
    )

    def __init__(
        self,
        connection: HttpConnection,
        method: str,
        path: str,
        query: bytes,
        headers: Headers,
        body: bytes | bytearray,
        keep_alive: bool,
        error: tuple[int, str] | None = None,
    ) -> None:
        self.connection = connection
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.error = error  # set by the connection: answer this status and message
        self.started_s = time.monotonic()
        self.access: Any = None
        self.on_gone: Callable[[], object] | None = None
        self.answered = False
        self.answer_coding: bytes | None = None  # gzip/deflate: compress the answer

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lower case), or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def client(self) -> tuple[str, int] | None:
        """The peer's (host, port), or None when unknown (e.g. a Unix socket)."""
        return self.connection.client

    def is_disconnected(self) -> bool:
        """Whether the client has closed the connection (it will get no answer)."""
        return self.connection.closed

    def respond(
        self,
        status: int,
        body: bytes,
        content_type: bytes = JSON,
        headers: Iterable[tuple[bytes, bytes]] = (),
    ) -> None:
        """Send the response (once; later calls are ignored). ``body`` is sent as is, with
        ``content-length``; a large body is written without being copied into the head."""
        if self.answered:
            return
        self.answered = True
        self.connection.write_response(self, status, body, content_type, headers)


def traceparent(request: HttpRequest) -> str | None:
    """The client's W3C ``traceparent`` header (front ends read it only while tracing is on)."""
    value = request.header(b"traceparent")
    return None if value is None else value.decode("latin-1")


def respond_json(
    request: HttpRequest,
    status: int,
    payload: bytes,
    headers: Iterable[tuple[bytes, bytes]],
    record: AccessRecord | None,
) -> None:
    """Answer ``request`` with the JSON ``payload``; with a ``record`` (access log on),
    complete it (client, status, size, total seconds) and write the access line."""
    request.respond(status, payload, JSON, headers)
    if record is not None:
        client = request.client
        record.client = f"{client[0]}:{client[1]}" if client else "-"
        record.status, record.size = status, len(payload)
        record.total_s = time.monotonic() - request.started_s
        log_access(record)
