"""The bulk lane behind the real server: requests marked bulk (header ``x-gpuserve-lane`` on
any HTTP route, or the V2 parameter ``lane``) run only when no interactive request waits;
a bad lane is a 400 naming where it came from; ``/metrics`` shows each lane."""

from __future__ import annotations

import concurrent.futures
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import InProcessServer, wait_queue, wait_until

MODEL = textwrap.dedent(
    """
    import threading
    import numpy as np
    from gpuserve import PythonModel

    ORDER = []
    GATE = threading.Event()  # a test closes it to hold the instance busy
    GATE.set()

    class Model(PythonModel):
        def forward(self, batch):
            x = batch["X"]
            ORDER.extend(float(v) for v in x[:, 0])
            GATE.wait(20)
            return {"Y": x * 2}
    """
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root: Path = tmp_path_factory.mktemp("lanes")
    (root / "slow" / "1").mkdir(parents=True)
    (root / "slow" / "1" / "model.py").write_text(MODEL)
    (root / "slow" / "config.yaml").write_text(
        "backend: python\nmax_batch_size: 1\n"
        "inputs: [{name: X, datatype: FP32, shape: [1]}]\n"
        "outputs: [{name: Y, datatype: FP32, shape: [1]}]\n"
        "instance_group: [{count: 1, kind: cpu}]\n"
    )
    running = InProcessServer(root)
    yield running
    running.stop()


def model_globals(server: Any) -> dict[str, Any]:
    runner = server.manager.models["slow"].route.default.runner
    instance = runner.instances[0]
    return type(instance.backend.model).forward.__globals__


def body(value: float, **parameters: Any) -> dict[str, Any]:
    document: dict[str, Any] = {
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 1], "data": [value]}]
    }
    if parameters:
        document["parameters"] = parameters
    return document


def test_interactive_requests_overtake_a_bulk_backlog(server: Any) -> None:
    url = f"{server.url}/v2/models/slow/infer"
    names = model_globals(server)
    ran, gate = names["ORDER"], names["GATE"]
    ran.clear()
    gate.clear()  # the instance holds its first batch until the queue is set up
    bulk_header = {"x-gpuserve-lane": "bulk"}
    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(httpx.post, url, json=body(100), headers=bulk_header)]
            wait_until(lambda: len(ran) == 1, 10, "the first bulk request to run")
            futures += [
                pool.submit(httpx.post, url, json=body(101 + i), headers=bulk_header, timeout=30)
                for i in range(5)
            ]
            futures += [  # the V2 parameter marks bulk too
                pool.submit(httpx.post, url, json=body(200 + i, lane="bulk"), timeout=30)
                for i in range(4)
            ]
            wait_queue(server.url, "slow", queued=9)
            futures += [pool.submit(httpx.post, url, json=body(i), timeout=30) for i in (1, 2)]
            wait_queue(server.url, "slow", queued=11)
            gate.set()
            assert [f.result().status_code for f in futures] == [200] * 12
    finally:
        gate.set()
    # the running bulk batch, then both interactive requests, then the rest of the backlog
    assert ran[0] == 100.0 and sorted(ran[1:3]) == [1.0, 2.0], ran
    assert all(v >= 100 for v in ran[3:]) and len(ran) == 12, ran


def test_a_bad_lane_is_a_400_naming_it(server: Any) -> None:
    url = f"{server.url}/v2/models/slow/infer"
    answer = httpx.post(url, json=body(1), headers={"x-gpuserve-lane": "fast"}, timeout=10)
    assert answer.status_code == 400 and "header x-gpuserve-lane" in answer.text
    answer = httpx.post(url, json=body(1, lane="later"), timeout=10)
    assert answer.status_code == 400 and "request parameter 'lane'" in answer.text


def test_metrics_show_each_lane(server: Any) -> None:
    url = f"{server.url}/v2/models/slow/infer"
    httpx.post(url, json=body(5), headers={"x-gpuserve-lane": "bulk"}, timeout=10)
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'gpuserve_lane_queued_rows{lane="interactive",model="slow",version="1"}' in text
    bulk_rows = [
        line
        for line in text.splitlines()
        if line.startswith("gpuserve_lane_rows_total") and 'lane="bulk"' in line
    ]
    assert bulk_rows and float(bulk_rows[0].rsplit(" ", 1)[1]) >= 1
