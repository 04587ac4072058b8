"""Triton's ``reshape`` and ``model_warmup`` in a ``config.pbtxt`` repository, served and driven
by Triton's own clients over HTTP and gRPC.

* A Python model (``triton_python_backend_utils``) asserts the shapes it receives: each input
  in its ``reshape`` with the batch dimension first; its outputs, made in their ``reshape``,
  reach the client in ``dims``.
* An ONNX model whose graph has the reshaped shapes (``[batch, 3, 4] -> [batch, 3, 2]``)
  declared with ``dims: [12]`` / ``[6]`` loads (the signature check compares the reshape) and
  answers clients in dims; the same model declared without the reshape fails to load naming
  both shapes; a reshape of another element count fails naming the file, field and value.
* ``GET /v2/models/{m}/config`` and gRPC ``ModelConfig`` show ``reshape`` and the
  ``model_warmup`` samples as Triton does.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
from google.protobuf import json_format  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from tests.helpers import InProcessServer  # noqa: E402

PY_CONFIG = """
backend: "python"
max_batch_size: 8
input [
  { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] reshape: { shape: [ 2, 2 ] } },
  { name: "S" data_type: TYPE_INT32 dims: [ 1 ] reshape: { shape: [ ] } },
  { name: "SEQ" data_type: TYPE_FP32 dims: [ -1, 6 ] reshape: { shape: [ -1, 2, 3 ] } }
]
output [
  { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] reshape: { shape: [ 2, 2 ] } },
  { name: "TOTAL" data_type: TYPE_FP32 dims: [ 1 ] reshape: { shape: [ ] } },
  { name: "SEQ_T" data_type: TYPE_FP32 dims: [ -1, 6 ] reshape: { shape: [ -1, 3, 2 ] } }
]
dynamic_batching { max_queue_delay_microseconds: 20000 }
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
# Asserts the shapes Triton's reshape promises; answers in the outputs' reshapes.
PY_MODEL = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        reshape = pb_utils.get_input_config_by_name(config, "IN")["reshape"]
        assert reshape == {"shape": [2, 2]}, reshape
        self.batches = []

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            s = pb_utils.get_input_tensor_by_name(request, "S").as_numpy()
            seq = pb_utils.get_input_tensor_by_name(request, "SEQ").as_numpy()
            rows = x.shape[0]
            if x.shape[1:] != (2, 2) or s.shape != (rows,) or seq.shape[2:] != (2, 3):
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"got shapes {x.shape} {s.shape} {seq.shape}")))
                continue
            total = x.sum(axis=(1, 2)) + s.astype(np.float32)
            seq_t = np.swapaxes(seq, 2, 3)  # [rows, L, 3, 2]
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", (x * 2).astype(np.float32)),
                pb_utils.Tensor("TOTAL", total.astype(np.float32)),
                pb_utils.Tensor("SEQ_T", np.ascontiguousarray(seq_t)),
            ]))
        return responses
