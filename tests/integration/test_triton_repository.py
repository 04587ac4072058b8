"""A Triton-format model repository served unchanged: ``config.pbtxt`` files, Python models
written against ``triton_python_backend_utils``, an ONNX model via ``onnxruntime_onnx`` and a
TorchScript model via ``pytorch_libtorch``, driven by Triton's own clients over HTTP and gRPC.

Also Triton's ModelConfig over HTTP (the same content as gRPC's), a load override in Triton's
JSON schema, and Triton's wording for unknown models and failed loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import json_format

from tests.fixtures.backend_models import make_module, reference, write_model_file
from tests.helpers import InProcessServer

pytest.importorskip("onnxruntime")
httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

LINEAR_IO = """
input [ {{ name: "{i}" data_type: TYPE_FP32 dims: [ 8 ] }} ]
output [ {{ name: "{o}" data_type: TYPE_FP32 dims: [ 4 ] }} ]
"""

ONNX_CONFIG = (
    'name: "linear_onnx"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
    + LINEAR_IO.format(i="INPUT0", o="OUTPUT0")
    + "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
    + "dynamic_batching { max_queue_delay_microseconds: 1000 }\n"
)
TORCHSCRIPT_CONFIG = (
    'platform: "pytorch_libtorch"\nmax_batch_size: 8\n'
    + LINEAR_IO.format(i="INPUT__0", o="OUTPUT__0")
    + 'default_model_filename: "model.pt"\n'
)

# Triton's add_sub example (python_backend/examples/add_sub), unchanged in substance.
ADD_SUB_CONFIG = """
name: "add_sub"
backend: "python"
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
instance_group [{ kind: KIND_CPU }]
"""
ADD_SUB_MODEL = """
import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = model_config = json.loads(args["model_config"])
        output0_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT0")
        output1_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT1")
        self.output0_dtype = pb_utils.triton_string_to_numpy(output0_config["data_type"])
        self.output1_dtype = pb_utils.triton_string_to_numpy(output1_config["data_type"])

    def execute(self, requests):
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            out_0, out_1 = (
                in_0.as_numpy() + in_1.as_numpy(),
                in_0.as_numpy() - in_1.as_numpy(),
            )
            out_tensor_0 = pb_utils.Tensor("OUTPUT0", out_0.astype(self.output0_dtype))
            out_tensor_1 = pb_utils.Tensor("OUTPUT1", out_1.astype(self.output1_dtype))
            responses.append(
                pb_utils.InferenceResponse(output_tensors=[out_tensor_0, out_tensor_1])
            )
        return responses

    def finalize(self):
        print("Cleaning up...")
"""

# A batching string model whose responses can fail one request at a time.
ECHO_CONFIG = """
backend: "python"
max_batch_size: 4
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "UPPER" data_type: TYPE_STRING dims: [ 1 ] } ]
dynamic_batching { }
"""
ECHO_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            if text[0, 0] == b"fail":
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("refusing 'fail'")))
                continue
            upper = np.array([[t.upper() for t in row] for row in text], dtype=object)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("UPPER", upper)]))
        return responses
"""

SEQUENCE_CONFIG = ADD_SUB_CONFIG.replace('name: "add_sub"', "") + (
    "sequence_batching { iterative_sequence: true }\n"
)


def _folder(root: Path, name: str, config: str) -> Path:
    version = root / name / "1"
    version.mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(config)
    return version


@pytest.fixture(scope="module")
def module():
    return make_module(seed=3)


@pytest.fixture(scope="module")
def server(tmp_path_factory, module):
    root = tmp_path_factory.mktemp("triton_repository")
    write_model_file(module, "onnx", _folder(root, "linear_onnx", ONNX_CONFIG))
    write_model_file(module, "torchscript", _folder(root, "linear_torchscript", TORCHSCRIPT_CONFIG))
    (_folder(root, "add_sub", ADD_SUB_CONFIG) / "model.py").write_text(ADD_SUB_MODEL)
    (_folder(root, "echo_upper", ECHO_CONFIG) / "model.py").write_text(ECHO_MODEL)
    (_folder(root, "sequence", SEQUENCE_CONFIG) / "model.py").write_text(ADD_SUB_MODEL)
    running = InProcessServer(
        root, model_control_mode="explicit", load_model=["*"], metrics_port=-1
    )
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


