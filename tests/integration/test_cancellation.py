"""BC-11: clients that give up while queued never have their requests run, and the batcher
keeps serving everyone else."""

from __future__ import annotations

import concurrent.futures
import json
import socket

import httpx
import pytest

from tests.helpers import wait_until


def slow_model_log(server) -> list[float]:
    """The rows slow_fp32_1s actually ran (first element of each), from the loaded model."""
    scheduler = server.manager.runner("slow_fp32_1s", None)
    model = scheduler.instances[0].backend.model
    return type(model).forward.__globals__["RAN"]


def body(tag: float) -> dict:
    return {
        "inputs": [
            {"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [tag] + [0.0] * 15}
        ]
    }


def send_raw(port: int, tag: float) -> socket.socket:
    """Send one infer request on a raw connection and leave it waiting for the answer."""
    payload = json.dumps(body(tag)).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /v2/models/slow_fp32_1s/infer HTTP/1.1\r\nHost: test\r\n"
        b"Content-Type: application/json\r\nContent-Length: "
        + str(len(payload)).encode()
        + b"\r\n\r\n"
        + payload
    )
    return sock


def call(url: str, tag: float, timeout_s: float) -> int | None:
    try:
        response = httpx.post(
            f"{url}/v2/models/slow_fp32_1s/infer", json=body(tag), timeout=timeout_s
        )
    except httpx.TimeoutException:
        return None
    assert response.json()["outputs"][0]["data"][0] == 2 * tag
    return response.status_code


@pytest.mark.slow
def test_bc11_disconnected_clients_are_not_run_and_later_requests_succeed(server, client):
    url = server.url
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        # 1. a burst with patient clients
        assert list(pool.map(lambda t: call(url, t, 30), range(1, 9))) == [200] * 8
        # 2. a patient request occupies the instance for 1 s; 24 impatient clients queue
        #    behind it and give up after 0.2 s, before it finishes
        scheduler = server.manager.runner("slow_fp32_1s", None)
        blocker = pool.submit(call, url, 999.0, 30)
        wait_until(
            lambda: scheduler.instances[0].in_flight == 1 and len(scheduler.batcher) == 0,
            what="the blocker runs alone",
        )
        impatient = [1000.0 + i for i in range(24)]
        sockets = [send_raw(server.port, tag) for tag in impatient]
        wait_until(lambda: len(scheduler.batcher) >= 24, what="24 impatient requests queued")
        for sock in sockets:  # give up while queued
            sock.close()
        assert blocker.result() == 200
        # 3. the queue empties without running the abandoned requests
        seen = []

        def drained() -> bool:  # and nothing runs, so a wrongly run row is in the log
            seen.append(client.get("/v2/models/slow_fp32_1s/stats").json()["model_stats"][0])
            idle = len(scheduler.batcher) == 0 and scheduler.instances[0].in_flight == 0
            return idle and seen[-1]["failure_reasons"].get("cancelled", 0) >= 24

        wait_until(drained, deadline_s=5, what="an idle queue and 24 cancelled in the statistics")
        stats = seen[-1]
        ran = set(slow_model_log(server))
        assert [t for t in impatient if t in ran] == []
        assert stats["failure_reasons"].get("cancelled", 0) == 24
        # 4. patient clients again: all served
        assert list(pool.map(lambda t: call(url, t, 30), range(2000, 2016))) == [200] * 16
