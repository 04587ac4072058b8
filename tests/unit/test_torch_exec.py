"""Torch backend execution options on the CPU: precision keeps the declared datatypes, CUDA
graphs fall back cleanly without a GPU, torch.compile serves the same results."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from gpuserve.backends import cpu_features
from gpuserve.backends.base import LoadContext
from gpuserve.backends.torch_backend import TorchBackend
from gpuserve.backends.torch_exec import batch_buckets
from gpuserve.config import ModelConfig

MODEL = """
import torch


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 8))

    def forward(self, x):
        return self.net(x)
"""


def load(tmp_path: Path, **config) -> TorchBackend:
    folder = tmp_path / "mlp" / "1"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(MODEL)
    cfg = ModelConfig(
        name="mlp",
        backend="torch",
        max_batch_size=8,
        inputs=[{"name": "x", "datatype": "FP32", "shape": [32]}],
        outputs=[{"name": "y", "datatype": "FP32", "shape": [8]}],
        **config,
    )
    backend = TorchBackend()
    backend.load(LoadContext(config=cfg, version_path=folder, version=1))
    backend.warmup()
    return backend


def run(backend: TorchBackend, x: np.ndarray) -> np.ndarray:
    return backend.postprocess(backend.forward(backend.preprocess({"x": x})))["y"]


X = np.random.default_rng(0).standard_normal((5, 32)).astype(np.float32)


@pytest.mark.parametrize(
    ("precision", "tolerance"), [("fp16", 2e-2), ("bf16", 1e-1), ("int8", 1e-1)]
)
def test_precision_keeps_the_declared_datatype_and_stays_close(
    tmp_path, monkeypatch, precision, tolerance
):
    # bf16 needs the instruction set on a CPU: say this one has it (torch emulates it if not)
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    reference = run(load(tmp_path, precision="fp32"), X)
    got = run(load(tmp_path, precision=precision), X)
    assert got.dtype == np.float32 and got.shape == (5, 8)
    np.testing.assert_allclose(got, reference, atol=tolerance, rtol=tolerance)
    if precision == "int8":
        backend = load(tmp_path, precision="int8")
        assert "quantized" in type(backend.module.net[0]).__module__


def test_cuda_graphs_fall_back_to_eager_on_cpu_with_a_logged_reason(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        backend = load(tmp_path, optimization={"cuda_graphs": True})
    assert backend.graphs is None
    assert "CUDA graphs need a CUDA device" in caplog.text
    np.testing.assert_allclose(run(backend, X), run(load(tmp_path), X), atol=1e-6)


def test_torch_compile_serves_the_same_results(tmp_path):
    # aot_eager runs dynamo's tracing and the warm-up of every bucket without generating code,
    # which on this CPU would take minutes; inductor is exercised by the GPU tests
    backend = load(tmp_path, optimization={"compile": True, "compile_backend": "aot_eager"})
    np.testing.assert_allclose(run(backend, X), run(load(tmp_path), X), atol=1e-5)


def test_batch_buckets():
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(12, [6]) == [1, 2, 4, 6, 8, 12]
    assert batch_buckets(0) == [1]


def test_bf16_refused_on_a_cpu_without_the_instruction_set(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    with pytest.raises(Exception, match="AVX-512 BF16 or AMX-BF16"):
        load(tmp_path, precision="bf16")


def test_int8_refused_on_a_gpu_device():
    from gpuserve.backends.torch_exec import apply_precision

    with pytest.raises(ValueError, match="CPU"):
        apply_precision(torch.nn.Linear(2, 2), "int8", torch.device("cuda", 0))