def _infer_linear(client, lib, model, rows, names=("INPUT0", "OUTPUT0")):
    tensor = lib.InferInput(names[0], list(rows.shape), "FP32")
    tensor.set_data_from_numpy(rows)
    result = client.infer(model, [tensor], outputs=[lib.InferRequestedOutput(names[1])])
    return result.as_numpy(names[1])


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_onnx_and_torchscript_models_from_config_pbtxt(request, module, kind):
    client = request.getfixturevalue(kind)
    lib = httpclient if kind == "http" else grpcclient
    rows = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    expected = reference(module, rows)
    got = _infer_linear(client, lib, "linear_onnx", rows)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    got = _infer_linear(client, lib, "linear_torchscript", rows, ("INPUT__0", "OUTPUT__0"))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_tritons_add_sub_python_model_runs_unchanged(request, kind):
    client = request.getfixturevalue(kind)
    lib = httpclient if kind == "http" else grpcclient
    a = np.array([1, 2, 3, 4], dtype=np.float32)
    b = np.array([4, 3, 2, 1], dtype=np.float32)
    inputs = [lib.InferInput("INPUT0", [4], "FP32"), lib.InferInput("INPUT1", [4], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    result = client.infer("add_sub", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def _echo(client, lib, text: bytes):
    tensor = lib.InferInput("TEXT", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[text]], dtype=object))
    return client.infer("echo_upper", [tensor]).as_numpy("UPPER")


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_a_response_error_fails_only_its_request(request, kind):
    client = request.getfixturevalue(kind)
    lib = httpclient if kind == "http" else grpcclient
    assert _echo(client, lib, b"abc").tolist() == [[b"ABC"]]
    with pytest.raises(InferenceServerException, match="refusing 'fail'"):
        _echo(client, lib, b"fail")
    assert _echo(client, lib, b"xyz").tolist() == [[b"XYZ"]]


def test_http_config_is_tritons_model_config_with_grpcs_content(http, grpc):
    config = http.get_model_config("linear_onnx")
    assert config["name"] == "linear_onnx" and config["max_batch_size"] == 8
    assert config["input"] == [
        {
            "name": "INPUT0",
            "data_type": "TYPE_FP32",
            "format": "FORMAT_NONE",
            "dims": [8],
            "optional": False,
        }
    ]
    assert config["output"] == [
        {"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4], "label_filename": ""}
    ]
    assert config["instance_group"][0]["kind"] == "KIND_CPU"
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 1000
    # The same message: HTTP's JSON parsed into Triton's ModelConfig equals gRPC's.
    over_grpc = grpc.get_model_config("linear_onnx").config
    assert json_format.ParseDict(config, type(over_grpc)()) == over_grpc
    python = http.get_model_config("add_sub")
    assert (python["backend"], python["max_batch_size"]) == ("python", 0)


def test_gpuserves_own_config_view_stays_available(server):
    import httpx

    for path in ("/config/gpuserve", "/config?format=gpuserve"):
        own = httpx.get(f"{server.url}/v2/models/linear_onnx{path}").json()
        assert own["backend"] == "onnx" and own["inputs"][0]["datatype"] == "FP32"
        assert own["dynamic_batching"]["max_queue_delay_us"] == 1000


def test_model_ready_names_the_model_and_unknown_models_use_tritons_words(server, http, grpc):
    import httpx

    body = httpx.get(f"{server.url}/v2/models/add_sub/ready").json()
    assert body == {"name": "add_sub", "ready": True}
    assert http.is_model_ready("add_sub") and grpc.is_model_ready("add_sub")
    for client in (http, grpc):
        with pytest.raises(InferenceServerException) as err:
            client.get_model_metadata("nope")
        assert "Request for unknown model: 'nope' is not found" in err.value.message()


def test_unsupported_fields_fail_the_load_naming_the_field(server, http, grpc):
    index = {row["name"]: row for row in http.get_model_repository_index()}
    assert index["sequence"]["state"] == "UNAVAILABLE"
    reason = index["sequence"]["reason"]
    assert "field 'sequence_batching.iterative_sequence': not supported by gpuserve" in reason
    assert not http.is_model_ready("sequence")
    for client in (http, grpc):
        with pytest.raises(InferenceServerException) as err:
            client.load_model("sequence")
        message = err.value.message()
        assert "failed to load 'sequence'" in message and "sequence_batching" in message


def test_a_load_override_in_tritons_json_schema(http):
    config = {
        "name": "add_sub",
        "backend": "python",
        "max_batch_size": 2,
        "input": [
            {"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]},
            {"name": "INPUT1", "data_type": "TYPE_FP32", "dims": [4]},
        ],
        "output": [
            {"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]},
            {"name": "OUTPUT1", "data_type": "TYPE_FP32", "dims": [4]},
        ],
    }
    try:
        http.load_model("add_sub", config=json.dumps(config))
        assert http.get_model_config("add_sub")["max_batch_size"] == 2
        inputs = [httpclient.InferInput(n, [2, 4], "FP32") for n in ("INPUT0", "INPUT1")]
        rows = np.arange(8, dtype=np.float32).reshape(2, 4)
        for tensor in inputs:
            tensor.set_data_from_numpy(rows)
        result = http.infer("add_sub", inputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), rows * 2)
        bad = dict(config, sequence_batching={"iterativeSequence": True})
        with pytest.raises(InferenceServerException) as err:
            http.load_model("add_sub", config=json.dumps(bad))
        assert "failed to load 'add_sub'" in err.value.message()
        assert "field 'sequence_batching.iterative_sequence'" in err.value.message()
        with pytest.raises(InferenceServerException) as err:  # not JSON at all
            http.load_model("add_sub", config="{not json")
        assert err.value.message().startswith("failed to load 'add_sub': parameter 'config'")
    finally:
        http.load_model("add_sub")  # back to its config.pbtxt
    assert http.get_model_config("add_sub")["max_batch_size"] == 0


def test_model_config_shows_sequence_batching_ensembles_and_decoupled(tmp_path):
    """The ModelConfig view (HTTP JSON and gRPC) carries Triton's scheduling choice and
    transaction policy, which Triton's tools read to drive sequence, ensemble and decoupled
    models."""
    import shutil

    from tests.helpers import InProcessServer

    examples = Path(__file__).parents[2] / "examples"
    root = tmp_path / "models"
    shutil.copytree(
        examples / "sequence" / "model_repository" / "simple_sequence", root / "simple_sequence"
    )
    shutil.copytree(
        Path(__file__).parents[1] / "fixtures" / "decoupled" / "repeat_int32", root / "repeat_int32"
    )
    server = InProcessServer(root)
    try:
        http = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        sequence = http.get_model_config("simple_sequence")
        assert "sequence_batching" in sequence and "dynamic_batching" not in sequence
        kinds = {c["control"][0]["kind"] for c in sequence["sequence_batching"]["control_input"]}
        assert {"CONTROL_SEQUENCE_START", "CONTROL_SEQUENCE_READY"} <= kinds
        over_grpc = grpc.get_model_config("simple_sequence").config
        assert over_grpc.WhichOneof("scheduling_choice") == "sequence_batching"
        repeat = http.get_model_config("repeat_int32")
        assert repeat["model_transaction_policy"] == {"decoupled": True}
        assert grpc.get_model_config("repeat_int32").config.model_transaction_policy.decoupled
    finally:
        server.stop()
