"""``model_warmup`` runs before a version turns READY, on every instance, through the real
execution path, as Triton runs it: a Triton-format repository (``config.pbtxt``, Python models
written against ``triton_python_backend_utils``) and the same in gpuserve's ``config.yaml``,
served by the real server and driven by Triton's own clients (HTTP and gRPC) and httpx.

The models record every ``execute``/``forward`` call in ``calls.jsonl`` in their model folder
(instance, requests, each input's shape and values), so a test sees exactly what the warmup ran.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.fixtures.backend_models import make_module, write_model_file
from tests.helpers import InProcessServer

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

RECORDER_MODEL = """
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


def _plain(array):
    if array.dtype == object:
        return [[v.decode() for v in row] for row in array.reshape(array.shape[0], -1)]
    return array.tolist()


class TritonPythonModel:
    def initialize(self, args):
        self.log = os.path.join(args["model_repository"], "calls.jsonl")
        self.instance = args["model_instance_name"]
        self.calls = 0

    def execute(self, requests):
        entry = {"instance": self.instance, "requests": []}
        for request in requests:
            inputs = {}
            for name in ("INPUT0", "TEXT"):
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    array = tensor.as_numpy()
                    inputs[name] = {"shape": list(array.shape), "values": _plain(array)}
            entry["requests"].append(inputs)
        with open(self.log, "a") as log:
            log.write(json.dumps(entry) + "\\n")
        self.calls += 1
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            if FAIL_ON_ZEROS and not x.any():
                raise ValueError("refusing an all-zero INPUT0")
            calls = np.full((x.shape[0], 1), self.calls, dtype=np.int64) if BATCHED else (
                np.array([self.calls], dtype=np.int64))
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", (x * 2).astype(np.float32)),
                pb_utils.Tensor("CALLS", calls),
            ]))
        return responses
"""

BATCHED_IO = """
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
        { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] optional: true } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
         { name: "CALLS" data_type: TYPE_INT64 dims: [ 1 ] } ]
"""

RECORDER_CONFIG = (
    'name: "recorder"\nbackend: "python"\n'
    + BATCHED_IO
    + """
instance_group [ { count: 2 kind: KIND_CPU } ]
dynamic_batching { }
model_warmup [
  {
    name: "zeros"
    batch_size: 3
    count: 2
    inputs { key: "INPUT0" value { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } }
  },
  {
    name: "from_file"
    batch_size: 2
    inputs { key: "INPUT0" value { data_type: TYPE_FP32 dims: [ 4 ] input_data_file: "in0.bin" } }
    inputs { key: "TEXT" value { data_type: TYPE_STRING dims: [ 1 ] input_data_file: "text.bin" } }
  },
  { name: "skipped"
    inputs { key: "INPUT0" value { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } } }
]
"""
)

UNBATCHED_CONFIG = """
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2, 3 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2, 3 ] },
         { name: "CALLS" data_type: TYPE_INT64 dims: [ 1 ] } ]
model_warmup { name: "random" batch_size: 1
  inputs { key: "INPUT0" value { data_type: TYPE_FP32 dims: [ 2, 3 ] random_data: true } } }
"""

FAILS_CONFIG = (
    'backend: "python"\n'
    + BATCHED_IO
    + """
model_warmup { name: "ones" batch_size: 1
  inputs { key: "INPUT0" value { data_type: TYPE_FP32 dims: [ 4 ] input_data_file: "ones.bin" } } }
model_warmup { name: "zeros" batch_size: 2
  inputs { key: "INPUT0" value { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } } }
"""
)

MISSING_FILE_CONFIG = (
    'backend: "python"\n'
    + BATCHED_IO
    + """
model_warmup { name: "lost" batch_size: 1
  inputs { key: "INPUT0" value { data_type: TYPE_FP32 dims: [ 4 ] input_data_file: "gone.bin" } } }
"""
)

# gpuserve's own config.yaml and Model class, with the same field names.
YAML_CONFIG = """
backend: python
max_batch_size: 4
inputs: [{name: IDS, datatype: INT64, shape: [3]}]
outputs: [{name: SUM, datatype: INT64, shape: [1]}]
model_warmup:
  - name: ids_from_file
    batch_size: 4
    count: 3
    inputs:
      IDS: {data_type: INT64, dims: [3], input_data_file: ids.bin}
"""
YAML_MODEL = """
import json
from pathlib import Path

import numpy as np

from gpuserve.backends.python import PythonModel


