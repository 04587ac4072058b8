"""Load on demand racing explicit unloads and reloads, on the real server.

``explicit`` model control with load on demand and ``--max-loaded-models 2``: four Python
models that take 0.3 s to load; four clients cycle over them while one thread unloads the
first model every 0.3 s and another reloads the second with a changing configuration. Every
request must get 200 with its own model's answer (one that meets an unload waits for it and
the load that follows); never more than two models loaded; nothing left LOADING or
UNLOADING. (The randomised version on a fake clock is tests/unit/test_load_on_demand_races.py.)
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.helpers import InProcessServer

pytestmark = pytest.mark.timeout(120)

MODEL_PY = """
import time

import numpy as np

from gpuserve import PythonModel


class Model(PythonModel):
    def load(self, context):
        time.sleep(0.3)
        self.ident = int(context.parameters["ident"])

    def forward(self, batch):
        rows = batch["INPUT0"].shape[0]
        return {"OUTPUT0": np.full((rows, 1), self.ident, dtype=np.int64)}
"""


def model_config(ident: int, generation: int = 0) -> dict:
    return {
        "backend": "python",
        "max_batch_size": 4,
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1]}],
        "outputs": [{"name": "OUTPUT0", "datatype": "INT64", "shape": [1]}],
        "instance_group": [{"count": 1, "kind": "cpu"}],
        "parameters": {"ident": str(ident), "generation": str(generation)},
    }


def write_models(root: Path) -> Path:
    for i in range(4):
        folder = root / f"m{i}"
        (folder / "1").mkdir(parents=True)
        (folder / "1" / "model.py").write_text(MODEL_PY)
        (folder / "config.yaml").write_text(json.dumps(model_config(i)))  # YAML reads JSON
    return root


BODY = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [0.0]}]}


class MostLoaded:
    """A version listener: the most models loaded (any version present) at once, read
    each time a version is about to turn READY."""

    def __init__(self, manager) -> None:
        self.manager = manager
        self.most = 0
        manager.version_listeners.append(self)

    def __call__(self, mv) -> None:
        loaded = {m.name for m in self.manager.models.values() if m.versions}
        self.most = max(self.most, len(loaded | {mv.model}))


@pytest.mark.parametrize("versioned", [False, True], ids=["default-version", "version-1"])
def test_requests_wait_for_an_unload_and_the_load_that_follows(tmp_path, versioned):
    server = InProcessServer(
        write_models(tmp_path / "repo"),
        model_control_mode="explicit",
        load_on_demand=True,
        max_loaded_models=2,
    )
    try:
        watch = MostLoaded(server.manager)
        url = server.url
        stop = time.monotonic() + 4.0
        answers: Counter[int] = Counter()
        bad: list[tuple] = []
        control: Counter[str] = Counter()

        def client(start: int) -> None:
            with httpx.Client(base_url=url, timeout=60) as http:
                n = start
                while time.monotonic() < stop:
                    i, n = n % 4, n + 1
                    path = f"/v2/models/m{i}" + ("/versions/1" if versioned else "") + "/infer"
                    response = http.post(path, json=BODY)
                    if response.status_code != 200:
                        bad.append((i, response.status_code, response.text))
                    elif response.json()["outputs"][0]["data"][0] != i:
                        bad.append((i, "answered", response.json()["outputs"][0]["data"]))
                    else:
                        answers[i] += 1

        def unloader() -> None:
            with httpx.Client(base_url=url, timeout=60) as http:
                while time.monotonic() < stop:
                    response = http.post("/v2/repository/models/m0/unload")
                    control[f"unload {response.status_code}"] += 1
                    if response.status_code != 200:
                        bad.append(("unload", response.status_code, response.text))
                    time.sleep(0.3)

        def reloader() -> None:
            with httpx.Client(base_url=url, timeout=60) as http:
                generation = 0
                while time.monotonic() < stop:
                    generation += 1
                    config = json.dumps(model_config(1, generation))
                    response = http.post(
                        "/v2/repository/models/m1/load", json={"parameters": {"config": config}}
                    )
                    control[f"load {response.status_code}"] += 1
                    # an explicit load may find every other model busy: its documented 503
                    if response.status_code != 200 and not (
                        response.status_code == 503 and "limit of 2 loaded" in response.text
                    ):
                        bad.append(("load", response.status_code, response.text))
                    time.sleep(0.3)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        threads += [threading.Thread(target=unloader), threading.Thread(target=reloader)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

        assert not bad, bad[:5]
        assert all(answers[i] for i in range(4)), answers
        assert control["unload 200"] >= 5 and control["load 200"] >= 1, control
        assert watch.most <= 2, watch.most
        rows = httpx.post(f"{url}/v2/repository/index", json={}).json()
        assert all(r["state"] in ("READY", "UNAVAILABLE") for r in rows), rows
    finally:
        server.stop()