"""

ONNX_CONFIG = """
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 12 ] reshape: { shape: [ 3, 4 ] } } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 6 ] reshape: { shape: [ 3, 2 ] } } ]
dynamic_batching { }
instance_group [ { kind: KIND_CPU } ]
"""
WEIGHTS = np.arange(8, dtype=np.float32).reshape(4, 2) / 10

WARM_CONFIG = """
backend: "python"
max_batch_size: 4
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] },
        { name: "IDS" data_type: TYPE_INT32 dims: [ 2 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
model_warmup [
  {
    name: "zeros"
    batch_size: 2
    inputs { key: "IN" value: { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } }
    inputs { key: "IDS" value: { data_type: TYPE_INT32 dims: [ 2 ] random_data: true } }
  },
  {
    name: "from_file"
    batch_size: 1
    count: 3
    inputs { key: "IN" value: { data_type: TYPE_FP32 dims: [ 4 ] input_data_file: "in.bin" } }
    inputs { key: "IDS" value: { data_type: TYPE_INT32 dims: [ 2 ] zero_data: true } }
  }
]
"""
WARM_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]) for r in requests]
"""


def _onnx_model(path: Path) -> None:
    """``[batch, 3, 4] @ W[4, 2] -> [batch, 3, 2]``: a graph in the reshaped shapes."""
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["INPUT0", "W"], ["OUTPUT0"])],
        "reshaped",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", 3, 4])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", 3, 2])],
        [numpy_helper.from_array(WEIGHTS, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def _folder(root: Path, name: str, config: str) -> Path:
    version = root / name / "1"
    version.mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(config)
    return version


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton_reshape")
    (_folder(root, "reshape_py", PY_CONFIG) / "model.py").write_text(PY_MODEL)
    _onnx_model(_folder(root, "reshape_onnx", ONNX_CONFIG) / "model.onnx")
    no_reshape = ONNX_CONFIG.replace(" reshape: { shape: [ 3, 4 ] }", "")
    _onnx_model(_folder(root, "onnx_no_reshape", no_reshape) / "model.onnx")
    bad_count = ONNX_CONFIG.replace("shape: [ 3, 4 ]", "shape: [ 3, 5 ]")
    _onnx_model(_folder(root, "bad_reshape", bad_count) / "model.onnx")
    (_folder(root, "warm_py", WARM_CONFIG) / "model.py").write_text(WARM_MODEL)
    (root / "warm_py" / "warmup").mkdir()
    (root / "warm_py" / "warmup" / "in.bin").write_bytes(np.ones(4, "<f4").tobytes())
    running = InProcessServer(root, model_control_mode="explicit", load_model=["*"])
    yield running
    running.stop()


@pytest.fixture()
def http(server):
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    yield client
    client.close()


@pytest.fixture()
def grpc(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    yield client
    client.close()


def _lib(kind: str):
    return httpclient if kind == "http" else grpcclient


def _py_infer(server, kind: str, rows: int, length: int, seed: int):
    lib = _lib(kind)
    url = server.url.removeprefix("http://") if kind == "http" else server.grpc_url
    client = lib.InferenceServerClient(url)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 4)).astype(np.float32)
    s = rng.integers(0, 10, (rows, 1)).astype(np.int32)
    seq = rng.standard_normal((rows, length, 6)).astype(np.float32)
    inputs = []
    for name, array, datatype in (("IN", x, "FP32"), ("S", s, "INT32"), ("SEQ", seq, "FP32")):
        tensor = lib.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    try:
        result = client.infer("reshape_py", inputs)
        return (x, s, seq), {n: result.as_numpy(n) for n in ("OUT", "TOTAL", "SEQ_T")}
    finally:
        client.close()


def _check_py(sent, got) -> None:
    x, s, seq = sent
    rows, length = seq.shape[:2]
    assert got["OUT"].shape == (rows, 4)  # dims, not the reshape
    np.testing.assert_allclose(got["OUT"], x * 2)
    assert got["TOTAL"].shape == (rows, 1)
    np.testing.assert_allclose(got["TOTAL"][:, 0], x.sum(axis=1) + s[:, 0], rtol=1e-5)
    expected = np.swapaxes(seq.reshape(rows, length, 2, 3), 2, 3).reshape(rows, length, 6)
    assert got["SEQ_T"].shape == (rows, length, 6)
    np.testing.assert_allclose(got["SEQ_T"], expected)


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_python_model_receives_the_reshape_and_clients_get_dims(server, kind):
    sent, got = _py_infer(server, kind, rows=3, length=5, seed=1)
    _check_py(sent, got)


def test_concurrent_requests_batch_in_the_reshaped_shape(server):
    jobs = [("http" if i % 2 else "grpc", 1 + i % 3, 2 + i % 2, i) for i in range(12)]
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda job: _py_infer(server, *job), jobs))
    for sent, got in results:
        _check_py(sent, got)
    stats = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        model = stats.get_inference_statistics("reshape_py")["model_stats"][0]
    finally:
        stats.close()
    assert model["inference_count"] >= sum(rows for _, rows, _, _ in jobs)
    assert model["execution_count"] < model["inference_count"]  # some requests shared a batch


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_onnx_model_in_the_reshaped_shape_answers_in_dims(server, kind):
    lib = _lib(kind)
    url = server.url.removeprefix("http://") if kind == "http" else server.grpc_url
    client = lib.InferenceServerClient(url)
    rows = np.random.default_rng(2).standard_normal((4, 12)).astype(np.float32)
    tensor = lib.InferInput("INPUT0", [4, 12], "FP32")
    tensor.set_data_from_numpy(rows)
    try:
        got = client.infer("reshape_onnx", [tensor]).as_numpy("OUTPUT0")
        assert got.shape == (4, 6)
        expected = (rows.reshape(4, 3, 4) @ WEIGHTS).reshape(4, 6)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
        wrong = lib.InferInput("INPUT0", [1, 3, 4], "FP32")  # the model's shape: not the dims
        wrong.set_data_from_numpy(rows[:1].reshape(1, 3, 4))
        with pytest.raises(InferenceServerException, match="INPUT0"):
            client.infer("reshape_onnx", [wrong])
    finally:
        client.close()


