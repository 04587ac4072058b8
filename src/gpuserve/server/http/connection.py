"""HTTP/1.1 transport of the REST front end: one asyncio protocol per connection, on httptools.

A connection parses requests with httptools (llhttp) and hands each complete one, body
included, to a :class:`Handler` as an :class:`HttpRequest`. The handler answers by calling
:meth:`HttpRequest.respond` once, at once or later (an inference request answers from its
future's callback, so no task is created per request). Responses go out in request order:
requests a client pipelines wait in a queue while an earlier one is answered, and reading
pauses while that queue is full or the transport's write buffer is above its high-water mark.

What it enforces, each with a JSON ``{"error": ...}`` answer:

* the request line plus headers are at most ``max_header_bytes`` (431 Request Header Fields
  Too Large, then close). httptools holds an incomplete header back, so the bytes of a head
  still incomplete after a read are counted too, with slack for the tail of the previous
  request in the same read: one endless header is cut off as well.
* the body is at most ``max_request_body_bytes`` (413 as soon as ``Content-Length`` or the
  bytes of a chunked body say so, without waiting for the rest, then close).
* malformed HTTP gets 400 and the connection closes (the parser cannot resynchronise); a
  request with a body and an ``Upgrade`` header gets 400 (no protocol switch is offered, and
  llhttp passes no body on after one); a bodiless one is answered, then the connection closes.

Refusals come after the answers to the requests before them and end with a lingering close
(write side shut, input drained for a second) so the client can read them. A client that
closes its side of the connection is taken as gone, not as half-closed: the request being
answered is told at once (:attr:`HttpRequest.on_gone`), so its queued work leaves the queue
then and never runs; requests pipelined behind it are dropped unstarted. ``Expect:
100-continue`` is answered with ``100 Continue`` (not to HTTP/1.0). Connections idle for
``keep_alive_timeout_s`` are closed, and so are connections whose client has read none of its
answers for that long (while it does not read, no further answer is produced). HEAD is
answered like GET without the body. Protocol rules follow RFC 9112 (HTTP/1.1 message syntax,
persistence and pipelining).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from email.utils import formatdate
from http import HTTPStatus
from urllib.parse import unquote

import httptools
import orjson

from gpuserve.server.http.encoding import (
    MIN_COMPRESS_BYTES,
    BodyRefused,
    answer_coding,
    decode_body,
    encode_body,
)
from gpuserve.server.http.openai_errors import OPENAI_PREFIX, transport_error_body
from gpuserve.server.http.request import Handler, Headers, HttpRequest

logger = logging.getLogger(__name__)

_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_MAX_PIPELINED = 16  # parsed requests waiting per connection before reading pauses
_WRITELINES_FROM = 64 * 1024  # bodies this large are not copied into one buffer with the head
_LINGER_S = 1.0  # how long a refused connection's unread input is drained before closing
_READ_BUFFER = 256 * 1024  # the socket is read straight into this (BufferedProtocol)


class _DateHeader:
    """The ``date`` header line (RFC 9110 §6.6.1), formatted at most once a second."""

    def __init__(self) -> None:
        self._second = -1
        self._line = b""

    def line(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._line = b"date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
        return self._line


_DATE = _DateHeader()


def error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})


#: Seconds a connection that has sent nothing yet may take to send its request once the
#: server is shutting down (see :meth:`HttpConnection.shutdown`).
FRESH_GRACE_S = 2.0


class _HeadTooLarge(httptools.HttpParserError):
    """Raised from a parser callback to stop parsing an oversized request head."""


class HttpConnection(asyncio.BufferedProtocol):
    """One client connection (see the module docstring).

    Args:
        handler: Answers each complete request.
        max_header_bytes: Limit of the request line plus headers (431 beyond).
        max_body_bytes: Limit of a request body (413 beyond).
        keep_alive_timeout_s: An idle connection is closed after this many seconds.
        on_close: Called once with this connection when it is closed.
        on_open: Called with this connection when it is established (after the TLS
            handshake, with TLS: a failed handshake never opens a connection).
        read_buffer: Where the socket is read into. Connections of one event loop may share
            one: each read is parsed (and the parser copies what it keeps) before the next.
    """

    def __init__(
        self,
        handler: Handler,
        max_header_bytes: int,
        max_body_bytes: int,
        keep_alive_timeout_s: float,
        on_close: Callable[[HttpConnection], None],
        on_open: Callable[[HttpConnection], None] | None = None,
        read_buffer: memoryview | None = None,
    ) -> None:
        self.handler = handler
        self.on_open = on_open
        self.max_header_bytes = max_header_bytes
        self.max_body_bytes = max_body_bytes
        self.keep_alive_timeout_s = keep_alive_timeout_s
        self.on_close = on_close
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()
        self.client: tuple[str, int] | None = None
        self.closed = False
        self.closing = False  # the server is stopping: close after the current answer
        self._current: HttpRequest | None = None
        self._waiting: deque[HttpRequest] = deque()
        self._reading_paused = False
        self._writing_paused = False
        self._last_active = 0.0
        self._received = False  # any byte from the client yet
        self._idle_timer: asyncio.TimerHandle | None = None
        self._broken = False  # the parser failed: no more requests from this connection
        # the message being parsed
        self._url = b""
        self._headers: Headers = []
        self._body_first = b""  # a body that arrives in one piece is kept as it is
        self._body_size = 0
        self._body_buffer: bytearray | None = None  # a body of several pieces
        self._too_large = False
        self._began = False  # a message began during the current read
        self._upgrade = False  # the message being parsed carries an Upgrade header
        self._coding: bytes | None = None  # its Content-Encoding
        self._accept: bytes | None = None  # its Accept-Encoding
        self._read_view = read_buffer or memoryview(bytearray(_READ_BUFFER))
        self._in_head = True
        self._head_bytes = 0
        self._pending_bytes = 0
        self._head_overflow = False

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.client = (str(peer[0]), int(peer[1]))
        self._last_active = self.loop.time()
        if self.on_open is not None:
            self.on_open(self)
        if self.keep_alive_timeout_s > 0:
            self._idle_timer = self.loop.call_later(self.keep_alive_timeout_s, self._check_idle)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closed:
            return
        self.closed = True
        self._waiting.clear()  # never started: nothing of theirs is queued
        current = self._current
        if current is not None and current.on_gone is not None and not current.answered:
            current.on_gone()  # its queued work is dropped now, not when it would run
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self.on_close(self)

    def write_streamed(self, data: bytes) -> bool:
        """Write part of a streamed answer (a handler that writes its own response, e.g.
        server-sent events) and count the connection as active, so the keep-alive timer does
        not cut a long stream that is still writing. False when the transport is gone."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        transport.write(data)
        self._last_active = self.loop.time()
        return True

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._read_view

    def buffer_updated(self, nbytes: int) -> None:
        # The parser copies what it hands on (URL, headers, body pieces), so the read buffer
        # is free for the next read as soon as this returns.
        self.data_received(self._read_view[:nbytes])

    def data_received(self, data: bytes | memoryview) -> None:
        if self._broken:
            return  # after a refusal the rest of the input is dropped
        self._last_active = self.loop.time()
        self._received = True
        self._began = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # A request asked to switch protocols; none is offered: it was answered over
            # HTTP/1.1 with connection: close (see on_headers_complete).
            self._broken = True
            self._close_after_answers()
            return
        except httptools.HttpParserError as err:
            if not self._broken:
                self._parser_failed(err)
            return
        if self._in_head and not self._broken and not self._began:
            # A head still incomplete after a whole read: its bytes are held by the parser.
            # (A head that began in this read holds at most this read.)
            self._pending_bytes += len(data)
            if self._pending_bytes > 2 * self.max_header_bytes + 65536:
                self._head_too_large()

    def eof_received(self) -> bool:
        """The client closed its side: it is taken as gone (its queued requests are then
        dropped before they run), not as a half-close awaiting answers."""
        return False  # asyncio closes the transport

    def pause_writing(self) -> None:
        self._writing_paused = True
        self._pause_reading()

    def resume_writing(self) -> None:
        self._writing_paused = False
        if len(self._waiting) < _MAX_PIPELINED:
            self._resume_reading()
        if self._current is None and self._waiting:
            self.loop.call_soon(self._next)

    # -- httptools callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._body_first = b""
        self._body_buffer = None
        self._body_size = 0
        self._too_large = False
        self._upgrade = False
        self._coding = None
        self._accept = None
        self._in_head = True
        self._began = True
        self._head_bytes = 0
        self._pending_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)  # ": " and CRLF
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        expect = False
        has_body = False
        for name, value in self._headers:
            if name == b"content-length" and value.isdigit():
                length = int(value)
                has_body = length > 0
                if length > self.max_body_bytes:
                    # Answered now, not after a body that will be refused: then close.
                    self._body_too_large(
                        f"request body of {length} bytes exceeds the limit of "
                        f"{self.max_body_bytes} bytes (max_request_body_bytes)"
                    )
                    return
            elif name == b"transfer-encoding":
                has_body = True
            elif name == b"expect" and value.lower() == b"100-continue":
                expect = True
            elif name == b"upgrade":
                self._upgrade = True
            elif name == b"content-encoding":
                self._coding = value
            elif name == b"accept-encoding":
                self._accept = value
        if self._upgrade and has_body:
            # llhttp hands no body on after an Upgrade header; refuse rather than run the
            # request without it.
            self._refuse(
                400,
                "a request with a body cannot carry 'Upgrade' (no protocol switch is offered); "
                "send it without the Upgrade header",
            )
            return
        if expect and self.transport is not None and self.parser.get_http_version() != "1.0":
            self.transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        if self._too_large or self._broken:
            return
        self._body_size += len(body)
        if self._body_size > self.max_body_bytes:
            self._body_too_large(
                f"request body exceeds the limit of {self.max_body_bytes} bytes "
                "(max_request_body_bytes)"
            )
            return
        # One piece is kept as it is; several are appended to one growing buffer (each byte
        # copied once, bar the occasional move of the growing buffer), never preallocated from
        # Content-Length, so memory follows the bytes that actually arrived.
        if self._body_buffer is not None:
            self._body_buffer += body
        elif not self._body_first:
            self._body_first = body
        else:
            self._body_buffer = bytearray(self._body_first)
            self._body_buffer += body
            self._body_first = b""

    def on_message_complete(self) -> None:
        if self._broken:
            return  # the request was refused early (too large, Upgrade with a body)
        parsed = httptools.parse_url(self._url)
        raw_path = parsed.path
        path = raw_path.decode("latin-1")
        if "%" in path:
            path = unquote(path)
        body: bytes | bytearray = (
            self._body_buffer if self._body_buffer is not None else self._body_first
        )
        self._body_buffer = None
        self._body_first = b""
        error = None
        if self._coding is not None:
            try:
                body = decode_body(self._coding, body, self.max_body_bytes)
            except BodyRefused as refused:
                error = (refused.status, refused.message)
        request = HttpRequest(
            self,
            self.parser.get_method().decode("ascii"),
            path,
            parsed.query or b"",
            self._headers,
            body,
            self.parser.should_keep_alive() and not self._upgrade,
            error,
        )
        if self._accept is not None and _compressible(path):
            request.answer_coding = answer_coding(self._accept)
        self._enqueue(request)

    def _body_too_large(self, message: str) -> None:
        self._too_large = True
        self._body_buffer = None
        self._body_first = b""
        self._refuse(413, message)

    # -- answering -------------------------------------------------------------------------

    def _enqueue(self, request: HttpRequest) -> None:
        if self._current is None and not self._waiting:
            self._start(request)
            return
        self._waiting.append(request)
        if len(self._waiting) >= _MAX_PIPELINED:
            self._pause_reading()

    def _start(self, request: HttpRequest) -> None:
        self._current = request
        if request.error is not None:
            status, message = request.error
            if request.path.startswith(OPENAI_PREFIX):
                request.respond(status, transport_error_body(status, message))
            else:
                request.respond(status, error_body(message))
            return
        try:
            self.handler.handle(request)
        except Exception:  # a bug in the handler: log it, never leak it
            logger.exception("unhandled error serving %s %s", request.method, request.path)
            request.respond(500, error_body("internal server error"))

    def write_response(
        self,
        request: HttpRequest,
        status: int,
        body: bytes,
        content_type: bytes,
        headers: Iterable[tuple[bytes, bytes]],
    ) -> None:
        """Write ``request``'s response (see :meth:`HttpRequest.respond`), then start the next
        waiting request or close the connection."""
        if request is not self._current:
            return
        self._current = None
        transport = self.transport
        if self.closed or transport is None or transport.is_closing():
            return
        keep_alive = request.keep_alive and not self.closing
        coding = request.answer_coding
        if coding is not None and len(body) >= MIN_COMPRESS_BYTES and request.method != "HEAD":
            body = encode_body(coding, body)
            headers = (*headers, (b"content-encoding", coding), (b"vary", b"accept-encoding"))
        parts = [
            _STATUS_LINES.get(status) or f"HTTP/1.1 {status} Unknown\r\n".encode(),
            b"content-type: ",
            content_type,
            b"\r\ncontent-length: ",
            str(len(body)).encode(),
            b"\r\n",
            _DATE.line(),
        ]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        if not keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        if request.method == "HEAD":
            transport.write(b"".join(parts))
        elif len(body) >= _WRITELINES_FROM:
            transport.writelines((b"".join(parts), body))
        else:
            parts.append(body)
            transport.write(b"".join(parts))
        self._last_active = self.loop.time()
        if not keep_alive:
            self._waiting.clear()
            if self._broken and transport.can_write_eof():
                # Lingering close: the client may still be sending what will never be read;
                # closing with unread bytes would reset the connection and could destroy
                # the answer before the client reads it. Half-close, drop what arrives, and
                # close when the client does or after a second.
                transport.write_eof()
                self._reading_paused = False
                transport.resume_reading()
                self.loop.call_later(_LINGER_S, transport.close)
            else:
                transport.close()
            return
        if self._waiting:
            # Not inline: a long run of pipelined requests answered at once must not recurse.
            self.loop.call_soon(self._next)

    def _next(self) -> None:
        if self._current is not None or not self._waiting or self.closed:
            return
        if self._writing_paused:
            return  # the client is not reading: resume_writing starts the next answer
        request = self._waiting.popleft()
        if len(self._waiting) < _MAX_PIPELINED and not self._writing_paused:
            self._resume_reading()
        self._start(request)

    # -- closing ---------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """No request is being answered or waiting."""
        return self._current is None and not self._waiting

    def shutdown(self, fresh_grace_s: float = FRESH_GRACE_S) -> None:
        """Close now if idle, else after the request being answered (``connection: close``).

        A connection that has not sent a byte yet was accepted a moment ago and its request
        is on the way (a busy client can take a while to write it): it gets ``fresh_grace_s``
        seconds for it, to be answered (503 while shutting down) rather than dropped unread.
        """
        self.closing = True
        self._waiting.clear()
        if self._current is None and self.transport is not None:
            if not self._received and fresh_grace_s > 0:
                self.loop.call_later(fresh_grace_s, self._close_if_unused)
                return
            self.transport.close()

    def _close_if_unused(self) -> None:
        if self.idle and self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def _close_after_answers(self) -> None:
        self._pause_reading()
        if self.idle and self.transport is not None:
            self.transport.close()

    def _check_idle(self) -> None:
        self._idle_timer = None
        if self.closed:
            return
        idle_for = self.loop.time() - self._last_active
        if self._writing_paused and idle_for >= self.keep_alive_timeout_s:
            # A client that reads none of its answers for that long is dropped with them.
            self.abort()
            return
        if self.idle and idle_for >= self.keep_alive_timeout_s:
            if self.transport is not None:
                self.transport.close()
            return
        wait = self.keep_alive_timeout_s - idle_for if self.idle else self.keep_alive_timeout_s
        self._idle_timer = self.loop.call_later(max(wait, 0.01), self._check_idle)

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None and not self._broken:
            self._reading_paused = False
            self.transport.resume_reading()

    # -- errors in the request head --------------------------------------------------------

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > self.max_header_bytes:
            self._head_overflow = True
            raise _HeadTooLarge("request head too large")

    def _parser_failed(self, err: Exception) -> None:
        if self._head_overflow:
            self._head_too_large()
            return
        self._refuse(400, f"malformed HTTP request: {err}")

    def _head_too_large(self) -> None:
        limit = self.max_header_bytes
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "-"
        logger.warning(
            "refused a request from %s: request line and headers exceed %d bytes", client, limit
        )
        self._refuse(
            431, f"request line and headers exceed the limit of {limit} bytes (max_header_bytes)"
        )

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` after the requests before it, then close: the stream cannot be
        parsed further."""
        self._broken = True
        self._in_head = False
        self._pause_reading()
        path = self._url.split(b"?", 1)[0].decode("latin-1")  # as far as the head got
        self._enqueue(HttpRequest(self, "", path, b"", [], b"", False, (status, message)))


def _compressible(path: str) -> bool:
    """Whether an answer to ``path`` may be compressed: inference answers (V2 ``/infer``, as
    Triton compresses only those: tritonclient.http.aio reads other answers as sent) and the
    OpenAI-compatible API."""
    return path.endswith("/infer") or path.startswith(OPENAI_PREFIX)