class Model(PythonModel):
    def load(self, context):
        self.log = Path(context.version_path).parent / "calls.jsonl"

    def forward(self, inputs):
        ids = inputs["IDS"]
        with self.log.open("a") as log:
            log.write(json.dumps({"shape": list(ids.shape), "values": ids.tolist()}) + "\\n")
        return {"SUM": ids.sum(axis=1, keepdims=True)}
"""


# A decoupled model (Triton's response sender): one response per element of IN, then the final
# mark; all-zero IN gets an error response instead.
STREAMER_MODEL = """
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.log = os.path.join(args["model_repository"], "calls.jsonl")

    def execute(self, requests):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            with open(self.log, "a") as log:
                log.write(json.dumps({"IN": values.tolist()}) + "\\n")
            sender = request.get_response_sender()
            if not values.any():
                error = pb_utils.TritonError("no zeros, please")
                sender.send(pb_utils.InferenceResponse(error=error), flags=final)
                continue
            for value in values:
                out = pb_utils.Tensor("OUT", np.array([value], dtype=np.int32))
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
            sender.send(flags=final)
        return None
"""
STREAMER_CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
model_warmup { name: "stream" count: 2 batch_size: 1
  inputs { key: "IN" value { data_type: TYPE_INT32 dims: [ 3 ] SOURCE } } }
"""

# An ONNX model whose inputs come from model.onnx (not declared): its samples are checked
# against them at load.
ONNX_CONFIG = """
platform: "onnxruntime_onnx"
max_batch_size: 8
instance_group [ { count: 1 kind: KIND_CPU } ]
model_warmup { name: "random" batch_size: 4 count: 2
  inputs { key: "INPUT0" value { data_type: TYPE_FP32 dims: [ DIM ] random_data: true } } }
"""

TORCHSCRIPT_CONFIG = """
platform: "pytorch_libtorch"
max_batch_size: 8
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 8 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
model_warmup { name: "random" batch_size: 8
  inputs { key: "INPUT__0" value { data_type: TYPE_FP32 dims: [ 8 ] random_data: true } } }
"""


def _model(root: Path, name: str, config: str, code: str, config_name="config.pbtxt") -> Path:
    folder = root / name
    (folder / "1").mkdir(parents=True)
    (folder / config_name).write_text(config)
    (folder / "1" / "model.py").write_text(code)
    return folder


def _recorder_code(batched=True, fail_on_zeros=False) -> str:
    flags = f"BATCHED = {batched}\nFAIL_ON_ZEROS = {fail_on_zeros}\n"
    return flags + RECORDER_MODEL


def _calls(folder: Path) -> list[dict]:
    path = folder / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


IN0 = [1.5, -2.0, 3.25, 4.0]


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("warmup_repository")
    recorder = _model(root, "recorder", RECORDER_CONFIG, _recorder_code())
    (recorder / "warmup").mkdir()
    (recorder / "warmup" / "in0.bin").write_bytes(np.array(IN0, dtype="<f4").tobytes())
    (recorder / "warmup" / "text.bin").write_bytes(struct.pack("<I", 5) + b"hello")
    _model(root, "unbatched", UNBATCHED_CONFIG, _recorder_code(batched=False))
    fails = _model(root, "fails_on_zeros", FAILS_CONFIG, _recorder_code(fail_on_zeros=True))
    (fails / "warmup").mkdir()
    (fails / "warmup" / "ones.bin").write_bytes(np.ones(4, dtype="<f4").tobytes())
    _model(root, "missing_file", MISSING_FILE_CONFIG, _recorder_code())
    yaml_model = _model(root, "yaml_ids", YAML_CONFIG, YAML_MODEL, config_name="config.yaml")
    (yaml_model / "warmup").mkdir()
    ids = np.array([7, 8, 9], dtype="<i8")
    (yaml_model / "warmup" / "ids.bin").write_bytes(ids.tobytes())
    streamer = _model(
        root,
        "streamer",
        STREAMER_CONFIG.replace("SOURCE", 'input_data_file: "in.bin"'),
        STREAMER_MODEL,
    )
    (streamer / "warmup").mkdir()
    (streamer / "warmup" / "in.bin").write_bytes(np.array([5, 6, 7], dtype="<i4").tobytes())
    config = STREAMER_CONFIG.replace("SOURCE", "zero_data: true")
    _model(root, "streamer_fails", config, STREAMER_MODEL)
    module = make_module(seed=5)
    (root / "torchscript_warm" / "1").mkdir(parents=True)
    (root / "torchscript_warm" / "config.pbtxt").write_text(TORCHSCRIPT_CONFIG)
    write_model_file(module, "torchscript", root / "torchscript_warm" / "1")
    if onnx_available():
        for name, dim in (("onnx_warm", 8), ("onnx_bad_dims", 9)):
            folder = root / name
            (folder / "1").mkdir(parents=True)
            (folder / "config.pbtxt").write_text(ONNX_CONFIG.replace("DIM", str(dim)))
            write_model_file(module, "onnx", folder / "1")
    return root


