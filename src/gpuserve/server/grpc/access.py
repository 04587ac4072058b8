"""The access log of gRPC calls: one ``gpuserve.access`` line per call (per request of a stream).

The same fields as the HTTP access log of :mod:`gpuserve.server.http.app` (client, call,
status, model, version, rows, input shapes, response bytes, total milliseconds), so one
dashboard or grep reads both; the status is the gRPC code name. Tensor contents are never
logged, only shapes. Off unless ``access_log`` is set (``--access-log``).
"""

from __future__ import annotations

import logging
from typing import Any

from gpuserve.protocol.protos import grpc_service_pb2 as pb

access_logger = logging.getLogger("gpuserve.access")


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
    if not access_logger.isEnabledFor(logging.INFO):
        return
    model = getattr(request, "model_name", "") or getattr(request, "name", "") or "-"
    version = (
        getattr(response, "model_version", "")
        or getattr(request, "model_version", "")
        or getattr(request, "version", "")
        or "-"
    )
    shapes: dict[str, list[int]] = {}
    rows = 0
    if isinstance(request, pb.ModelInferRequest):
        shapes = {tensor.name: list(tensor.shape) for tensor in request.inputs}
        first = next(iter(shapes.values()), None)
        rows = first[0] if first else 1
    size = response.ByteSize() if response is not None else 0
    total_ms = round(total_s * 1000, 3)
    access_logger.info(
        '%s "grpc %s" %s model=%s version=%s rows=%d shapes=%s bytes=%d %.3f ms',
        peer,
        method,
        code,
        model,
        version,
        rows,
        shapes,
        size,
        total_ms,
        extra={
            "client": peer,
            "method": "grpc",
            "path": method,
            "status": code,
            "model": model,
            "version": version,
            "rows": rows,
            "shapes": shapes,
            "bytes": size,
            "total_ms": total_ms,
        },
    )
