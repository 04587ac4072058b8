"""Execution backends. :func:`create_backend` maps a config's ``backend`` name to a class.

Triton's platforms map onto these when a ``config.pbtxt`` is read
(:data:`gpuserve.repository.triton.config.PLATFORMS`): ``onnxruntime_onnx`` / ``onnxruntime``
-> ``onnx``, ``pytorch_libtorch`` / ``pytorch`` -> ``torch`` (TorchScript ``model.pt``),
``python`` -> ``python`` (a ``Model`` class or Triton's ``TritonPythonModel``).
"""

from __future__ import annotations

from pathlib import Path

from gpuserve.backends.base import Backend
from gpuserve.config import ModelConfig
from gpuserve.config.model import sections_problem
from gpuserve.errors import ConfigError

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
    generative model (``config.generates``) gets the causal LM backend. A huggingface task
    left unset must be read from the folder first (:func:`complete_for_version` does)."""
    if config.generates:
        from gpuserve.backends.causal_lm.backend import CausalLMBackend

        return CausalLMBackend
    return backend_class(config.backend)


def complete_for_version(
    config: ModelConfig, version_path: Path, *, auto_complete: bool = True
) -> ModelConfig:
    """The configuration one version is served with, from the model's: the huggingface task
    read from the folder where the config leaves it unset
    (:func:`~gpuserve.backends.hf_task.resolve_task`; the task picks the backend), completed
    by its backend from the model file (``complete_config``), then its API sections
    (``embedding``, ``rerank``, ``classification``, ``sparse``) checked against the tensors
    the model now has. Blocking (reads the model's files).

    Raises:
        ConfigError: the task contradicts the folder, completion failed, or a section names
            an input or output the model does not have (the message names the section's
            field and the model's tensors).
    """
    from gpuserve.backends.hf_task import resolve_task

    resolved = resolve_task(config, version_path)
    complete = backend_for(resolved).complete_config
    completed = complete(resolved, version_path, auto_complete=auto_complete)
    problem = sections_problem(completed)
    if problem is not None:
        raise ConfigError(f"{version_path}: {problem}")
    return completed


def create_backend(name: str) -> Backend:
    """A new, unloaded backend object for ``name`` (see :func:`backend_class`).

    Raises:
        ValueError: unknown backend name.
    """
    return backend_class(name)()