def onnx_available() -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def server(repo):
    running = InProcessServer(repo, model_control_mode="explicit", load_model=["*"])
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


def _index(http) -> dict[str, dict]:
    return {row["name"]: row for row in http.get_model_repository_index()}


def test_each_instance_ran_exactly_the_warmup_batches_before_ready(server, repo, http):
    assert http.is_model_ready("recorder")
    calls = _calls(repo / "recorder")
    zeros = {"INPUT0": {"shape": [1, 4], "values": [[0.0] * 4]}}
    from_file = {
        "INPUT0": {"shape": [1, 4], "values": [IN0]},
        "TEXT": {"shape": [1, 1], "values": [["hello"]]},
    }
    expected = []
    for instance in ("recorder_0", "recorder_1"):  # in order, each instance in turn
        expected += [{"instance": instance, "requests": [zeros] * 3}] * 2  # count: 2
        expected += [{"instance": instance, "requests": [from_file] * 2}]  # count 0: once
    # batch_size 0 ("skipped") is not run, as in Triton; later lines are other tests' infers
    assert calls[: len(expected)] == expected


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_a_normal_inference_follows_the_warmup(request, repo, kind):
    client = request.getfixturevalue(kind)
    lib = httpclient if kind == "http" else grpcclient
    before = len(_calls(repo / "recorder"))
    rows = np.arange(8, dtype=np.float32).reshape(2, 4)
    tensor = lib.InferInput("INPUT0", [2, 4], "FP32")
    tensor.set_data_from_numpy(rows)
    result = client.infer("recorder", [tensor])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), rows * 2)
    # Each instance ran 3 warmup batches: this is its 4th execute call or later.
    assert (result.as_numpy("CALLS") >= 4).all()
    calls = _calls(repo / "recorder")
    assert len(calls) == before + 1
    assert calls[-1]["requests"][0]["INPUT0"]["values"] == [rows[0].tolist()]


def test_without_batching_the_sample_is_the_full_shape_of_random_values(repo, http):
    call = _calls(repo / "unbatched")[0]
    (request,) = call["requests"]
    assert request["INPUT0"]["shape"] == [2, 3]
    values = np.array(request["INPUT0"]["values"])
    assert ((values >= 0) & (values < 1)).all() and len(np.unique(values)) > 1
    tensor = httpclient.InferInput("INPUT0", [2, 3], "FP32")
    tensor.set_data_from_numpy(np.ones((2, 3), dtype=np.float32))
    assert http.infer("unbatched", [tensor]).as_numpy("CALLS").tolist() == [2]


def test_a_failing_sample_fails_the_load_naming_it_and_others_keep_serving(
    server, repo, http, grpc
):
    # The first sample (ones from a file) ran; the second raised: the version never served.
    calls = _calls(repo / "fails_on_zeros")
    assert [len(c["requests"]) for c in calls[:2]] == [1, 2]
    row = _index(http)["fails_on_zeros"]
    assert row["state"] == "UNAVAILABLE"
    reason = row["reason"]
    assert (
        "model 'fails_on_zeros' failed to run warmup sample model_warmup[1] ('zeros'): "
        "ValueError: refusing an all-zero INPUT0"
    ) in reason
    assert not http.is_model_ready("fails_on_zeros")
    for client in (http, grpc):
        with pytest.raises(InferenceServerException) as err:
            client.load_model("fails_on_zeros")
        message = err.value.message()
        assert message.startswith("failed to load 'fails_on_zeros'")
        assert "warmup sample model_warmup[1] ('zeros')" in message
        assert "refusing an all-zero INPUT0" in message
    # The server and its other models are untouched.
    assert http.is_server_live() and http.is_model_ready("recorder")
    tensor = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
    np.testing.assert_array_equal(http.infer("recorder", [tensor]).as_numpy("OUTPUT0"), [[2] * 4])


