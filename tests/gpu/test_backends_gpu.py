"""GPU checks of the model-format backends (skipped without CUDA): the onnx backend on cuda:0
with the CUDA execution provider and I/O binding, a ``torch.export`` program on cuda:0,
text_embedding in fp16 on cuda:0 against fp32, the exported ONNX text_embedding with bound
device inputs, and the huggingface backend in fp16.

Each check is a function of the device (``check_*``): called with ``"cpu"`` (and fp32/bf16)
the same code passes on a CPU-only machine, which is how it was checked where no GPU was
available (everything under tests/gpu is skipped without CUDA)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from gpuserve.backends.base import LoadContext
from gpuserve.config import ModelConfig, default_model_repository, load_model_config
from tests.fixtures.backend_models import make_module, reference, write_model_file
from tests.gpu.model_dir import MODEL_DIR

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "gpuserve batches requests for the GPU.",
    "short",
    "A longer sentence, so that the batch is padded and the attention mask matters.",
]


def texts(rows: list[str]) -> np.ndarray:
    return np.array([[s.encode()] for s in rows], dtype=object)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def run(backend, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return backend.postprocess(backend.forward(backend.preprocess(inputs)))


def small_config(backend: str) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "name": "small",
            "backend": backend,
            "max_batch_size": 8,
            "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [8]}],
            "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [4]}],
        }
    )


def check_onnx(tmp_path: Path, device: str) -> None:
    """The onnx backend on ``device``: GPU provider and I/O binding there, same outputs."""
    ort = pytest.importorskip("onnxruntime")
    from gpuserve.backends.onnx_backend import OnnxBackend

    gpu = device.startswith("cuda")
    if gpu and "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)")
    module = make_module(seed=1)
    folder = tmp_path / "onnx" / "1"
    write_model_file(module, "onnx", folder)
    config = small_config("onnx").model_copy(
        update={
            "onnx": small_config("onnx").onnx.model_copy(
                update={"execution_providers": ["cuda", "cpu"]}
            )
        }
    )
    config = OnnxBackend.complete_config(config, folder)
    backend = OnnxBackend()
    backend.load(LoadContext(config=config, version_path=folder, version=1, device=device))
    providers = backend.session.get_providers()
    if gpu:
        assert providers[0] == "CUDAExecutionProvider", providers
        assert backend.bind == "cuda"
    else:
        assert providers == ["CPUExecutionProvider"] and backend.bind is None
    rows = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    prepared = backend.preprocess({"INPUT0": rows})
    if gpu:  # inputs were uploaded in the CPU stage: device OrtValues
        assert prepared["INPUT0"].device_name().lower() == "cuda"
    out = backend.postprocess(backend.forward(prepared))
    np.testing.assert_allclose(out["OUTPUT0"], reference(module, rows), atol=1e-4, rtol=1e-4)


def check_torch_export(tmp_path: Path, device: str) -> None:
    """A ``model.pt2`` program on ``device``: the parameters move there, same outputs."""
    import torch

    from gpuserve.backends.torch_backend import TorchBackend

    module = make_module(seed=2)
    folder = tmp_path / "pt2" / "1"
    write_model_file(module, "torch.export", folder)
    config = TorchBackend.complete_config(small_config("torch"), folder)
    backend = TorchBackend()
    backend.load(LoadContext(config=config, version_path=folder, version=1, device=device))
    backend.warmup()
    rows = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    out = run(backend, {"INPUT0": rows})
    np.testing.assert_allclose(out["OUTPUT0"], reference(module, rows), atol=1e-4, rtol=1e-4)
    params = list(backend.module.parameters()) or list(backend.module.buffers())
    if params:
        assert params[0].device == torch.device(device)


def text_embedding(device: str, precision: str):
    from gpuserve.backends.python import PythonBackend

    folder = default_model_repository() / "text_embedding"
    config = load_model_config(folder / "config.yaml").model_copy(update={"precision": precision})
    backend = PythonBackend()
    parameters = {"model_dir": MODEL_DIR} if MODEL_DIR else {}
    backend.load(
        LoadContext(
            config=config,
            version_path=folder / "1",
            version=1,
            device=device,
            parameters=parameters,
        )
    )
    return backend


def check_text_embedding_precision(device: str, precision: str) -> None:
    """text_embedding in ``precision`` on ``device`` against fp32 on the CPU."""
    got = run(text_embedding(device, precision), {"TEXT": texts(SENTENCES)})["EMBEDDING"]
    expected = run(text_embedding("cpu", "fp32"), {"TEXT": texts(SENTENCES)})["EMBEDDING"]
    assert got.dtype == np.float32 and got.shape == (len(SENTENCES), 384)
    minimum = 0.999 if precision != "fp32" else 0.99999
    assert cosines(got, expected).min() > minimum


def check_text_embedding_onnx(tmp_path: Path, device: str) -> None:
    """The exported text_embedding (tokeniser + ONNX graph) on ``device`` against torch."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    from gpuserve.cli.main import main

    if device.startswith("cuda") and "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)")
    repo = tmp_path / "repo"
    shutil.copytree(default_model_repository() / "text_embedding", repo / "text_embedding")
    assert main(["export", "--model-repository", str(repo), "text_embedding"]) == 0
    from gpuserve.backends.python import PythonBackend

    folder = repo / "text_embedding_onnx"
    config = load_model_config(folder / "config.yaml")
    backend = PythonBackend()
    backend.load(LoadContext(config=config, version_path=folder / "1", version=1, device=device))
    assert backend.model.graph.bind == ("cuda" if device.startswith("cuda") else None)
    got = run(backend, {"TEXT": texts(SENTENCES)})["EMBEDDING"]
    expected = run(text_embedding("cpu", "fp32"), {"TEXT": texts(SENTENCES)})["EMBEDDING"]
    assert cosines(got, expected).min() > 0.9999


