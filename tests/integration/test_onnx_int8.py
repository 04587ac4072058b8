"""``precision: int8`` on ``backend: onnx`` through the real server: the graph is quantised
(blockwise MatMulNBits), cached, checked against fp32 at load, and served close to fp32; past
a tight bound it fails to load naming the output, the measured value and the bound; on a GPU
instance it is refused; fp16 stays refused."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from gpuserve.backends.base import LoadContext
from gpuserve.config import ModelConfig
from gpuserve.errors import ConfigError
from tests.helpers import InProcessServer

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

RNG = np.random.default_rng(5)
W1 = RNG.standard_normal((64, 64)).astype(np.float32) / 8
W2 = RNG.standard_normal((64, 16)).astype(np.float32) / 8

CONFIG = """\
backend: onnx
max_batch_size: 16
inputs: [{name: x, datatype: FP32, shape: [64]}]
outputs: [{name: y, datatype: FP32, shape: [16]}]
precision: int8
"""


def write_mlp(folder: Path) -> None:
    """x [B, 64] @ W1 -> Relu -> @ W2 -> y [B, 16], MatMul nodes with constant weights."""
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
            helper.make_node("Relu", ["h"], ["r"], name="relu"),
            helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2"),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])],
        [numpy_helper.from_array(W1, "w1"), numpy_helper.from_array(W2, "w2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    folder.mkdir(parents=True)
    onnx.save(model, str(folder / "model.onnx"))


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("onnx_int8")
    for name, extra in (
        ("mlp_int8", ""),
        ("mlp_tight", "precision_check: {min_cosine: 0.9999999}\n"),
    ):
        write_mlp(root / name / "1")
        (root / name / "config.yaml").write_text(CONFIG + extra)
    return root


@pytest.fixture(scope="module")
def client(repo):
    server = InProcessServer(repo)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            yield http
    finally:
        server.stop()


def test_int8_graph_serves_close_to_fp32(client):
    x = RNG.standard_normal((5, 64)).astype(np.float32)
    body = {
        "inputs": [{"name": "x", "shape": [5, 64], "datatype": "FP32", "data": x.ravel().tolist()}]
    }
    response = client.post("/v2/models/mlp_int8/infer", json=body)
    assert response.status_code == 200, response.text
    got = np.asarray(response.json()["outputs"][0]["data"], dtype=np.float32).reshape(5, 16)
    want = np.maximum(x @ W1, 0) @ W2
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() > 0.99
    assert not np.allclose(got, want, atol=1e-6)  # really the int8 graph


def test_int8_past_a_tight_bound_fails_to_load(client):
    response = client.get("/v2/models/mlp_tight/ready")
    assert response.status_code == 503
    reason = response.json()["reason"]
    assert "output y: precision int8 fails precision_check against fp32 on 64" in reason
    assert "< min_cosine 0.9999999" in reason and "64 seeded random rows" in reason


def test_int8_graph_is_cached_by_content(repo):
    from gpuserve.backends.onnx_quantize import cache_root

    cached = list((cache_root() / "onnx" / "int8").glob("*-blockwise-v1.onnx"))
    ops = {n.op_type for path in cached for n in onnx.load(str(path)).graph.node}
    assert cached and "MatMulNBits" in ops


def test_int8_refused_on_a_gpu_instance_and_fp16_refused(repo):
    from gpuserve.backends.onnx_backend import OnnxBackend

    config = ModelConfig.model_validate(
        {"name": "mlp_int8", "backend": "onnx", "max_batch_size": 16, "precision": "int8",
         "inputs": [{"name": "x", "datatype": "FP32", "shape": [64]}],
         "outputs": [{"name": "y", "datatype": "FP32", "shape": [16]}]}
    )  # fmt: skip
    context = LoadContext(config=config, version_path=repo / "mlp_int8" / "1", version=1,
                          device="cuda:0")  # fmt: skip
    with pytest.raises(ConfigError, match="precision int8 on backend 'onnx' runs on CPU"):
        OnnxBackend().load(context)
    half = config.model_copy(update={"precision": "fp16"})
    with pytest.raises(ConfigError, match="'fp16' is not applied by backend 'onnx'"):
        OnnxBackend.complete_config(half, repo / "mlp_int8" / "1")
