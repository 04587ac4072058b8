"""Pure parts of Triton's shared-memory, classification, trace and log extensions: the codecs'
shared-memory parameters (a registry over a temporary folder), top-k formatting, label files,
trace sampling with an injected clock, and log levels."""

from __future__ import annotations

import itertools
import json
import logging

import numpy as np
import orjson
import pytest

from gpuserve.config import ModelConfig, TensorSpec
from gpuserve.engine.request import InferenceResponse, RequestTiming
from gpuserve.errors import InvalidInputError
from gpuserve.protocol import grpc_codec, http_codec
from gpuserve.protocol.protos import grpc_service_pb2 as pb
from gpuserve.service.apis.classification import LabelFiles, top_k
from gpuserve.service.tracing.runtime_settings import LogSettings, TraceSettings
from gpuserve.service.memory.shared_memory import CudaSharedMemoryRegistry, SharedMemoryRegistry

ADD = ModelConfig(
    inputs=[
        TensorSpec(name="A", datatype="INT32", shape=[4]),
        TensorSpec(name="B", datatype="INT32", shape=[4]),
    ],
    outputs=[TensorSpec(name="Y", datatype="INT32", shape=[4])],
    max_batch_size=2,
)


@pytest.fixture()
def registry(tmp_path):
    (tmp_path / "data").write_bytes(np.arange(16, dtype=np.int32).tobytes())
    (tmp_path / "out").write_bytes(bytes(64))
    made = SharedMemoryRegistry(tmp_path)
    made.register("data", "/data", 0, 64)
    made.register("out", "/out", 16, 48)
    yield made
    made.close()


def _http(document, registry):
    return http_codec.decode_infer_request(
        orjson.dumps(document), None, ADD, "add", None, shm=registry
    )


def test_http_inputs_are_zero_copy_views_of_the_region_and_outputs_are_written(registry):
    params = {"shared_memory_region": "data", "shared_memory_byte_size": 16}
    decoded = _http(
        {
            "inputs": [
                {"name": "A", "datatype": "INT32", "shape": [1, 4], "parameters": params},
                {
                    "name": "B",
                    "datatype": "INT32",
                    "shape": [1, 4],
                    "parameters": params | {"shared_memory_offset": 16},
                },
            ],
            "outputs": [
                {
                    "name": "Y",
                    "parameters": {"shared_memory_region": "out", "shared_memory_byte_size": 16},
                }
            ],
        },
        registry,
    )
    a, b = decoded.request.inputs["A"], decoded.request.inputs["B"]
    assert a.tolist() == [[0, 1, 2, 3]] and b.tolist() == [[4, 5, 6, 7]]
    assert not a.flags.owndata and not a.flags.writeable  # a read-only view of the mapping
    response = InferenceResponse("add", "1", None, {"Y": a + b})
    encoded = http_codec.encode_infer_response(response, decoded.output_options, ADD)
    entry = json.loads(encoded.body)["outputs"][0]
    assert entry == {"name": "Y", "datatype": "INT32", "shape": [1, 4]}  # as Triton: no data
    written = np.frombuffer(registry.view("out", 0, 16), dtype=np.int32)
    assert written.tolist() == [4, 6, 8, 10]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"shared_memory_region": "data"}, "needs 'shared_memory_byte_size'"),
        ({"shared_memory_region": 3, "shared_memory_byte_size": 16}, "name of a registered"),
        ({"shared_memory_region": "data", "shared_memory_byte_size": -1}, "non-negative"),
        (
            {"shared_memory_region": "data", "shared_memory_byte_size": 16, "binary_data_size": 4},
            "has 'shared_memory_region' and also binary_data_size",
        ),
        (
            {
                "shared_memory_region": "data",
                "shared_memory_byte_size": 16,
                "shared_memory_offset": 56,
            },
            r"'data': offset 56 \+ byte_size 16 is outside the region's registered byte_size 64",
        ),
        ({"shared_memory_region": "data", "shared_memory_byte_size": 12}, "does not match"),
    ],
)
def test_http_shared_memory_refusals(registry, params, message):
    document = {
        "inputs": [
            {"name": "A", "datatype": "INT32", "shape": [1, 4], "parameters": params},
            {"name": "B", "datatype": "INT32", "shape": [1, 4], "data": [0, 0, 0, 0]},
        ]
    }
    with pytest.raises(InvalidInputError, match=message):
        _http(document, registry)


