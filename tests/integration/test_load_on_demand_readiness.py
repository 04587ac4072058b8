"""Model readiness under load on demand, through Triton's own clients: a model that a request
would load answers ready (so ``is_model_ready()`` followed by ``infer()`` works), the probe
loads nothing, and a model whose last load failed answers not ready until its back-off ends
or its files change.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from tests.helpers import InProcessServer
from tests.integration.test_load_on_demand import metric, state_of, write_model
from tests.integration.test_load_on_demand_failures import BROKEN_PY, SMALL_PY, write

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")

pytestmark = pytest.mark.timeout(120)


def client_of(kind: str, server: InProcessServer):
    if kind == "http":
        return httpclient, httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    return grpcclient, grpcclient.InferenceServerClient(server.grpc_url)


def infer(module, client, name: str) -> int:
    data = module.InferInput("INPUT0", [1, 1], "FP32")
    data.set_data_from_numpy(np.zeros((1, 1), dtype=np.float32))
    return int(client.infer(name, [data]).as_numpy("OUTPUT0")[0][0])


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_is_model_ready_then_infer_under_load_on_demand(tmp_path, kind):
    repo = tmp_path / "repo"
    write_model(repo, "m0", 0)
    write_model(repo, "m1", 1)
    write(repo, "broken", 9, BROKEN_PY.format(log=str(tmp_path / "attempts.log")))
    server = InProcessServer(repo, load_on_demand=True, max_loaded_models=1)
    module, client = client_of(kind, server)
    try:
        # not loaded, and a request would load it: ready; the probe itself loads nothing
        assert client.is_model_ready("m0") is True
        assert client.is_model_ready("m0", "1") is True
        assert state_of(server.url, "m0")[0] == "UNAVAILABLE"
        assert metric(server.url, "gpuserve_model_loads_total", model="m0") == 0
        assert infer(module, client, "m0") == 1
        assert client.is_model_ready("m0") is True
        # evicted to make room for m1: still ready, its next request loads it again
        assert infer(module, client, "m1") == 11
        assert state_of(server.url, "m0")[0] == "UNAVAILABLE"
        assert client.is_model_ready("m0") is True
        assert infer(module, client, "m0") == 1

        # a failed load: not ready while its back-off lasts ...
        assert client.is_model_ready("broken") is True  # never tried yet
        with pytest.raises(Exception, match="weights file truncated"):
            infer(module, client, "broken")
        assert client.is_model_ready("broken") is False
        # ... and ready again once its files change (the next request tries at once)
        fixed = repo / "broken" / "1" / "model.py"
        fixed.write_text(SMALL_PY)
        os.utime(fixed, ns=(time.time_ns(), time.time_ns() + 1_000_000))
        assert client.is_model_ready("broken") is True
        assert infer(module, client, "broken") == 9
    finally:
        client.close()
        server.stop()


def test_the_http_reason_of_a_cold_model_not_ready(tmp_path):
    import httpx

    repo = tmp_path / "repo"
    write(repo, "broken", 9, BROKEN_PY.format(log=str(tmp_path / "attempts.log")))
    server = InProcessServer(repo, load_on_demand=True)
    try:
        body = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [0]}]}
        assert httpx.post(f"{server.url}/v2/models/broken/infer", json=body).status_code == 503
        ready = httpx.get(f"{server.url}/v2/models/broken/ready")
        assert ready.status_code == 503, ready.text
        assert "weights file truncated" in ready.text and "next attempt" in ready.text, ready.text
    finally:
        server.stop()
