"""The load-time precision gate on CUDA (skipped without CUDA): text_embedding in fp16 and
bf16 on cuda:0 passes the default ``precision_check`` against an fp32 copy on the same GPU and
is refused past a tight bound with the measured value and the bound; int8 (ONNX Runtime,
CPU kernels) is refused on a GPU instance. The same code runs on a CPU in
tests/integration/test_precision_gate_serving.py."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from gpuserve.backends.base import LoadContext
from gpuserve.config import default_model_repository, load_model_config
from gpuserve.config.precision import PrecisionCheckConfig
from tests.gpu.model_dir import MODEL_DIR


def load(device: str, precision: str, check: PrecisionCheckConfig | None = None):
    from gpuserve.backends.python import PythonBackend

    folder = default_model_repository() / "text_embedding"
    update: dict = {"precision": precision}
    if check is not None:
        update["precision_check"] = check
    config = load_model_config(folder / "config.yaml").model_copy(update=update)
    backend = PythonBackend()
    parameters = {"model_dir": MODEL_DIR} if MODEL_DIR else {}
    backend.load(
        LoadContext(
            config=config, version_path=folder / "1", version=1, device=device,
            parameters=parameters,
        )
    )  # fmt: skip
    return backend


def check_gate_passes(device: str, precision: str, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="gpuserve.models.embedding_precision"):
        backend = load(device, precision)
    assert f"precision_check passed (built-in reference sentences): {precision}:" in caplog.text
    data = np.array([[b"The gate ran on this device."]], dtype=object)
    out = backend.postprocess(backend.forward(backend.preprocess({"TEXT": data})))["EMBEDDING"]
    assert out.dtype == np.float32 and abs(float(np.linalg.norm(out)) - 1.0) < 1e-3


def check_gate_refuses(device: str, precision: str) -> None:
    with pytest.raises(ValueError, match="fails precision_check against fp32") as err:
        load(device, precision, PrecisionCheckConfig(min_cosine=0.9999999))
    assert "< min_cosine 0.9999999" in str(err.value)  # the bound as configured


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precisions_pass_the_gate_on_cuda(precision, caplog):
    check_gate_passes("cuda:0", precision, caplog)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precisions_past_a_tight_bound_are_refused_on_cuda(precision):
    check_gate_refuses("cuda:0", precision)


@pytest.mark.gpu
def test_int8_refused_on_a_gpu_instance():
    with pytest.raises(ValueError, match="precision int8 runs on CPU instances"):
        load("cuda:0", "int8")
