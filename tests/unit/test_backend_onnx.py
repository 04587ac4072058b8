"""The onnx backend without a server: providers, session options, loading and running."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpuserve.backends import backend_class, create_backend
from gpuserve.backends.base import LoadContext
from gpuserve.backends.onnx_backend import (
    OnnxBackend,
    choose_providers,
    device_id,
    session_options,
)
from gpuserve.config import OnnxConfig, parse_model_config
from gpuserve.errors import ConfigError

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

ALL = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]


def test_device_id():
    assert device_id("cpu") is None
    assert device_id("cuda") == 0
    assert device_id("cuda:3") == 3


def test_cpu_instance_gets_only_the_cpu_provider():
    assert choose_providers(["tensorrt", "cuda", "cpu"], ALL, "cpu") == ["CPUExecutionProvider"]


def test_gpu_instance_gets_gpu_providers_in_preference_order_with_its_device_id():
    assert choose_providers(["tensorrt", "cuda", "cpu"], ALL, "cuda:1") == [
        ("TensorrtExecutionProvider", {"device_id": 1}),
        ("CUDAExecutionProvider", {"device_id": 1}),
        "CPUExecutionProvider",
    ]
    assert choose_providers(["cuda", "cpu"], ALL, "cuda:0") == [
        ("CUDAExecutionProvider", {"device_id": 0}),
        "CPUExecutionProvider",
    ]


def test_gpu_instance_without_gpu_providers_falls_back_to_cpu():
    assert choose_providers(["tensorrt", "cuda", "cpu"], ["CPUExecutionProvider"], "cuda:0") == [
        "CPUExecutionProvider"
    ]


def test_no_usable_provider_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        choose_providers(["cuda"], ["CPUExecutionProvider"], "cuda:0")
    assert "none of them can run on cuda:0" in info.value.message
    with pytest.raises(ConfigError):
        choose_providers(["tensorrt", "cuda"], ALL, "cpu")


def test_session_options_follow_the_config():
    options = session_options(
        OnnxConfig(
            intra_op_threads=2,
            inter_op_threads=3,
            execution_mode="parallel",
            graph_optimization_level="basic",
        ),
        ort,
    )
    assert options.intra_op_num_threads == 2
    assert options.inter_op_num_threads == 3
    assert options.execution_mode == ort.ExecutionMode.ORT_PARALLEL
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    default = session_options(OnnxConfig(), ort)
    assert default.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert default.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL


def test_backend_registry():
    assert backend_class("onnx") is OnnxBackend
    assert isinstance(create_backend("onnx"), OnnxBackend)
    with pytest.raises(ValueError, match="python, torch, onnx"):
        backend_class("tensorflow")


def write_graph(folder: Path) -> Path:
    """A graph with a string identity and a float doubling: TEXT [n, 2] BYTES, X [n, 3] FP32."""
    from onnx import TensorProto, helper

    text_in = helper.make_tensor_value_info("TEXT", TensorProto.STRING, ["n", 2])
    x_in = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n", 3])
    text_out = helper.make_tensor_value_info("TEXT_OUT", TensorProto.STRING, ["n", 2])
    y_out = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["n", 3])
    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["TEXT"], ["TEXT_OUT"]),
            helper.make_node("Add", ["X", "X"], ["Y"]),
        ],
        "g",
        [text_in, x_in],
        [text_out, y_out],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder.mkdir(parents=True)
    onnx.save(model, str(folder / "model.onnx"))
    return folder


def load(tmp_path, **fields):
    version_path = write_graph(tmp_path / "m" / "1")
    config = parse_model_config({"backend": "onnx", **fields}, tmp_path / "m/config.yaml", "m")
    config = OnnxBackend.complete_config(config, version_path)
    backend = OnnxBackend()
    backend.load(LoadContext(config=config, version_path=version_path, version=1))
    return config, backend


def test_completion_reads_bytes_and_float_tensors(tmp_path):
    config, _ = load(tmp_path)
    assert [(t.name, t.datatype, t.shape) for t in config.inputs] == [
        ("TEXT", "BYTES", [2]),
        ("X", "FP32", [3]),
    ]
    assert [t.name for t in config.outputs] == ["TEXT_OUT", "Y"]


def test_run_with_bytes_and_floats(tmp_path):
    _, backend = load(tmp_path, onnx={"intra_op_threads": 1})
    backend.warmup()
    text = np.array([[b"a", "é".encode()], [b"", b"xyz"]], dtype=object)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = backend.postprocess(backend.forward(backend.preprocess({"TEXT": text, "X": x})))
    assert out["TEXT_OUT"].tolist() == text.tolist()
    assert out["Y"].dtype == np.float32
    np.testing.assert_array_equal(out["Y"], x * 2)
    backend.unload()


def test_non_utf8_bytes_are_an_invalid_input(tmp_path):
    from gpuserve.errors import InvalidInputError

    _, backend = load(tmp_path)
    text = np.array([[b"\xff", b"a"]], dtype=object)
    with pytest.raises(InvalidInputError, match="UTF-8"):
        backend.preprocess({"TEXT": text, "X": np.zeros((1, 3), np.float32)})


def test_precision_other_than_fp32_is_refused(tmp_path):
    with pytest.raises(ConfigError) as info:
        load(tmp_path, precision="fp16")
    assert "gpuserve export --fp16" in info.value.message


def test_missing_or_corrupt_model_file(tmp_path):
    config = parse_model_config({"backend": "onnx"}, tmp_path / "config.yaml", "m")
    (tmp_path / "1").mkdir()
    with pytest.raises(ConfigError, match=r"needs model\.onnx"):
        OnnxBackend.complete_config(config, tmp_path / "1")
    (tmp_path / "1" / "model.onnx").write_bytes(b"not a graph")
    with pytest.raises(ConfigError, match="ONNX Runtime cannot load it"):
        OnnxBackend.complete_config(config, tmp_path / "1")


def test_io_binding_path(tmp_path):
    """The GPU data path (OrtValues bound in and out), exercised with CPU-resident values."""
    from onnx import TensorProto, helper

    x_in = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n", 3])
    y_out = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["n", 3])
    graph = helper.make_graph([helper.make_node("Add", ["X", "X"], ["Y"])], "g", [x_in], [y_out])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder = tmp_path / "m" / "1"
    folder.mkdir(parents=True)
    onnx.save(model, str(folder / "model.onnx"))
    config = parse_model_config({"backend": "onnx"}, tmp_path / "m/config.yaml", "m")
    config = OnnxBackend.complete_config(config, folder)
    backend = OnnxBackend()
    backend.load(LoadContext(config=config, version_path=folder, version=1))
    assert backend.bind is None  # CPU instance: plain numpy feeds
    backend.bind, backend.device_id = "cpu", 0
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    prepared = backend.preprocess({"X": x})
    assert isinstance(prepared["X"], ort.OrtValue)
    out = backend.postprocess(backend.forward(prepared))
    np.testing.assert_array_equal(out["Y"], x * 2)
