"""A model's outputs are checked against its config on every path (the shape, the datatype and
the names it declares), for Triton's ``TritonPythonModel`` and gpuserve's ``PythonModel``,
over HTTP and gRPC, batched and decoupled.

Each model takes ``X`` FP32 dims [4] (``max_batch_size: 8``, a 300 ms batching window so
concurrent requests share a batch) and declares ``Y`` FP32 [4] and ``Z`` FP32 [1]. The first
element of a request's row picks what the model does: 0 answers ``Y = 2X, Z = [1]``; 1
returns ``Y`` of shape [1, 3]; 2 returns ``Y`` as float64 with values float32 cannot hold
exactly; 3 returns float64 that float32 holds exactly (converted, 200); 4 omits ``Z``; 5 raises
in the model; 6 fails its own row (``TritonError`` / ``RowErrors``).
"""

from __future__ import annotations

import concurrent.futures
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.helpers import InProcessServer

pytestmark = pytest.mark.timeout(120)

TRITON_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 8
dynamic_batching {{ max_queue_delay_microseconds: 300000 }}
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [
  {{ name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }},
  {{ name: "Z" data_type: TYPE_FP32 dims: [ 1 ] }}
]
"""

TRITON_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            marker = int(x[0, 0])
            if marker == 5:
                raise RuntimeError("marker 5 raises")
            if marker == 6:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("marker 6 fails its request")))
                continue
            y = 2 * x
            if marker == 1:
                y = np.zeros((1, 3), np.float32)
            elif marker == 2:
                y = np.full((1, 4), 0.1, np.float64)
            elif marker == 3:
                y = y.astype(np.float64)
            tensors = [pb_utils.Tensor("Y", y)]
            if marker != 4:
                tensors.append(pb_utils.Tensor("Z", np.ones((1, 1), np.float32)))
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
"""

GPUSERVE_CONFIG = """
name: {name}
backend: python
max_batch_size: 8
dynamic_batching: {{max_queue_delay_us: 300000}}
inputs: [{{name: X, datatype: FP32, shape: [4]}}]
outputs: [{{name: Y, datatype: FP32, shape: [4]}}, {{name: Z, datatype: FP32, shape: [1]}}]
"""

GPUSERVE_MODEL = """
import numpy as np

from gpuserve.backends.base import RowErrors
from gpuserve.backends.python import PythonModel


class Model(PythonModel):
    def forward(self, inputs):
        x = inputs["X"]
        markers = x[:, 0].astype(int).tolist()
        if 5 in markers:
            raise RuntimeError("marker 5 raises")
        y = 2 * x
        z = np.ones((len(x), 1), np.float32)
        if 1 in markers:
            y = np.zeros((len(x), 3), np.float32)
        elif 2 in markers:
            y = np.full((len(x), 4), 0.1, np.float64)
        elif 3 in markers:
            y = y.astype(np.float64)
        outputs = {"Y": y} if 4 in markers else {"Y": y, "Z": z}
        failed = {row: "marker 6 fails its row" for row, m in enumerate(markers) if m == 6}
        return RowErrors(outputs, failed) if failed else outputs
"""

