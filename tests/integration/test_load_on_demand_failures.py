"""BC-44 over HTTP and gRPC: under load on demand, a model that keeps failing to load is not
loaded again for every request (one attempt, then fast 503s naming the error and when the
next attempt is due, counted apart from the attempts), a fixed model loads again with no
restart, and a model larger than the memory limit is served alone and never blocks the models
that come after it.

The scenario of the case, scaled down (a 64 MiB limit, 8 MiB models, a 100 MiB model):
``broken`` raises 0.3 s into its load and appends a line to a log per attempt; ``small1`` and
``small2`` make an 8 MiB array in code; ``big`` reads a 100 MiB weights file (so its own files
tell its size before its first load).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.helpers import InProcessServer
from tests.integration.frontends import FrontendError, Status, open_frontend, tensor
from tests.integration.test_load_on_demand import metric, state_of

pytestmark = pytest.mark.timeout(120)

MIB = 1024 * 1024
LIMIT_BYTES = 64 * MIB
SMALL_BYTES = 8 * MIB
BIG_BYTES = 100 * MIB

CONFIG = """backend: python
max_batch_size: 4
inputs: [{name: INPUT0, datatype: FP32, shape: [1]}]
outputs: [{name: OUTPUT0, datatype: INT64, shape: [1]}]
instance_group: [{count: 1, kind: cpu}]
parameters: {ident: %d}
"""

SMALL_PY = f"""
import numpy as np

from gpuserve import PythonModel


