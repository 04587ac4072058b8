"""Errors of the OpenAI-compatible API in OpenAI's schema.

Body: ``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``. The status is
the one of :mod:`gpuserve.server.status` (the one table from gpuserve errors to statuses;
more inputs than one call may carry is 413 there, as on every API). The ``type`` and
``code`` follow OpenAI's where it has them, so the ``openai`` client raises the matching
exception class:

======  ==========================  =====================  ===============================
status  type                        code                   ``openai`` client raises
======  ==========================  =====================  ===============================
400     invalid_request_error       null                   BadRequestError
401     invalid_request_error       invalid_api_key        AuthenticationError
403     invalid_request_error       forbidden              PermissionDeniedError
404     invalid_request_error       model_not_found        NotFoundError
405     invalid_request_error       method_not_allowed     APIStatusError
413     invalid_request_error       request_too_large      APIStatusError
429     rate_limit_error            rate_limit_exceeded    RateLimitError (Retry-After)
500     server_error                null                   InternalServerError
503     server_error                the error's reason     InternalServerError
======  ==========================  =====================  ===============================

``param`` names the request field at fault where the codec knows it. Messages never carry a
stack trace; the caller passes them through the repository-path redactor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import orjson

from gpuserve.errors import GpuserveError, UnauthenticatedError
from gpuserve.server.status import http_status
from gpuserve.service.constants import retry_after_s

logger = logging.getLogger(__name__)

Header = tuple[bytes, bytes]

_TYPE_CODE: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("invalid_request_error", "forbidden"),
    404: ("invalid_request_error", "model_not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    499: ("invalid_request_error", "cancelled"),
    500: ("server_error", None),
}


class OpenAIHttpError(Exception):
    """A failure of the HTTP layer itself (unknown path, wrong method), with its status."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


@dataclass(slots=True)
class ErrorAnswer:
    """What to send for one error.

    Attributes:
        status: HTTP status.
        message: For the client (not yet redacted).
        type / code / param: OpenAI's error fields.
        headers: ``Retry-After`` for 429, ``WWW-Authenticate`` for 401.
    """

    status: int
    message: str
    type: str
    code: str | None = None
    param: str | None = None
    headers: list[Header] = field(default_factory=list)

    def body(self, message: str | None = None) -> bytes:
        """The JSON body (``message`` replaces :attr:`message`, e.g. redacted)."""
        error = {
            "message": self.message if message is None else message,
            "type": self.type,
            "param": self.param,
            "code": self.code,
        }
        return orjson.dumps({"error": error})


#: Paths whose errors take OpenAI's shape, even those the HTTP transport answers itself.
OPENAI_PREFIX = "/v1/"


def transport_error_body(status: int, message: str) -> bytes:
    """OpenAI's error body for a refusal of the HTTP transport (413 body too large, 431,
    400 unparseable), for a request to an OpenAI path."""
    kind, code = _TYPE_CODE.get(status, ("invalid_request_error", None))
    return ErrorAnswer(status, message, kind, code).body()


def error_answer(err: BaseException) -> ErrorAnswer:
    """The status, OpenAI error fields and headers for ``err`` (500 for a bug, logged)."""
    if isinstance(err, GpuserveError):
        status = http_status(err)
        kind, code = _TYPE_CODE.get(status, ("server_error", err.reason))
        answer = ErrorAnswer(status, err.message, kind, code, getattr(err, "param", None))
        retry = retry_after_s(err)
        if retry is not None:
            answer.headers.append((b"retry-after", str(retry).encode()))
        elif isinstance(err, UnauthenticatedError):
            answer.headers.append((b"www-authenticate", b"Bearer"))
        return answer
    if isinstance(err, OpenAIHttpError):
        kind = _TYPE_CODE.get(err.status, ("server_error", None))[0]
        return ErrorAnswer(err.status, err.message, kind, err.code)
    logger.error("unhandled error in the OpenAI API", exc_info=(type(err), err, err.__traceback__))
    return ErrorAnswer(500, "internal server error", "server_error")
