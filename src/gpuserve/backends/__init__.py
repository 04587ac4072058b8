"""Execution backends. :func:`create_backend` maps a config's ``backend`` name to a class."""

from __future__ import annotations

from gpuserve.backends.base import Backend

BACKEND_NAMES = ("python", "torch", "onnx", "huggingface")


def backend_class(name: str) -> type[Backend]:
    """The backend class for ``name`` (one of :data:`BACKEND_NAMES`), imported lazily.

    Raises:
        ValueError: unknown backend name (config validation normally catches this first).
    """
    if name == "python":
        from gpuserve.backends.python import PythonBackend

        return PythonBackend
    if name == "torch":
        from gpuserve.backends.torch_backend import TorchBackend

        return TorchBackend
    if name == "onnx":
        from gpuserve.backends.onnx_backend import OnnxBackend

        return OnnxBackend
    if name == "huggingface":
        from gpuserve.backends.huggingface import HuggingFaceBackend

        return HuggingFaceBackend
    raise ValueError(f"unknown backend {name!r} (expected one of {', '.join(BACKEND_NAMES)})")


def create_backend(name: str) -> Backend:
    """A new, unloaded backend object for ``name`` (see :func:`backend_class`).

    Raises:
        ValueError: unknown backend name.
    """
    return backend_class(name)()
