"""The HTTP/1.1 transport (gpuserve.server.http.connection) over raw sockets: persistence,
pipelining order, chunked bodies, 100-continue, HEAD, HTTP/1.0, malformed input, size limits,
idle timeout, clients that leave, and large binary bodies."""

from __future__ import annotations

import json
import socket
import struct
import time

import numpy as np
import pytest

from tests.conftest import FIXTURE_REPOSITORY
from tests.helpers import InProcessServer

DOUBLE = "/v2/models/double_fp32/infer"


def double_body(rows: int = 1, start: float = 0.0) -> bytes:
    data = (np.arange(rows * 16, dtype=np.float32) + start).tolist()
    return json.dumps(
        {"inputs": [{"name": "INPUT0", "shape": [rows, 16], "datatype": "FP32", "data": data}]}
    ).encode()


def post(path: str, body: bytes, extra: str = "", version: str = "1.1") -> bytes:
    return (
        f"POST {path} HTTP/{version}\r\nhost: t\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


def get(path: str, method: str = "GET") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nhost: t\r\n\r\n".encode()


class Reader:
    """Reads HTTP/1.1 responses (content-length framed) from a socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def _fill(self) -> bool:
        chunk = self.sock.recv(1 << 20)
        self.buffer += chunk
        return bool(chunk)

    def response(self, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buffer:
            if not self._fill():
                raise ConnectionError(f"closed before a response head: {self.buffer!r}")
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
        if head_only or status == 100:
            return status, headers, b""
        size = int(headers["content-length"])
        while len(self.buffer) < size:
            if not self._fill():
                raise ConnectionError("closed inside a response body")
        body, self.buffer = self.buffer[:size], self.buffer[size:]
        return status, headers, body

    def closed(self, timeout_s: float = 5.0) -> bool:
        self.sock.settimeout(timeout_s)
        try:
            return self.sock.recv(1) == b""
        except (ConnectionResetError, TimeoutError):
            return False


@pytest.fixture(scope="module")
def small_server():
    running = InProcessServer(
        FIXTURE_REPOSITORY,
        max_request_body_bytes=64 * 1024,
        max_header_bytes=4096,
        http_keep_alive_timeout_s=1.0,
    )
    yield running
    running.stop()


def connect(server) -> tuple[socket.socket, Reader]:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock, Reader(sock)


def test_persistent_connection_serves_many_requests(server):
    sock, reader = connect(server)
    with sock:
        for i in range(20):
            sock.sendall(post(DOUBLE, double_body(1, float(i))))
            status, headers, body = reader.response()
            assert status == 200, body
            assert "connection" not in headers and "date" in headers
            assert json.loads(body)["outputs"][0]["data"][0] == 2.0 * i


def test_pipelined_requests_are_answered_in_order(server):
    """A slow inference first, then a health check and a fast inference in the same write:
    the answers come back in request order, not in completion order."""
    slow = json.dumps(
        {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 16}]}
    ).encode()
    sock, reader = connect(server)
    with sock:
        sock.sendall(
            post("/v2/models/slow_fp32/infer", slow)
            + get("/v2/health/live")
            + post(DOUBLE, double_body(1, 3.0))
        )
        first = reader.response()
        second = reader.response()
        third = reader.response()
    assert first[0] == 200 and json.loads(first[2])["model_name"] == "slow_fp32"
    assert second[0] == 200 and json.loads(second[2]) == {"live": True}
    assert third[0] == 200 and json.loads(third[2])["outputs"][0]["data"][0] == 6.0


def test_chunked_request_body(server):
    body = double_body(2, 1.0)
    pieces = [body[i : i + 50] for i in range(0, len(body), 50)]
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    head = (
        f"POST {DOUBLE} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        "transfer-encoding: chunked\r\n\r\n"
    ).encode()
    sock, reader = connect(server)
    with sock:
        sock.sendall(head)
        for i in range(0, len(chunked), 37):  # and split across reads at odd places
            sock.sendall(chunked[i : i + 37])
        status, _, answer = reader.response()
    assert status == 200, answer
    assert json.loads(answer)["outputs"][0]["data"][:2] == [2.0, 4.0]


def test_expect_100_continue(server):
    body = double_body()
    sock, reader = connect(server)
    with sock:
        head = post(DOUBLE, b"", "expect: 100-continue\r\n")
        sock.sendall(head.replace(b"content-length: 0", f"content-length: {len(body)}".encode()))
        status, _, _ = reader.response()
        assert status == 100
        sock.sendall(body)
        status, _, answer = reader.response()
    assert status == 200, answer


def test_head_has_a_content_length_but_no_body(server):
    sock, reader = connect(server)
    with sock:
        sock.sendall(get("/v2/models/double_fp32/config", "HEAD") + get("/v2/health/live"))
        status, headers, _ = reader.response(head_only=True)
        assert status == 200 and int(headers["content-length"]) > 0
        # the next response starts right after the head: no body bytes in between
        status, _, body = reader.response()
    assert status == 200 and json.loads(body) == {"live": True}


def test_http_1_0_closes_after_the_answer(server):
    sock, reader = connect(server)
    with sock:
        sock.sendall(post(DOUBLE, double_body(), version="1.0"))
        status, headers, _ = reader.response()
        assert status == 200 and headers["connection"] == "close"
        assert reader.closed()


def test_malformed_request_gets_400_and_the_connection_closes(server):
    sock, reader = connect(server)
    with sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nbad header line\r\n\r\n")
        status, headers, body = reader.response()
        assert status == 400 and "malformed HTTP request" in json.loads(body)["error"]
        assert headers["connection"] == "close" and reader.closed()
    sock, reader = connect(server)  # the server itself is unharmed
    with sock:
        sock.sendall(get("/v2/health/live"))
        assert reader.response()[0] == 200


def test_body_over_the_limit_gets_413_at_once_then_the_connection_closes(small_server):
    """Content-Length over the limit: the 413 comes before the body is sent (a client need
    not upload what will be refused); chunked: as soon as the chunks pass the limit."""
    sock, reader = connect(small_server)
    with sock:
        sock.sendall(post(DOUBLE, b"").replace(b"content-length: 0", b"content-length: 300000000"))
        status, headers, body = reader.response()
        assert status == 413 and "max_request_body_bytes" in json.loads(body)["error"]
        assert headers["connection"] == "close" and reader.closed()
    sock, reader = connect(small_server)
    with sock:
        head = f"POST {DOUBLE} HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
        chunks = b"".join(b"8000\r\n" + b"y" * 0x8000 + b"\r\n" for _ in range(3))
        sock.sendall(head.encode() + chunks)  # 96 KiB of a body that has no end yet
        status, headers, body = reader.response()
        assert status == 413 and headers["connection"] == "close"
    sock, reader = connect(small_server)  # the server is unharmed
    with sock:
        sock.sendall(post(DOUBLE, double_body()))
        assert reader.response()[0] == 200


def test_endless_header_is_cut_off_with_431(small_server):
    sock, reader = connect(small_server)
    with sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nx-long: ")
        try:
            for _ in range(256):  # 256 KB of one header that never ends
                sock.sendall(b"a" * 1024)
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, headers, body = reader.response()
    assert status == 431 and "max_header_bytes" in json.loads(body)["error"]
    assert headers["connection"] == "close"


def test_idle_connection_is_closed_after_the_keep_alive_timeout(small_server):
    sock, reader = connect(small_server)
    with sock:
        sock.sendall(get("/v2/health/live"))
        assert reader.response()[0] == 200
        started = time.monotonic()
        assert reader.closed(timeout_s=5.0)
        assert 0.8 < time.monotonic() - started < 4.0


def test_busy_connection_is_not_closed_by_the_keep_alive_timeout(small_server):
    """slow_fp32_1s takes longer than the 1 s keep-alive timeout: the answer still arrives."""
    body = json.dumps(
        {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 16}]}
    ).encode()
    sock, reader = connect(small_server)
    with sock:
        sock.sendall(post("/v2/models/slow_fp32_1s/infer", body))
        status, _, answer = reader.response()
    assert status == 200, answer


def test_clients_that_leave_mid_request_do_not_disturb_others(server, client):
    body = json.dumps(
        {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 16}]}
    ).encode()
    for _ in range(10):
        sock, _ = connect(server)
        sock.sendall(post("/v2/models/slow_fp32/infer", body))
        sock.close()
        sock, _ = connect(server)  # and one that leaves half-way through its body
        sock.sendall(post(DOUBLE, double_body())[:-10])
        sock.close()
    response = client.post(DOUBLE, content=double_body(1, 1.0))
    assert response.status_code == 200
    assert client.get("/v2/health/ready").status_code == 200


def test_percent_encoded_path(server):
    sock, reader = connect(server)
    with sock:
        sock.sendall(post("/v2/models/double%5Ffp32/infer", double_body(1, 2.0)))
        status, _, body = reader.response()
    assert status == 200 and json.loads(body)["outputs"][0]["data"][0] == 4.0


def test_binary_tensor_of_4_mib_both_ways(server):
    """1 Mi FP32 values in and out over the binary tensor extension, split into small reads
    on the way in; the answer is byte-exact."""
    values = np.random.default_rng(0).standard_normal((1, 1 << 20)).astype(np.float32)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "X",
                    "shape": list(values.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": values.nbytes},
                }
            ],
            "outputs": [{"name": "Y", "parameters": {"binary_data": True}}],
        }
    ).encode()
    body = header + values.tobytes()
    extra = f"inference-header-content-length: {len(header)}\r\n"
    sock, reader = connect(server)
    with sock:
        request = post("/v2/models/varlen_fp32/infer", body, extra)
        for i in range(0, len(request), 1 << 16):
            sock.sendall(request[i : i + (1 << 16)])
        status, headers, answer = reader.response()
    assert status == 200, answer[:200]
    json_size = int(headers["inference-header-content-length"])
    out = json.loads(answer[:json_size])["outputs"][0]
    assert out["parameters"]["binary_data_size"] == values.nbytes
    result = np.frombuffer(answer[json_size:], dtype=np.float32).reshape(values.shape)
    np.testing.assert_array_equal(result, values + 1)
    assert struct.calcsize("f") * values.size == len(answer) - json_size


def test_thousands_of_pipelined_requests_in_one_write(server):
    """Reads that end inside a request head must not add up to a false 431."""
    import threading

    count = 5000
    sock, reader = connect(server)
    with sock:
        sender = threading.Thread(target=sock.sendall, args=(get("/v2/health/live") * count,))
        sender.start()
        statuses = [reader.response()[0] for _ in range(count)]
        sender.join()
    assert statuses == [200] * count


def test_header_values_that_are_not_ascii_are_client_errors(server):
    body = double_body()
    sock, reader = connect(server)
    with sock:
        sock.sendall(post(DOUBLE, body, "inference-header-content-length: \xff\xfe\r\n"))
        status, _, answer = reader.response()
    assert status == 400 and "inference-header-content-length" in answer.decode().lower()


def test_upgrade_is_never_switched_to(server):
    sock, reader = connect(server)
    with sock:
        sock.sendall(
            b"GET /v2/health/live HTTP/1.1\r\nhost: t\r\nconnection: upgrade\r\n"
            b"upgrade: h2c\r\n\r\n"
        )
        status, headers, _ = reader.response()
        assert status == 200 and headers["connection"] == "close" and reader.closed()
    sock, reader = connect(server)
    with sock:
        sock.sendall(post(DOUBLE, double_body(), "connection: upgrade\r\nupgrade: websocket\r\n"))
        status, headers, answer = reader.response()
    assert status == 400 and "Upgrade" in json.loads(answer)["error"]


def test_a_refusal_comes_after_the_answers_before_it(server):
    slow = json.dumps(
        {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 16}]}
    ).encode()
    sock, reader = connect(server)
    with sock:
        sock.sendall(post("/v2/models/slow_fp32/infer", slow) + b"BREW /pot HTTP/1.1\r\n\r\n")
        first = reader.response()
        second = reader.response()
    assert first[0] == 200 and "connection" not in first[1]
    assert second[0] == 400 and second[1]["connection"] == "close"
