"""Facts about the server that every front end reports the same way."""

from __future__ import annotations

from gpuserve.errors import GpuserveError, ModelNotReadyError, OverloadedError

#: The server's name in server metadata.
SERVER_NAME = "gpuserve"

#: The protocol extensions every front end supports (KServe V2 / Triton names).
EXTENSIONS = (
    "binary_tensor_data",
    "statistics",
    "model_configuration",
    "model_repository",
    "generate",
)

#: gpuserve backend -> the platform name Triton clients know (others report the backend).
PLATFORM = {"python": "python", "torch": "pytorch_libtorch", "onnx": "onnxruntime_onnx"}


def platform(backend: str) -> str:
    """The platform reported for a model served by ``backend``."""
    return PLATFORM.get(backend, backend)


def retry_after_s(error: GpuserveError) -> int | None:
    """Whole seconds a refused client should wait (``Retry-After``, at least 1), or None when
    ``error`` is not an overload refusal nor a load on demand held back by its back-off."""
    if isinstance(error, OverloadedError):
        return max(1, round(error.retry_after_s))
    if isinstance(error, ModelNotReadyError) and error.retry_after_s is not None:
        return max(1, round(error.retry_after_s))
    return None