class Model(PythonModel):
    def load(self, context):
        self.ident = int(context.parameters["ident"])
        self.ballast = np.ones({SMALL_BYTES} // 8, dtype=np.float64)

    def forward(self, batch):
        rows = batch["INPUT0"].shape[0]
        return {{"OUTPUT0": np.full((rows, 1), self.ident, dtype=np.int64)}}
"""

BIG_PY = """
import os

import numpy as np

from gpuserve import PythonModel


class Model(PythonModel):
    def load(self, context):
        self.ident = int(context.parameters["ident"])
        self.weights = np.load(os.path.join(os.path.dirname(__file__), "weights.npy"))
        self.weights += 1  # resident, not a mapping of the file

    def forward(self, batch):
        rows = batch["INPUT0"].shape[0]
        return {"OUTPUT0": np.full((rows, 1), self.ident, dtype=np.int64)}
"""

BROKEN_PY = """
import time

from gpuserve import PythonModel


class Model(PythonModel):
    def load(self, context):
        with open({log!r}, "a") as log:
            log.write("attempt\\n")
        time.sleep(0.3)
        raise RuntimeError("weights file truncated")

    def forward(self, batch):
        raise AssertionError("never loads")
"""


def write(root: Path, name: str, ident: int, model_py: str) -> Path:
    folder = root / name / "1"
    folder.mkdir(parents=True)
    (root / name / "config.yaml").write_text(CONFIG % ident)
    (folder / "model.py").write_text(model_py)
    return folder


def repository(root: Path, log: Path) -> Path:
    write(root, "broken", 9, BROKEN_PY.format(log=str(log)))
    write(root, "small1", 1, SMALL_PY)
    write(root, "small2", 2, SMALL_PY)
    big = write(root, "big", 7, BIG_PY)
    np.save(big / "weights.npy", np.zeros(BIG_BYTES // 8, dtype=np.float64))
    return root


def attempts(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_bc44_backoff_fixed_model_and_a_model_larger_than_the_limit(tmp_path, kind, caplog):
    log = tmp_path / "attempts.log"
    repo = repository(tmp_path / "repo", log)
    server = InProcessServer(
        repo,
        load_on_demand=True,
        max_loaded_models=3,
        loaded_models_memory_bytes=LIMIT_BYTES,
        model_load_timeout_s=30,
    )
    inputs = [tensor("INPUT0", np.zeros((1, 1), dtype=np.float32))]
    url = server.url
    try:
        frontend = open_frontend(kind, server)

        def infer(name: str):
            try:
                return int(frontend.infer(name, inputs).outputs["OUTPUT0"][0][0])
            except FrontendError as err:
                return err

        # 1. ten concurrent requests share one attempt ...
        outcomes: list[object] = [None] * 10
        threads = [
            threading.Thread(target=lambda i=i: outcomes.__setitem__(i, infer("broken")))
            for i in range(10)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        errors = [o for o in outcomes if isinstance(o, FrontendError)]
        assert len(errors) == 10, outcomes
        assert {e.status for e in errors} == {Status.UNAVAILABLE}
        assert all("weights file truncated" in e.message for e in errors), errors
        assert attempts(log) == 1
        # ... and ten sequential ones get a fast 503 each, with no new attempt (the log)
        for _ in range(10):
            started = time.monotonic()
            err = infer("broken")
            took = time.monotonic() - started
            assert isinstance(err, FrontendError) and err.status is Status.UNAVAILABLE, err
            assert "weights file truncated" in err.message, err.message
            assert "next attempt is due in" in err.message, err.message
            assert err.retry_after_s is not None and 1 <= err.retry_after_s <= 60, err
            assert took < 3.0, took  # not the 30 s load timeout (margin for a busy machine)
        assert attempts(log) == 1
        assert metric(url, "gpuserve_model_loads_total", model="broken", outcome="failure") == 1
        refusals = "gpuserve_model_load_refusals_total"
        refused = metric(url, refusals, model="broken", reason="backoff")
        assert 10 <= refused <= 19, refused  # the sequential ten, and any concurrent latecomer

        # 2. other models are unaffected; readiness tells which a request would load
        assert infer("small1") == 1
        assert frontend.model_ready("small1") is True
        assert frontend.model_ready("small2") is True  # not loaded: its request loads it
        assert frontend.model_ready("broken") is False  # its back-off lasts
        assert metric(url, "gpuserve_model_loads_total", model="small1", outcome="success") == 1

        # 3. a fixed model loads again at its next request, no restart, no wait for the back-off
        fixed = repo / "broken" / "1" / "model.py"
        fixed.write_text(SMALL_PY)
        os.utime(fixed, ns=(time.time_ns(), time.time_ns() + 1_000_000))
        assert frontend.model_ready("broken") is True  # its folder changed: it would load
        assert infer("broken") == 9
        assert metric(url, "gpuserve_model_loads_total", model="broken", outcome="success") == 1

        # 4. a model larger than the whole limit is served alone, with a warning ...
        with caplog.at_level(logging.WARNING, logger="gpuserve.repository.ondemand.loader"):
            assert infer("big") == 7
        assert caplog.text.count("served alone") == 1, caplog.text
        assert state_of(url, "big")[0] == "READY"
        for other in ("small1", "broken"):
            state, reason = state_of(url, other)
            assert state != "READY" and "bytes of loaded models" in reason, (other, reason)
        # ... and never blocks the models that come after it (small2 never loaded before)
        for name, ident in (("small1", 1), ("small2", 2)):
            started = time.monotonic()
            assert infer(name) == ident
            assert time.monotonic() - started < 10
        assert state_of(url, "big")[0] != "READY"  # evicted to make room
        assert metric(url, "gpuserve_loaded_models") <= 3
    finally:
        server.stop()


def test_an_explicit_load_retries_at_once_and_shares_the_record(tmp_path):
    """Explicit mode with load on demand: a request's failed load starts the back-off; an
    explicit load tries at once anyway (an attempt, counted in the same record), and the
    requests after it are refused from the same back-off with the attempts in a row."""
    log = tmp_path / "attempts.log"
    repo = repository(tmp_path / "repo", log)
    server = InProcessServer(repo, load_on_demand=True, model_control_mode="explicit")
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [0.0]}]}
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            first = client.post("/v2/models/broken/infer", json=body)
            assert first.status_code == 503 and "1 failed attempt(s)" in first.json()["error"]
            assert attempts(log) == 1
            load = client.post("/v2/repository/models/broken/load")
            assert load.status_code in (400, 500, 503), load.text
            assert "weights file truncated" in load.json()["error"]
            assert attempts(log) == 2  # tried at once despite the back-off
            again = client.post("/v2/models/broken/infer", json=body)
            assert again.status_code == 503, again.text
            assert "2 failed attempt(s)" in again.json()["error"], again.text
            assert int(again.headers["retry-after"]) > 60  # doubled: the one back-off
            assert attempts(log) == 2
    finally:
        server.stop()


def test_a_changed_configuration_ends_the_back_off(tmp_path):
    """The version folder is fine; the configuration gives the model a parameter its load
    refuses. Fixing ``config.yaml`` alone makes the next request try at once."""
    repo = tmp_path / "repo"
    picky = SMALL_PY.replace(
        '        self.ident = int(context.parameters["ident"])\n',
        '        self.ident = int(context.parameters["ident"])\n'
        "        if self.ident < 0:\n"
        "            raise ValueError(f'ident {self.ident} must be >= 0')\n",
    )
    write(repo, "picky", -1, picky)
    server = InProcessServer(repo, load_on_demand=True)
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [0.0]}]}
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            first = client.post("/v2/models/picky/infer", json=body)
            assert first.status_code == 503 and "must be >= 0" in first.json()["error"]
            again = client.post("/v2/models/picky/infer", json=body)
            assert again.status_code == 503 and "next attempt is due" in again.json()["error"]
            assert client.get("/v2/models/picky/ready").status_code == 503
            (repo / "picky" / "config.yaml").write_text(CONFIG % 5)
            assert client.get("/v2/models/picky/ready").status_code == 200
            fixed = client.post("/v2/models/picky/infer", json=body)
            assert fixed.status_code == 200, fixed.text
            assert fixed.json()["outputs"][0]["data"] == [5]
        assert metric(server.url, "gpuserve_model_loads_total", model="picky") == 2
    finally:
        server.stop()