def test_output_conflicts_and_a_region_too_small(registry):
    inline = [
        {"name": "A", "datatype": "INT32", "shape": [1, 4], "data": [1, 2, 3, 4]},
        {"name": "B", "datatype": "INT32", "shape": [1, 4], "data": [1, 2, 3, 4]},
    ]
    shm = {"shared_memory_region": "out", "shared_memory_byte_size": 8}
    for extra, message in [
        ({"classification": 2}, "'shared_memory_region' or 'classification', not both"),
        ({"binary_data": True}, "'shared_memory_region' or 'binary_data', not both"),
    ]:
        with pytest.raises(InvalidInputError, match=message):
            _http(
                {"inputs": inline, "outputs": [{"name": "Y", "parameters": shm | extra}]}, registry
            )
    decoded = _http({"inputs": inline, "outputs": [{"name": "Y", "parameters": shm}]}, registry)
    response = InferenceResponse("add", "1", None, {"Y": np.ones((1, 4), np.int32)})
    with pytest.raises(InvalidInputError, match=r"byte_size 8 of region 'out'.*needs 16 bytes"):
        http_codec.encode_infer_response(response, decoded.output_options, ADD)


def test_grpc_shared_memory_input_has_no_raw_entry_and_output_an_empty_one(registry):
    message = pb.ModelInferRequest(model_name="add")
    a = message.inputs.add(name="A", datatype="INT32", shape=[1, 4])
    a.parameters["shared_memory_region"].string_param = "data"
    a.parameters["shared_memory_byte_size"].int64_param = 16
    a.parameters["shared_memory_offset"].int64_param = 32
    message.inputs.add(name="B", datatype="INT32", shape=[1, 4])
    message.raw_input_contents.append(np.full(4, 100, np.int32).tobytes())
    out = message.outputs.add(name="Y")
    out.parameters["shared_memory_region"].string_param = "out"
    out.parameters["shared_memory_byte_size"].int64_param = 16
    wire = grpc_codec.GrpcInferMessage(message, shm=registry)
    request = wire.decode(ADD, "add", None)
    assert request.inputs["A"].tolist() == [[8, 9, 10, 11]]
    response = InferenceResponse("add", "1", None, {"Y": request.inputs["A"] + request.inputs["B"]})
    encoded = grpc_codec.encode_infer_response(response, ADD, wire.output_options)
    assert list(encoded.raw_output_contents) == [b""]
    assert encoded.outputs[0].datatype == "INT32" and not encoded.outputs[0].parameters
    assert np.frombuffer(registry.view("out", 0, 16), np.int32).tolist() == [108, 109, 110, 111]
    disabled = grpc_codec.GrpcInferMessage(message)  # the switch off
    with pytest.raises(InvalidInputError, match="Client shared memory is disabled. Start the"):
        disabled.decode(ADD, "add", None)


def test_unregister_keeps_a_live_view_valid(registry):
    view = registry.view("data", 0, 16)
    registry.unregister("data")
    assert np.frombuffer(view, np.int32).tolist() == [0, 1, 2, 3]
    with pytest.raises(InvalidInputError, match="Unable to find"):
        registry.view("data", 0, 16)


def test_cuda_registry_refuses_registration():
    cuda = CudaSharedMemoryRegistry(cuda_available=False)
    assert cuda.status() == []
    cuda.unregister("x")
    with pytest.raises(InvalidInputError, match="this server has no CUDA device"):
        cuda.register("g", b"h", 0, 64)
    with pytest.raises(InvalidInputError, match="does not open CUDA IPC handles"):
        CudaSharedMemoryRegistry(cuda_available=True).register("g", b"h", 0, 64)
    with pytest.raises(InvalidInputError, match="Unable to find cuda"):
        cuda.status("g")


# -- classification ---------------------------------------------------------------------------


def test_top_k_formats_like_triton():
    scores = np.array([[0.5, 2.0, 2.0, -1.0], [1, 2, 3, 4]], dtype=np.float32)
    got = top_k(scores, 3, ["a", "b"], batched=True)
    assert got.shape == (2, 3)
    assert got[0].tolist() == [b"2.000000:1:b", b"2.000000:2", b"0.500000:0:a"]
    assert got[1].tolist() == [b"4.000000:3", b"3.000000:2", b"2.000000:1:b"]
    ints = top_k(np.array([3, -7, 9], dtype=np.int8), 5, None, batched=False)
    assert ints.tolist() == [b"9:2", b"3:0", b"-7:1"]
    unsigned = top_k(np.array([[1, 200]], dtype=np.uint8), 1, None, batched=True)
    assert unsigned.tolist() == [[b"200:1"]]


