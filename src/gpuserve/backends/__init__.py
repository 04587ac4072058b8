"""Execution backends. :func:`create_backend` maps a config's ``backend`` name to a class.

Triton's platforms map onto these when a ``config.pbtxt`` is read
(:data:`gpuserve.repository.triton_config.PLATFORMS`): ``onnxruntime_onnx`` / ``onnxruntime``
-> ``onnx``, ``pytorch_libtorch`` / ``pytorch`` -> ``torch`` (TorchScript ``model.pt``),
``python`` -> ``python`` (a ``Model`` class or Triton's ``TritonPythonModel``).
"""

from __future__ import annotations

from gpuserve.backends.base import Backend
from gpuserve.config import ModelConfig

BACKEND_NAMES = ("python", "torch", "onnx", "huggingface")


def backend_class(name: str) -> type[Backend]:
    """The backend class for ``name`` (one of :data:`BACKEND_NAMES`), imported lazily.

    Raises:
        ValueError: unknown backend name (config validation normally catches this first).
    """
    if name == "python":
        # gpuserve's ``Model`` class, or Triton's ``TritonPythonModel``, by what model.py has.
        from gpuserve.backends.triton_python.backend import PythonModelBackend

        return PythonModelBackend
    if name == "torch":
        from gpuserve.backends.torch_backend import TorchBackend

        return TorchBackend
    if name == "onnx":
        from gpuserve.backends.onnx_backend import OnnxBackend

        return OnnxBackend
    if name == "huggingface":
        from gpuserve.backends.huggingface import HuggingFaceBackend

        return HuggingFaceBackend
    if name == "ensemble":  # run by the engine; only complete_config is asked for
        from gpuserve.backends.ensemble import EnsembleBackend

        return EnsembleBackend
    raise ValueError(f"unknown backend {name!r} (expected one of {', '.join(BACKEND_NAMES)})")


def backend_for(config: ModelConfig) -> type[Backend]:
    """The backend class of a model's config: as :func:`backend_class`, except that a
    generative model (``config.generates``) gets the causal LM backend."""
    if config.generates:
        from gpuserve.backends.causal_lm.backend import CausalLMBackend

        return CausalLMBackend
    return backend_class(config.backend)


def create_backend(name: str) -> Backend:
    """A new, unloaded backend object for ``name`` (see :func:`backend_class`).

    Raises:
        ValueError: unknown backend name.
    """
    return backend_class(name)()
