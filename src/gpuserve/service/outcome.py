"""The access log: one ``gpuserve.access`` line per answered request, from every front end.

Each front end fills one :class:`AccessRecord` (its client, method and path, its status as it
sends it, and what the service admitted) and calls :func:`log_access`, so HTTP and gRPC lines
carry the same fields and one dashboard or grep reads both. Shapes and sizes are logged, never
tensor contents. Off unless ``access_log`` is set (``--access-log``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

access_logger = logging.getLogger("gpuserve.access")


@dataclass(slots=True)
class AccessRecord:
    """One answered request.

    Attributes:
        client: The peer, ``host:port`` (``-`` when unknown).
        method: HTTP method, or ``grpc``.
        path: HTTP path, or the RPC name.
        status: HTTP status code, or gRPC status code name.
        model / version: The model and the version that took the request (``-`` if none).
        rows: Rows of the request (its batch size; 0 when it was not decoded).
        shapes: Input name -> shape, as decoded.
        size: Response body bytes.
        total_s: Seconds from the complete request to its answer.
    """

    client: str
    method: str
    path: str
    status: int | str
    model: str = "-"
    version: str = "-"
    rows: int = 0
    shapes: dict[str, list[int]] = field(default_factory=dict)
    size: int = 0
    total_s: float = 0.0


def access_log_enabled() -> bool:
    """Whether an access line would be written (the logger is on at INFO)."""
    return access_logger.isEnabledFor(logging.INFO)


def log_access(record: AccessRecord) -> None:
    """Write ``record`` as one line; the same fields go to JSON logs as keys."""
    if not access_logger.isEnabledFor(logging.INFO):
        return
    total_ms = round(record.total_s * 1000, 3)
    access_logger.info(
        '%s "%s %s" %s model=%s version=%s rows=%d shapes=%s bytes=%d %.3f ms',
        record.client,
        record.method,
        record.path,
        record.status,
        record.model,
        record.version,
        record.rows,
        record.shapes,
        record.size,
        total_ms,
        extra={
            "client": record.client,
            "method": record.method,
            "path": record.path,
            "status": record.status,
            "model": record.model,
            "version": record.version,
            "rows": record.rows,
            "shapes": record.shapes,
            "bytes": record.size,
            "total_ms": total_ms,
        },
    )