def test_label_files_are_cached_until_they_change_and_stay_in_the_model_folder(tmp_path):
    files = LabelFiles()
    (tmp_path / "labels.txt").write_text("cat\r\ndog\n")
    assert files.labels(tmp_path, "labels.txt") == ("cat", "dog")
    with pytest.raises(InvalidInputError, match=r"cannot read label_filename 'missing\.txt'"):
        files.labels(tmp_path, "missing.txt")
    (tmp_path.parent / "outside.txt").write_text("x\n")
    with pytest.raises(InvalidInputError, match="outside the model folder"):
        files.labels(tmp_path, "../outside.txt")


# -- trace and log settings -----------------------------------------------------------------


def test_trace_sampling_count_and_model_overrides(tmp_path):
    now = iter(range(10**12, 10**13, 10**9))
    traces = TraceSettings(clock_ns=lambda: next(now))
    path = tmp_path / "t.jsonl"
    assert not traces.active
    traces.update(
        {
            "trace_level": ["TIMESTAMPS"],
            "trace_rate": ["2"],
            "trace_count": ["2"],
            "trace_file": [str(path)],
        }
    )
    traces.update({"trace_level": ["OFF"]}, model="quiet")
    response = InferenceResponse("m", "1", "r", {}, RequestTiming(0.002, 0.003, 0.006))
    for _ in range(6):
        for model in ("m", "quiet"):
            trace = traces.start(model, "1", "r")
            if trace is not None:
                trace.end(response)
    traces.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 2 and {line["model_name"] for line in lines} == {"m"}  # 1 in 2, 2 max
    stamps = [t["ns"] for t in lines[0]["timestamps"]]
    assert [b - a for a, b in itertools.pairwise(stamps)] == [
        2_000_000,
        3_000_000,
        1_000_000,
    ]
    with pytest.raises(InvalidInputError, match="trace_count must be an integer >= -1"):
        traces.update({"trace_count": ["-2"]})
    assert traces.get()["trace_count"] == "2"  # a refused update changes nothing
    with pytest.raises(InvalidInputError, match="trace_rate"):
        traces.update({"trace_rate": ["x"]}, model="other")
    assert traces.get("other") == traces.get()  # ...not even for a model
    traces.update({"trace_level": None}, model="quiet")  # cleared: follows the server again
    assert traces.get("quiet")["trace_level"] == ["TIMESTAMPS"]


def test_log_levels_follow_the_settings():
    root = logging.getLogger("gpuserve.test.logsettings")
    root.setLevel(logging.INFO)
    logs = LogSettings(root)
    assert logs.get()["log_info"] is True and logs.get()["log_verbose_level"] == 0
    assert logs.update({"log_verbose_level": 2})["log_verbose_level"] == 1
    assert root.level == logging.DEBUG
    logs.update({"log_verbose_level": 0, "log_info": False, "log_warning": False})
    assert root.level == logging.ERROR
    logs.update({"log_error": False})
    assert root.level == logging.CRITICAL
    with pytest.raises(InvalidInputError, match="must be a int"):
        logs.update({"log_verbose_level": True})
    with pytest.raises(InvalidInputError, match="log_format"):
        logs.update({"log_format": "ISO8601"})


# -- the switch ---------------------------------------------------------------------------------


def test_the_switch_by_flag_and_environment(monkeypatch):
    from gpuserve.cli.main import build_parser
    from gpuserve.cli.serve import SERVE_FIELDS
    from gpuserve.config import ServerConfig

    assert ServerConfig().allow_client_shm is False
    args = build_parser().parse_args(["serve", "--allow-client-shm"])
    assert "allow_client_shm" in SERVE_FIELDS and args.allow_client_shm is True
    assert build_parser().parse_args(["serve"]).allow_client_shm is None  # env/default decide
    monkeypatch.setenv("GPUSERVE_ALLOW_CLIENT_SHM", "1")
    assert ServerConfig().allow_client_shm is True
