"""SIGTERM under load: every request gets its result or a clear refusal, and the process
exits 0 after draining (issue: graceful shutdown)."""

from __future__ import annotations

import signal
import threading

import httpx
import pytest

from tests.conftest import FIXTURE_REPOSITORY
from tests.helpers import SubprocessServer, wait_queue

pytestmark = pytest.mark.slow


def test_sigterm_under_load_loses_no_request():
    server = SubprocessServer(
        "--model-repository", str(FIXTURE_REPOSITORY), "--shutdown-timeout-s", "20"
    )
    outcomes: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client(worker: int) -> None:
        n = 0
        while not stop.is_set():
            tag = float(worker * 10_000 + n)
            n += 1
            body = {
                "inputs": [
                    {
                        "name": "INPUT0",
                        "shape": [1, 16],
                        "datatype": "FP32",
                        "data": [tag] + [1.0] * 15,
                    }
                ]
            }
            try:
                # a new connection per request: a request is either sent or refused at connect
                response = httpx.post(
                    f"{server.url}/v2/models/slow_fp32/infer",
                    json=body,
                    timeout=30,
                    headers={"connection": "close"},
                )
            except httpx.ConnectError:
                outcome = "refused"
                stop.wait(0.05)
            except httpx.HTTPError as err:
                outcome = f"lost: {type(err).__name__}"
            else:
                if response.status_code == 200:
                    ok = response.json()["outputs"][0]["data"][0] == 2 * tag
                    outcome = "ok" if ok else "wrong"
                elif response.status_code == 503:
                    outcome = "refused"
                    stop.wait(0.2)  # a client backs off when told the server is going away
                else:
                    outcome = f"status {response.status_code}"
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    # slow_fp32: 0.5 s per batch of 8; 16 clients: SIGTERM once requests run and more wait
    wait_queue(server.url, "slow_fp32", executing=1, queued=1, deadline_s=30)
    with lock:
        before = outcomes.count("ok")
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(40)
    stop.set()
    for thread in threads:
        thread.join(40)
    assert code == 0, server.output()
    unexpected = [o for o in outcomes if o not in ("ok", "refused")]
    assert unexpected == [], unexpected
    # the requests in flight at SIGTERM (running and queued) completed
    assert outcomes.count("ok") > before
    assert "drain" in server.output() or "shutdown complete" in server.output()


def test_a_connection_accepted_before_sigterm_gets_an_answer_for_its_late_request():
    """A client that connected just before SIGTERM but is slow to write its request (a busy
    client machine) still gets an answer, not a connection closed unread."""
    import http.client
    import socket

    server = SubprocessServer(
        "--model-repository", str(FIXTURE_REPOSITORY), "--shutdown-timeout-s", "20"
    )
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    # A second, keep-alive connection, opened after it: once it has been answered the server's
    # event loop has accepted the first too (the kernel hands out connections in order), and
    # once the server closes it (idle) the listener's close-race pause is over and every
    # connection has been told to shut down.
    probe = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        probe.request("GET", "/v2/health/live")
        live = probe.getresponse()
        live.read()
        assert live.status == 200 and not live.will_close  # kept open, idle
        server.proc.send_signal(signal.SIGTERM)
        assert probe.sock.recv(1) == b""  # closed by the server after the pause (or times out)
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = sock.recv(4096)
    finally:
        probe.close()
        sock.close()
    assert answer.startswith(b"HTTP/1.1 "), answer
    assert server.proc.wait(40) == 0
