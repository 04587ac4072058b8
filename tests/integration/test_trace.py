"""On-demand torch.profiler trace of the next N batches, through the management API."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from tests.conftest import FIXTURE_REPOSITORY
from tests.helpers import InProcessServer


def test_trace_of_next_batches_is_written(tmp_path):
    server = InProcessServer(FIXTURE_REPOSITORY, enable_management=True, trace_dir=tmp_path)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            started = client.post("/v2/repository/models/torch_linear/trace", json={"batches": 2})
            assert started.status_code == 200, started.text
            directory = tmp_path / started.json()["trace"]
            body = {
                "inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]
            }
            for _ in range(3):
                assert client.post("/v2/models/torch_linear/infer", json=body).status_code == 200
            deadline = time.monotonic() + 10
            files: list[Path] = []
            while time.monotonic() < deadline and not files:
                files = list(directory.glob("*.pt.trace.json")) if directory.exists() else []
                time.sleep(0.1)
            assert len(files) == 1
            trace = json.loads(files[0].read_text())
            names = {event.get("name", "") for event in trace["traceEvents"]}
            assert any("linear" in n or "addmm" in n for n in names), sorted(names)[:20]
            bad = client.post("/v2/repository/models/torch_linear/trace", json={"batches": 0})
            assert bad.status_code == 400 and "batches" in bad.json()["error"]
    finally:
        server.stop()
