"""HttpConnection driven directly (fake transport, bytes fed through the BufferedProtocol
interface as the event loop would): body assembly without extra copies, answer order."""

from __future__ import annotations

import asyncio
import functools
import json

import numpy as np

from gpuserve.config import ModelConfig
from gpuserve.protocol.http_codec import decode_infer_request
from gpuserve.server.http.connection import HttpConnection
from gpuserve.server.http.request import HttpRequest


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.closed = False
        self.paused = False

    def write(self, data) -> None:
        self.written.append(bytes(data))

    def writelines(self, parts) -> None:
        for part in parts:
            self.write(part)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 5555) if name == "peername" else default

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def can_write_eof(self) -> bool:
        return False


class Recorder:
    """A handler that keeps requests and answers only when told to."""

    def __init__(self) -> None:
        self.requests: list[HttpRequest] = []

    def handle(self, request: HttpRequest) -> None:
        self.requests.append(request)


def feed(connection: HttpConnection, data: bytes, piece: int = 1000) -> None:
    """Deliver ``data`` the way the loop does with a BufferedProtocol, ``piece`` bytes a read."""
    for start in range(0, len(data), piece):
        chunk = data[start : start + piece]
        buffer = connection.get_buffer(len(chunk))
        buffer[: len(chunk)] = chunk
        connection.buffer_updated(len(chunk))


def make(handler: Recorder, max_body: int = 1 << 26) -> tuple[HttpConnection, FakeTransport]:
    """A connection on the running loop, as the listener makes it."""
    connection = HttpConnection(handler, 8192, max_body, 0.0, lambda _: None)
    transport = FakeTransport()
    connection.connection_made(transport)
    return connection, transport


def on_loop(test):
    """Run an async test function on a fresh event loop (the connection needs one)."""

    @functools.wraps(test)
    def run() -> None:
        asyncio.run(test())

    return run


async def turns(n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


@on_loop
async def test_large_body_is_assembled_once_and_decoded_without_copying():
    """A 4 MiB binary tensor arrives in 64 KiB reads; the handler gets one buffer of exactly
    the announced length, and the decoded input is a view of that buffer."""
    values = np.arange(1 << 20, dtype=np.float32)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "X",
                    "shape": [1, values.size],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": values.nbytes},
                }
            ]
        }
    ).encode()
    body = header + values.tobytes()
    head = (
        f"POST /v2/models/m/infer HTTP/1.1\r\nhost: t\r\ncontent-length: {len(body)}\r\n"
        f"inference-header-content-length: {len(header)}\r\n\r\n"
    ).encode()
    handler = Recorder()
    connection, _ = make(handler)
    feed(connection, head + body, piece=65536)
    (request,) = handler.requests
    assert isinstance(request.body, bytearray) and request.body == body
    config = ModelConfig.model_validate(
        {
            "name": "m",
            "backend": "python",
            "max_batch_size": 1,
            "inputs": [{"name": "X", "datatype": "FP32", "shape": [-1]}],
            "outputs": [{"name": "Y", "datatype": "FP32", "shape": [-1]}],
        }
    )
    decoded = decode_infer_request(request.body, len(header), config, "m", None)
    array = decoded.request.inputs["X"]
    np.testing.assert_array_equal(array[0], values)
    assert np.shares_memory(array, np.frombuffer(request.body, dtype=np.uint8))
    assert not array.flags.writeable  # the shared buffer stays read-only to models


@on_loop
async def test_answers_leave_in_request_order_even_when_ready_out_of_order():
    handler = Recorder()
    connection, transport = make(handler)
    requests = b"".join(f"GET /r{i} HTTP/1.1\r\nhost: t\r\n\r\n".encode() for i in range(3))
    feed(connection, requests, piece=7)
    assert [r.path for r in handler.requests] == ["/r0"]  # the others wait their turn
    handler.requests[0].respond(200, b'"0"')
    await turns()
    second = handler.requests[1]
    await turns()
    assert len(handler.requests) == 2  # /r2 waits for /r1's answer
    second.respond(200, b'"1"')
    await turns()
    handler.requests[2].respond(200, b'"2"')
    bodies = [w.rsplit(b"\r\n\r\n", 1)[1] for w in transport.written]
    assert bodies == [b'"0"', b'"1"', b'"2"']
    assert [r.path for r in handler.requests] == ["/r0", "/r1", "/r2"]


@on_loop
async def test_small_bodies_stay_bytes_and_oversized_ones_get_413_in_order():
    handler = Recorder()
    connection, transport = make(handler, max_body=2048)
    small = b'{"a": 1}'
    feed(
        connection,
        f"POST /a HTTP/1.1\r\nhost: t\r\ncontent-length: {len(small)}\r\n\r\n".encode() + small,
    )
    (request,) = handler.requests
    assert type(request.body) is bytes and request.body == small
    big = b"z" * 5000
    feed(connection, f"POST /b HTTP/1.1\r\ncontent-length: {len(big)}\r\n\r\n".encode() + big)
    assert len(transport.written) == 0  # the 413 waits for the answer to /a
    request.respond(200, b"{}")
    await turns()
    assert len(handler.requests) == 1  # /b never reached the handler
    assert transport.written[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert transport.written[1].startswith(b"HTTP/1.1 413 ")
    assert b"max_request_body_bytes" in transport.written[1]
    assert transport.closed  # a refused body is not read: the connection ends


@on_loop
async def test_no_answer_is_produced_while_the_client_reads_none():
    """While the transport's write buffer is over its high-water mark (pause_writing), the
    next pipelined request is not started, so a client that never reads cannot make the
    server buffer answer after answer."""
    handler = Recorder()
    connection, _ = make(handler)
    feed(connection, b"".join(f"GET /r{i} HTTP/1.1\r\n\r\n".encode() for i in range(3)))
    connection.pause_writing()
    handler.requests[0].respond(200, b"{}")
    await turns()
    assert len(handler.requests) == 1  # /r1 waits for the client to read
    connection.resume_writing()
    await turns()
    assert [r.path for r in handler.requests] == ["/r0", "/r1"]


@on_loop
async def test_a_client_that_goes_away_stops_the_request_being_answered_at_once():
    handler = Recorder()
    connection, _ = make(handler)
    stopped: list[str] = []
    feed(connection, b"GET /a HTTP/1.1\r\nhost: t\r\n\r\nGET /b HTTP/1.1\r\nhost: t\r\n\r\n")
    (first,) = handler.requests  # /b waits behind it, not started
    first.on_gone = lambda: stopped.append(first.path)
    connection.connection_lost(None)
    assert stopped == ["/a"]
    connection.connection_lost(None)  # once
    assert stopped == ["/a"] and handler.requests == [first]


@on_loop
async def test_a_request_already_answered_is_not_stopped_when_its_client_leaves():
    handler = Recorder()
    connection, _ = make(handler)
    stopped: list[str] = []
    feed(connection, b"GET /a HTTP/1.1\r\nhost: t\r\n\r\n")
    (request,) = handler.requests
    request.on_gone = lambda: stopped.append(request.path)
    request.respond(200, b"{}")
    connection.connection_lost(None)
    assert stopped == []
