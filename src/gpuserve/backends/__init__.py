"""Execution backends. :func:`create_backend` maps a config's ``backend`` name to a class."""

from __future__ import annotations

from gpuserve.backends.base import Backend


def create_backend(name: str) -> Backend:
    """A new, unloaded backend object for ``name`` (``python`` or ``torch``).

    Raises:
        ValueError: unknown backend name (config validation normally catches this first).
    """
    if name == "python":
        from gpuserve.backends.python import PythonBackend

        return PythonBackend()
    if name == "torch":
        from gpuserve.backends.torch_backend import TorchBackend

        return TorchBackend()
    raise ValueError(f"unknown backend {name!r} (expected 'python' or 'torch')")