def test_a_missing_data_file_fails_the_load_naming_file_and_field(repo, http):
    reason = _index(http)["missing_file"]["reason"]
    # The answer names the file relative to the repository (no server paths leak).
    missing = "missing_file/warmup/gone.bin"
    assert f"{missing}: field 'model_warmup[0] ('lost').inputs.INPUT0.input_data_file'" in reason
    assert "cannot read the warmup data file" in reason
    assert _calls(repo / "missing_file") == []  # nothing was loaded, nothing ran
    with pytest.raises(InferenceServerException, match=r"gone\.bin"):
        http.load_model("missing_file")


def test_config_yaml_samples_run_the_same_way(server, repo):
    calls = _calls(repo / "yaml_ids")
    assert calls[:3] == [{"shape": [4, 3], "values": [[7, 8, 9]] * 4}] * 3
    body = {"inputs": [{"name": "IDS", "datatype": "INT64", "shape": [1, 3], "data": [1, 2, 3]}]}
    answer = httpx.post(f"{server.url}/v2/models/yaml_ids/infer", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == [6]
    assert _calls(repo / "yaml_ids")[len(calls) :] == [{"shape": [1, 3], "values": [[1, 2, 3]]}]


def test_a_load_override_in_gpuserves_schema_runs_its_samples(repo, http):
    override = {
        "backend": "python",
        "max_batch_size": 4,
        "inputs": [{"name": "IDS", "datatype": "INT64", "shape": [3]}],
        "outputs": [{"name": "SUM", "datatype": "INT64", "shape": [1]}],
        "model_warmup": [
            {
                "name": "z",
                "batch_size": 2,
                "inputs": {"IDS": {"data_type": "INT64", "dims": [3], "zero_data": True}},
            }
        ],
    }
    before = len(_calls(repo / "yaml_ids"))
    try:
        http.load_model("yaml_ids", config=json.dumps(override))
        assert _calls(repo / "yaml_ids")[before:] == [{"shape": [2, 3], "values": [[0] * 3] * 2}]
    finally:
        http.load_model("yaml_ids")  # back to its config.yaml (its own samples run again)
    assert (
        _calls(repo / "yaml_ids")[before + 1 :]
        == [{"shape": [4, 3], "values": [[7, 8, 9]] * 4}] * 3
    )


def test_a_load_with_a_bad_sample_in_its_override_is_refused_by_field(server, http):
    config = {
        "backend": "python",
        "max_batch_size": 8,
        "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]}],
        "output": [
            {"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]},
            {"name": "CALLS", "data_type": "TYPE_INT64", "dims": [1]},
        ],
        "model_warmup": [
            {
                "name": "big",
                "batchSize": 9,
                "inputs": {"INPUT0": {"dataType": "TYPE_FP32", "dims": ["4"], "zeroData": True}},
            }
        ],
    }
    with pytest.raises(InferenceServerException) as err:
        http.load_model("recorder", config=json.dumps(config))
    message = err.value.message()
    assert message.startswith("failed to load 'recorder'")
    assert "field 'model_warmup': model_warmup[0] ('big'): batch_size 9 exceeds" in message
    assert http.is_model_ready("recorder")  # the serving version is untouched


def test_torchscript_and_onnx_models_run_their_samples_checked_against_the_model_file(http):
    # The TorchScript model ran its full batch of 8 random rows through the torch backend.
    assert _index(http)["torchscript_warm"]["state"] == "READY"
    if not onnx_available():
        pytest.skip("onnxruntime is not installed")
    assert http.is_model_ready("onnx_warm")
    tensor = httpclient.InferInput("INPUT0", [1, 8], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 8), dtype=np.float32))
    assert http.infer("onnx_warm", [tensor]).as_numpy("OUTPUT0").shape == (1, 4)
    row = _index(http)["onnx_bad_dims"]
    assert row["state"] == "UNAVAILABLE"
    assert "model_warmup[0] ('random'): inputs.INPUT0.dims: [9] do not fit" in row["reason"]
    assert "[8]" in row["reason"]


def test_a_decoupled_models_samples_stream_until_their_final_response(server, repo, http):
    assert http.is_model_ready("streamer")
    assert _calls(repo / "streamer")[:2] == [{"IN": [5, 6, 7]}] * 2
    body = {"inputs": [{"name": "IN", "datatype": "INT32", "shape": [1], "data": [9]}]}
    answer = httpx.post(f"{server.url}/v2/models/streamer/infer", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == [9]
    row = _index(http)["streamer_fails"]
    assert row["state"] == "UNAVAILABLE"
    assert (
        "model 'streamer_fails' failed to run warmup sample model_warmup[0] ('stream'): "
        "no zeros, please"
    ) in row["reason"]
    assert _calls(repo / "streamer_fails")[:1] == [{"IN": [0, 0, 0]}]
