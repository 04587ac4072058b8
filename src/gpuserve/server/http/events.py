"""Server-sent events on an HTTP/1.1 connection: the head, one event per chunk of chunked
transfer coding (so a client can tell a stream cut short from one that ended), back-pressure
from the socket's write buffer. Used by Triton's ``generate_stream`` and OpenAI's
``stream: true`` answers."""

from __future__ import annotations

import asyncio

from gpuserve.server.http.request import HttpRequest

#: Bytes of events the socket may hold unsent before the stream stops pulling responses.
WRITE_BUFFER_BYTES = 256 * 1024
#: Seconds between two looks at a socket whose client is not reading.
DRAIN_POLL_S = 0.005

EVENT_HEAD = (
    b"HTTP/1.1 200 OK\r\n"
    b"content-type: text/event-stream; charset=utf-8\r\n"
    b"cache-control: no-cache\r\n"
    b"x-accel-buffering: no\r\n"
    b"transfer-encoding: chunked\r\n"
    b"connection: close\r\n\r\n"
)
#: The last chunk: the stream ended as it should (a cut connection lacks it).
END = b"0\r\n\r\n"


def write_event(request: HttpRequest, data: bytes) -> int:
    """Write ``data: <data>`` as one event in one chunk; returns its size in bytes (0 when
    the connection is gone)."""
    event = b"data: " + data + b"\n\n"
    # counted as activity: a long stream that writes is not idle (a client that stops
    # reading is still dropped after the keep-alive timeout: nothing is written meanwhile)
    if not request.connection.write_streamed(b"%x\r\n%b\r\n" % (len(event), event)):
        return 0
    return len(event)


async def drained(request: HttpRequest) -> bool:
    """Wait while the socket holds more than :data:`WRITE_BUFFER_BYTES` unsent; False when
    the client went away."""
    transport = request.connection.transport
    while transport is not None and transport.get_write_buffer_size() > WRITE_BUFFER_BYTES:
        if request.is_disconnected() or transport.is_closing():
            return False
        await asyncio.sleep(DRAIN_POLL_S)
    return not request.is_disconnected()


__all__ = ["DRAIN_POLL_S", "END", "EVENT_HEAD", "WRITE_BUFFER_BYTES", "drained", "write_event"]
