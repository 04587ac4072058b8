"""A lean HTTP/1.1 keep-alive client on ``asyncio.Protocol``, made for load generation.

One :class:`HttpConnection` carries one request at a time (no pipelining), like a browser
connection or wrk's. Requests are pre-encoded bytes, so sending costs one ``write``; parsing
reads only the status line and the headers the bench needs (``content-length``,
``transfer-encoding``, ``connection``, ``x-queue-time-us``, ``x-compute-time-us``). It is
several times cheaper per request than a general client, which keeps the generator from
becoming the bottleneck on a small machine.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_module
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit


@dataclass(slots=True)
class HttpResponse:
    """A parsed response: status code, the headers the bench reads (lower-case), body."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


class HttpProtocolError(Exception):
    """The server's reply was not parseable HTTP/1.1."""


_WANTED = frozenset(
    {
        b"content-length",
        b"transfer-encoding",
        b"connection",
        b"x-queue-time-us",
        b"x-compute-time-us",
        b"content-type",
        b"inference-header-content-length",
    }
)


class HttpConnection(asyncio.Protocol):
    """One keep-alive connection. Create with :meth:`open`."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._waiter: asyncio.Future[HttpResponse] | None = None
        self._head: tuple[int, dict[str, str], int] | None = None  # status, headers, body start
        self._need = -1  # total bytes of the current response, -1 = unknown (chunked)
        self.closed = False

    @classmethod
    async def open(
        cls, host: str, port: int, ssl: ssl_module.SSLContext | None = None
    ) -> HttpConnection:
        """Connect (over TLS with ``ssl``)."""
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_connection(cls, host, port, ssl=ssl)
        return protocol

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc or ConnectionResetError("server closed the connection"))
        self._waiter = None

    def data_received(self, data: bytes) -> None:
        self._buf += data
        waiter = self._waiter
        if waiter is None:
            return
        try:
            response = self._parse()
        except HttpProtocolError as err:
            self._waiter = None
            waiter.set_exception(err)
            self.close()
            return
        if response is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(response)

    # -- requests ------------------------------------------------------------------------------

    def request(self, raw: bytes) -> asyncio.Future[HttpResponse]:
        """Send the pre-encoded request ``raw``; the future resolves with the response."""
        if self.closed or self._transport is None:
            raise ConnectionResetError("connection is closed")
        if self._waiter is not None:
            raise RuntimeError("one request at a time per connection")
        waiter: asyncio.Future[HttpResponse] = asyncio.get_running_loop().create_future()
        self._waiter = waiter
        self._transport.write(raw)
        return waiter

    def abort(self, exc: Exception) -> None:
        """Fail the request in flight (if any) with ``exc`` and drop the connection."""
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        self.close()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        self.closed = True

    def _parse(self) -> HttpResponse | None:
        buf = self._buf
        if self._head is None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return None
            lines = bytes(buf[:end]).split(b"\r\n")
            status_line = lines[0]
            if not status_line.startswith(b"HTTP/1.") or len(status_line) < 12:
                raise HttpProtocolError(f"bad status line {status_line[:40]!r}")
            status = int(status_line[9:12])
            headers: dict[str, str] = {}
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name in _WANTED:
                    headers[name.decode()] = value.strip().decode("latin-1")
            self._head = (status, headers, end + 4)
            length = headers.get("content-length")
            if headers.get("transfer-encoding", "").lower() == "chunked":
                self._need = -1
            elif length is not None:
                self._need = end + 4 + int(length)
            else:
                self._need = end + 4  # no body (e.g. 204); close-delimited bodies unsupported
        status, headers, start = self._head
        if self._need >= 0:
            if len(buf) < self._need:
                return None
            body = bytes(buf[start : self._need])
            del buf[: self._need]
        else:
            parsed = _dechunk(buf, start)
            if parsed is None:
                return None
            body, consumed = parsed
            del buf[:consumed]
        self._head = None
        if headers.get("connection", "").lower() == "close":
            self.close()
        return HttpResponse(status, headers, body)


def _dechunk(buf: bytearray, start: int) -> tuple[bytes, int] | None:
    """Decode a complete chunked body starting at ``start``; None when more bytes are needed."""
    pos = start
    parts: list[bytes] = []
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size_text = bytes(buf[pos:eol]).split(b";")[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise HttpProtocolError(f"bad chunk size {size_text[:20]!r}") from None
        if size == 0:
            trailer_end = buf.find(b"\r\n\r\n", eol)
            if buf[eol : eol + 4] == b"\r\n\r\n":
                return b"".join(parts), eol + 4
            if trailer_end < 0:
                return None
            return b"".join(parts), trailer_end + 4
        if len(buf) < eol + 2 + size + 2:
            return None
        parts.append(bytes(buf[eol + 2 : eol + 2 + size]))
        pos = eol + 2 + size + 2


def split_url(url: str) -> tuple[str, int, str]:
    """``http[s]://host:port/prefix`` -> (host, port, prefix without trailing slash); the
    default port is 80 for http and 443 for https (see :func:`is_https`).

    Raises:
        ValueError: not an ``http://`` or ``https://`` URL, or no host.
    """
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{url!r}: only http:// and https:// URLs are supported")
    if not parts.hostname:
        raise ValueError(f"{url!r}: no host")
    default = 443 if parts.scheme == "https" else 80
    return parts.hostname, parts.port or default, parts.path.rstrip("/")


def is_https(url: str) -> bool:
    return url.startswith("https://")


def tls_context(ca_file: str | Path | None) -> ssl_module.SSLContext:
    """A client TLS context that trusts ``ca_file`` (PEM), or the system's CAs without one."""
    return ssl_module.create_default_context(cafile=str(ca_file) if ca_file else None)


def build_request(
    method: str, host: str, port: int, path: str, body: bytes = b"", headers: dict | None = None
) -> bytes:
    """Encode one HTTP/1.1 request (keep-alive) as bytes."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}"]
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    if body or method in ("POST", "PUT"):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
