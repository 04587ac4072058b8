"""The one table from gpuserve errors to HTTP status codes and gRPC status codes.

Sources: KServe V2 protocol (400 for a bad request, 404 for an unknown model), Triton's
HTTP/gRPC mapping, and RFC 6585 (429 Too Many Requests with Retry-After) for overload.
"""

from __future__ import annotations

from gpuserve import errors

#: error class -> (HTTP status, gRPC status code name)
STATUS: dict[type[errors.GpuserveError], tuple[int, str]] = {
    errors.InvalidInputError: (400, "INVALID_ARGUMENT"),
    errors.TooManyInputsError: (413, "INVALID_ARGUMENT"),
    errors.ModelNotFoundError: (404, "NOT_FOUND"),
    errors.ModelNotReadyError: (503, "UNAVAILABLE"),
    errors.OverloadedError: (429, "RESOURCE_EXHAUSTED"),
    errors.RequestTimeoutError: (503, "UNAVAILABLE"),
    errors.CancelledRequestError: (499, "CANCELLED"),
    errors.UnavailableError: (503, "UNAVAILABLE"),
    errors.OutOfMemoryError: (503, "RESOURCE_EXHAUSTED"),
    errors.BackendError: (500, "INTERNAL"),
    errors.ConfigError: (400, "INVALID_ARGUMENT"),
    errors.UnauthenticatedError: (401, "UNAUTHENTICATED"),
    errors.PermissionDeniedError: (403, "PERMISSION_DENIED"),
}


def http_status(error: errors.GpuserveError) -> int:
    """HTTP status for ``error`` (500 for anything not in the table)."""
    for cls in type(error).__mro__:
        if cls in STATUS:
            return STATUS[cls][0]
    return 500


def grpc_code(error: errors.GpuserveError) -> str:
    """gRPC status code name for ``error`` (INTERNAL for anything not in the table)."""
    for cls in type(error).__mro__:
        if cls in STATUS:
            return STATUS[cls][1]
    return "INTERNAL"
