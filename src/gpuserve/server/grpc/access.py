"""The access log of gRPC calls: one ``gpuserve.access`` line per call (per request of a stream).

The call becomes the same :class:`~gpuserve.service.outcome.AccessRecord` the HTTP front end
fills (client, call, status, model, version, rows, input shapes, response bytes, total
milliseconds) and is written by the same function, so one dashboard or grep reads both; the
status is the gRPC code name. Tensor contents are never
logged, only shapes. Off unless ``access_log`` is set (``--access-log``).
"""

from __future__ import annotations

from typing import Any

from gpuserve.protocol.protos import grpc_service_pb2 as pb
from gpuserve.service.outcome import AccessRecord, access_log_enabled, log_access


def log_call(
    peer: str, method: str, code: str, request: Any, response: Any, total_s: float
) -> None:
    """Log one call.

    Args:
        peer: The client as gRPC names it (``ipv4:127.0.0.1:5555``).
        method: The RPC name (``ModelInfer``).
        code: gRPC status code name (``OK``, ``INVALID_ARGUMENT``, ...).
        request: The request message.
        response: The response message, or None when the call failed.
        total_s: Seconds from the call's start to its answer.
    """
    if not access_log_enabled():
        return
    record = AccessRecord(peer, "grpc", method, code, total_s=total_s)
    record.model = getattr(request, "model_name", "") or getattr(request, "name", "") or "-"
    record.version = (
        getattr(response, "model_version", "")
        or getattr(request, "model_version", "")
        or getattr(request, "version", "")
        or "-"
    )
    if isinstance(request, pb.ModelInferRequest):
        record.shapes = {tensor.name: list(tensor.shape) for tensor in request.inputs}
        first = next(iter(record.shapes.values()), None)
        record.rows = first[0] if first else 1
    record.size = response.ByteSize() if response is not None else 0
    log_access(record)


def grpc_traceparent(context: Any) -> str | None:
    """The client's W3C ``traceparent`` metadata (read only while tracing is on)."""
    for key, value in context.invocation_metadata() or ():
        if key == "traceparent":
            return value if isinstance(value, str) else value.decode("latin-1")
    return None
