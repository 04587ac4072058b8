"""A canary is decoded against its own configuration, not the default version's.

Version 1 and version 2 of one model declare the same tensors, so the canary takes traffic,
but the backends complete their configurations differently: version 1 is a ``torch.export``
program with an unbounded batch dimension (``max_batch_size`` 8), version 2 one whose batch
dimension is bounded at 2 rows (``max_batch_size`` 2). A request of 4 rows fits version 1
only. With the canary taking every unversioned request, it must be refused with 400 naming
version 2's limit over both front ends, and counted on version 2, instead of being admitted
on version 1's terms and failing inside the canary's queue.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import torch

from tests.fixtures.backend_models import make_module, reference
from tests.helpers import InProcessServer

pytestmark = pytest.mark.slow

CONFIG = """\
backend: torch
inputs:
  - {name: INPUT0, datatype: FP32, shape: [8]}
outputs:
  - {name: OUTPUT0, datatype: FP32, shape: [4]}
dynamic_batching: {max_queue_delay_us: 1000}
version_policy: {all: {}}
canary: {version: 2, weight: 1.0}
"""


def _export(module: torch.nn.Module, folder: Path, batch_max: int | None) -> None:
    folder.mkdir(parents=True)
    batch = torch.export.Dim("batch", max=batch_max) if batch_max else torch.export.Dim("batch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(
            module, (torch.randn(2, 8),), dynamic_shapes={"x": {0: batch}}
        )
    torch.export.save(program, str(folder / "model.pt2"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("canary-repo")
    folder = repository / "canaried"
    module = make_module()
    _export(module, folder / "1", None)
    _export(module, folder / "2", 2)
    (folder / "config.yaml").write_text(CONFIG)
    running = InProcessServer(repository)
    running.module = module
    yield running
    running.stop()


def _body(rows: np.ndarray) -> dict:
    return {
        "id": "r1",
        "inputs": [
            {
                "name": "INPUT0",
                "datatype": "FP32",
                "shape": list(rows.shape),
                "data": rows.ravel().tolist(),
            }
        ],
    }


def test_the_versions_are_served_with_different_batch_limits(server):
    one = httpx.get(f"{server.url}/v2/models/canaried/versions/1/config").json()
    two = httpx.get(f"{server.url}/v2/models/canaried/versions/2/config").json()
    status = httpx.post(f"{server.url}/v2/repository/models/canaried/status").json()
    assert status["canary"] == {"version": "2", "weight": 1.0}
    # /config shows the served (default) version's configuration
    assert one["max_batch_size"] == two["max_batch_size"] == 8
    scheduler = server.manager.version("canaried", "2").runner
    assert scheduler.config.max_batch_size == 2


def test_a_request_too_large_for_the_canary_is_refused_with_its_limit_over_http(server):
    rows = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    stats = server.manager.version("canaried", "2").runner.stats
    failed_before = stats.fail.count
    response = httpx.post(f"{server.url}/v2/models/canaried/infer", json=_body(rows))
    assert response.status_code == 400, response.text
    message = response.json()["error"]
    assert "max_batch_size" in message and "2" in message
    assert stats.fail.count == failed_before + 1  # counted on the version that refused it


def test_a_request_that_fits_the_canary_runs_on_it(server):
    rows = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)
    response = httpx.post(f"{server.url}/v2/models/canaried/infer", json=_body(rows))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model_version"] == "2"
    got = np.array(body["outputs"][0]["data"], dtype=np.float32).reshape(2, 4)
    np.testing.assert_allclose(got, reference(server.module, rows), rtol=1e-5, atol=1e-5)


def test_a_request_too_large_for_the_canary_is_refused_over_grpc(server):
    from gpuserve.protocol.protos import grpc_service_pb2 as pb
    from gpuserve.protocol.protos import grpc_service_pb2_grpc as pb_grpc

    rows = np.random.default_rng(2).standard_normal((4, 8)).astype(np.float32)
    request = pb.ModelInferRequest(
        model_name="canaried",
        id="r2",
        inputs=[
            pb.ModelInferRequest.InferInputTensor(name="INPUT0", datatype="FP32", shape=[4, 8])
        ],
        raw_input_contents=[rows.tobytes()],
    )
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(request, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_batch_size" in caught.value.details()
