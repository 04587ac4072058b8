"""The one error hierarchy of gpuserve.

Every error a client can see derives from :class:`GpuserveError`. The tables that map these
classes to HTTP status codes and gRPC status codes live in :mod:`gpuserve.server.status` and
nowhere else. Messages are written for the caller: they name the field, the value received and
what was expected, and never carry a stack trace.
"""

from __future__ import annotations


class GpuserveError(Exception):
    """Base class of every error gpuserve reports to a client."""

    #: Short machine-readable reason, used as the ``reason`` label of failure metrics.
    reason: str = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InvalidInputError(GpuserveError):
    """The request is malformed or does not match the model's declared inputs (HTTP 400).

    Attributes:
        param: The request field at fault (OpenAI's error ``param``), or None.
    """

    reason = "invalid"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class TooManyInputsError(InvalidInputError):
    """One call carries more inputs (texts, documents, token-id rows) than the server's
    ``max_inputs_per_call`` or the model's own cap allows (HTTP 413 on every API); nothing
    of it was computed.

    Attributes:
        param: The request field that carried them (``input``, ``inputs``, ``texts``,
            ``documents``, ...).
        count: How many it carried.
        limit: The most one call may carry.
    """

    def __init__(self, message: str, param: str, count: int, limit: int) -> None:
        super().__init__(message)
        self.param = param
        self.count = count
        self.limit = limit


class ModelNotFoundError(GpuserveError):
    """The named model, or the named version of it, is not in the repository (HTTP 404)."""

    reason = "not_found"


class ModelNotReadyError(GpuserveError):
    """The model exists but cannot serve now: loading, failed to load, unloading (HTTP 503).

    Attributes:
        retry_after_s: When the server knows when trying again can help (the back-off of a
            failed load on demand), seconds (HTTP ``Retry-After``, gRPC ``retry-after``
            metadata); None otherwise.
    """

    reason = "not_ready"

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class OverloadedError(GpuserveError):
    """Admission refused: the model's queue is full (HTTP 429 with ``Retry-After``).

    Attributes:
        retry_after_s: Suggested client back-off, seconds.
    """

    reason = "rejected"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTimeoutError(GpuserveError):
    """The request's deadline passed while it waited in the queue; it was not run (HTTP 503)."""

    reason = "timeout"


class CancelledRequestError(GpuserveError):
    """The client went away before the request ran; it was removed from the queue."""

    reason = "cancelled"


class BackendError(GpuserveError):
    """The model raised, or returned outputs that do not fit the batch (HTTP 500)."""

    reason = "backend_error"


class RepositoryPollError(BackendError):
    """Files sent with a load request cannot be laid out as a model folder (a path that is
    absolute, holds ``..`` or a component over 255 bytes): HTTP 500, gRPC INTERNAL, with
    Triton's ``failed to poll from model repository`` wording, as Triton answers it."""

    reason = "repository_poll"


class OutOfMemoryError(GpuserveError):
    """The device ran out of memory for this request even after the batch was split; the
    allocator cache was freed and a retry may succeed (HTTP 503, gRPC RESOURCE_EXHAUSTED)."""

    reason = "out_of_memory"


class UnavailableError(GpuserveError):
    """The server is shutting down or otherwise cannot take the request (HTTP 503)."""

    reason = "unavailable"


class UnauthenticatedError(GpuserveError):
    """The call needs a bearer token it did not carry, or carried a wrong one (HTTP 401 with
    ``WWW-Authenticate: Bearer``, gRPC UNAUTHENTICATED)."""

    reason = "unauthorized"


class PermissionDeniedError(GpuserveError):
    """The call is refused whatever the token: model management is disabled on this server
    (HTTP 403, gRPC PERMISSION_DENIED)."""

    reason = "forbidden"


class ConfigError(GpuserveError):
    """A model configuration or repository layout is invalid.

    The message names the file, the field, the value given and what is allowed.
    """

    reason = "config"