def check_huggingface_precision(tmp_path: Path, device: str, precision: str) -> None:
    """The huggingface backend (feature extraction) in ``precision`` against fp32 CPU."""
    pytest.importorskip("transformers")
    from gpuserve.backends.huggingface import HuggingFaceBackend
    from gpuserve.models.sentence_embedding import default_model_dir

    def load(device: str, precision: str) -> HuggingFaceBackend:
        config = ModelConfig.model_validate(
            {
                "name": "hf",
                "backend": "huggingface",
                "precision": precision,
                "huggingface": {"model_dir": str(default_model_dir())},
            }
        )
        config = HuggingFaceBackend.complete_config(config, tmp_path)
        backend = HuggingFaceBackend()
        backend.load(LoadContext(config=config, version_path=tmp_path, version=1, device=device))
        return backend

    got = run(load(device, precision), {"TEXT": texts(SENTENCES)})["EMBEDDING"]
    expected = run(load("cpu", "fp32"), {"TEXT": texts(SENTENCES)})["EMBEDDING"]
    minimum = 0.999 if precision != "fp32" else 0.99999
    assert cosines(got, expected).min() > minimum


@pytest.mark.gpu
def test_onnx_backend_binds_inputs_on_cuda(tmp_path):
    check_onnx(tmp_path, "cuda:0")


@pytest.mark.gpu
def test_torch_export_program_runs_on_cuda(tmp_path):
    check_torch_export(tmp_path, "cuda:0")


@pytest.mark.gpu
def test_text_embedding_fp16_on_cuda_matches_fp32():
    check_text_embedding_precision("cuda:0", "fp16")


@pytest.mark.gpu
def test_exported_text_embedding_runs_bound_on_cuda(tmp_path):
    check_text_embedding_onnx(tmp_path, "cuda:0")


@pytest.mark.gpu
def test_huggingface_fp16_on_cuda_matches_fp32(tmp_path):
    check_huggingface_precision(tmp_path, "cuda:0", "fp16")