def test_load_errors_name_the_shapes_the_file_and_the_field(http, grpc):
    index = {row["name"]: row for row in http.get_model_repository_index()}
    assert index["reshape_py"]["state"] == "READY" and index["reshape_onnx"]["state"] == "READY"
    mismatch = index["onnx_no_reshape"]["reason"]
    assert index["onnx_no_reshape"]["state"] == "UNAVAILABLE"
    assert "declares shape [12], but model.onnx has [3, 4]" in mismatch
    bad = index["bad_reshape"]["reason"]
    assert "bad_reshape/config.pbtxt: field 'input[0].reshape'" in bad
    assert "reshape [3, 5] holds 15 elements, but dims [12] hold 12" in bad
    assert "(given: [3, 5])" in bad
    for client in (http, grpc):
        with pytest.raises(InferenceServerException) as err:
            client.load_model("bad_reshape")
        assert "failed to load 'bad_reshape'" in err.value.message()
        assert "input[0].reshape" in err.value.message()


def test_model_config_shows_reshape_as_triton_does(http, grpc):
    config = http.get_model_config("reshape_py")
    assert [t.get("reshape") for t in config["input"]] == [
        {"shape": [2, 2]},
        {"shape": []},
        {"shape": [-1, 2, 3]},
    ]
    assert config["input"][0]["dims"] == [4]
    assert config["output"][2] == {
        "name": "SEQ_T",
        "data_type": "TYPE_FP32",
        "dims": [-1, 6],
        "reshape": {"shape": [-1, 3, 2]},
        "label_filename": "",
    }
    over_grpc = grpc.get_model_config("reshape_py").config
    assert list(over_grpc.input[0].reshape.shape) == [2, 2]
    assert over_grpc.input[1].HasField("reshape") and not over_grpc.input[1].reshape.shape
    assert json_format.ParseDict(config, type(over_grpc)()) == over_grpc
    plain = http.get_model_config("warm_py")
    assert all("reshape" not in t for t in plain["input"] + plain["output"])


def test_model_config_shows_the_warmup_samples(http, grpc):
    config = http.get_model_config("warm_py")
    assert config["model_warmup"] == [
        {
            "name": "zeros",
            "batch_size": 2,
            "inputs": {
                "IN": {"data_type": "TYPE_FP32", "dims": [4], "zero_data": True},
                "IDS": {"data_type": "TYPE_INT32", "dims": [2], "random_data": True},
            },
            "count": 0,
        },
        {
            "name": "from_file",
            "batch_size": 1,
            "inputs": {
                "IN": {"data_type": "TYPE_FP32", "dims": [4], "input_data_file": "in.bin"},
                "IDS": {"data_type": "TYPE_INT32", "dims": [2], "zero_data": True},
            },
            "count": 3,
        },
    ]
    over_grpc = grpc.get_model_config("warm_py").config
    assert [w.name for w in over_grpc.model_warmup] == ["zeros", "from_file"]
    sample = over_grpc.model_warmup[1]
    assert (sample.batch_size, sample.count) == (1, 3)
    assert sample.inputs["IN"].WhichOneof("input_data_type") == "input_data_file"
    assert sample.inputs["IN"].input_data_file == "in.bin"
    assert sample.inputs["IDS"].WhichOneof("input_data_type") == "zero_data"
    assert json_format.ParseDict(config, type(over_grpc)()) == over_grpc
    assert http.get_model_config("reshape_py").get("model_warmup", []) == []