APIS = ["triton", "gpuserve"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    repo = tmp_path_factory.mktemp("output_checks")
    for api in APIS:
        folder = repo / api
        (folder / "1").mkdir(parents=True)
        if api == "triton":
            (folder / "config.pbtxt").write_text(TRITON_CONFIG.format(name=api))
            (folder / "1" / "model.py").write_text(textwrap.dedent(TRITON_MODEL))
        else:
            (folder / "config.yaml").write_text(GPUSERVE_CONFIG.format(name=api))
            (folder / "1" / "model.py").write_text(textwrap.dedent(GPUSERVE_MODEL))
    running = InProcessServer(Path(repo))
    try:
        yield running
    finally:
        running.stop()


def row(marker: float) -> list[float]:
    return [marker, 1.0, 2.0, 3.0]


def infer_http(server: InProcessServer, model: str, marker: float) -> httpx.Response:
    body = {"inputs": [{"name": "X", "shape": [1, 4], "datatype": "FP32", "data": row(marker)}]}
    return httpx.post(f"{server.url}/v2/models/{model}/infer", json=body, timeout=30.0)


def infer_grpc(server: InProcessServer, model: str, marker: float):
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        x = grpcclient.InferInput("X", [1, 4], "FP32")
        x.set_data_from_numpy(np.array([row(marker)], np.float32))
        return client.infer(model, [x])


def refused(server: InProcessServer, model: str, marker: float, protocol: str) -> str:
    """The 500 / INTERNAL message of a request the output checks refuse."""
    if protocol == "http":
        response = infer_http(server, model, marker)
        assert response.status_code == 500, response.text
        return str(response.json()["error"])
    with pytest.raises(InferenceServerException) as err:
        infer_grpc(server, model, marker)
    assert err.value.status() == "StatusCode.INTERNAL", err.value
    return str(err.value.message())


def alive(server: InProcessServer, model: str) -> None:
    response = infer_http(server, model, 0)
    assert response.status_code == 200, response.text
    outputs = {o["name"]: o for o in response.json()["outputs"]}
    assert outputs["Y"]["data"] == [0.0, 2.0, 4.0, 6.0] and outputs["Y"]["shape"] == [1, 4]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("api", APIS)
def test_a_wrong_shape_is_a_500_naming_model_output_and_both_shapes(server, api, protocol):
    message = refused(server, api, 1, protocol)
    assert f"model '{api}'" in message and "output 'Y'" in message
    assert "[1, 3]" in message and "[-1, 4]" in message
    alive(server, api)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("api", APIS)
def test_a_wrong_datatype_is_converted_exactly_or_refused(server, api, protocol):
    message = refused(server, api, 2, protocol)
    assert "output 'Y'" in message and "float64" in message and "float32" in message
    if protocol == "http":
        response = infer_http(server, api, 3)  # float64 that float32 holds exactly
        assert response.status_code == 200, response.text
        (y,) = [o for o in response.json()["outputs"] if o["name"] == "Y"]
        assert y["datatype"] == "FP32" and y["data"] == [6.0, 2.0, 4.0, 6.0]
    else:
        result = infer_grpc(server, api, 3)
        y = result.as_numpy("Y")
        assert y.dtype == np.float32 and y.tolist() == [[6.0, 2.0, 4.0, 6.0]]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("api", APIS)
def test_a_missing_output_is_an_error_naming_it(server, api, protocol):
    message = refused(server, api, 4, protocol)
    assert "'Z'" in message
    alive(server, api)


@pytest.mark.parametrize("api", APIS)
def test_in_one_batch_a_bad_request_fails_alone_and_the_others_get_their_own_data(server, api):
    # a good one, a wrong shape, a raise, a failed row, a good one. A batched gpuserve model
    # answers one tensor for the whole batch: a wrong shape there is wrong for every row it
    # shares a batch with, so that model's batch holds no wrong shape (the other tests cover it)
    markers = [0, 1, 5, 6, 0] if api == "triton" else [0, 5, 6, 0]
    before = failures(server, api)
    with concurrent.futures.ThreadPoolExecutor(len(markers)) as pool:
        answers = list(pool.map(lambda m: infer_http(server, api, m), markers))
    statuses = [a.status_code for a in answers]
    expected = {0: 200, 1: 500, 5: 500, 6: 500}
    assert statuses == [expected[m] for m in markers], [a.text for a in answers]
    by_marker = dict(zip(markers, answers, strict=False))
    assert "marker 5 raises" in by_marker[5].json()["error"]
    assert "marker 6 fails" in by_marker[6].json()["error"]
    if 1 in by_marker:
        assert "output 'Y' of shape [1, 3]" in by_marker[1].json()["error"]
    for good in (answers[0], answers[-1]):
        (y,) = [o for o in good.json()["outputs"] if o["name"] == "Y"]
        assert y["data"] == [0.0, 2.0, 4.0, 6.0]
    # every failed request is counted, whatever batch it ran in
    assert failures(server, api) - before == sum(m != 0 for m in markers)


def failures(server, api: str) -> int:
    """The model's failed-request count from its statistics."""
    stats = httpx.get(f"{server.url}/v2/models/{api}/stats", timeout=10.0).json()
    return stats["model_stats"][0]["inference_stats"]["fail"]["count"]
