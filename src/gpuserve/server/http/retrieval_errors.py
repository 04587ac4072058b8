"""Errors of the retrieval APIs in their clients' shapes.

TEI's routes (``/rerank``, ``/predict``, ``/embed``, ``/embed_sparse``, ``/tokenize``,
``/similarity``, ``POST /``) answer ``{"error": message, "error_type": type}`` with TEI's
statuses; the rerank API of Cohere/Jina (``/v1/rerank``, ``/v2/rerank``) answers
``{"message": message}`` with the status of :mod:`gpuserve.server.status` (the one table),
which the ``cohere`` SDK turns into its ``BadRequestError``, ``NotFoundError``,
``TooManyRequestsError``, ... ::

    error                                 TEI status  error_type   Cohere status
    empty input                           400         Empty        400
    more inputs than one call may carry   413         Validation   413
    other bad input, too long             413         Validation   400
    unknown model / kind                  404         Validation   404
    overloaded (queue full)               429         Overloaded   429
    not ready, shutting down              503         Unhealthy    503
    model failure                         424         Backend      500

Messages never carry a stack trace and pass through the repository-path redactor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import orjson

from gpuserve.errors import (
    GpuserveError,
    InvalidInputError,
    ModelNotFoundError,
    OverloadedError,
    UnauthenticatedError,
)
from gpuserve.protocol.retrieval_codec import RetrievalInputError
from gpuserve.server.security import Redactor
from gpuserve.server.status import http_status
from gpuserve.service.constants import retry_after_s

logger = logging.getLogger(__name__)

Header = tuple[bytes, bytes]


@dataclass(slots=True)
class RetrievalError:
    """What to send for one error: status, body and headers."""

    status: int
    body: bytes
    headers: list[Header] = field(default_factory=list)


def _headers(err: GpuserveError) -> list[Header]:
    retry = retry_after_s(err)
    if retry is not None:
        return [(b"retry-after", str(retry).encode())]
    if isinstance(err, UnauthenticatedError):
        return [(b"www-authenticate", b"Bearer")]
    return []


def _unexpected(err: BaseException) -> None:
    logger.error("unhandled error in a retrieval API", exc_info=(type(err), err, err.__traceback__))


def tei_error(err: BaseException, redactor: Redactor) -> RetrievalError:
    """TEI's status and body for ``err`` (500 for a bug, logged)."""
    if not isinstance(err, GpuserveError):
        _unexpected(err)
        return RetrievalError(500, _tei("internal server error", "Backend"))
    message = redactor.text(err.message)
    if isinstance(err, RetrievalInputError) and err.empty:
        status, kind = 400, "Empty"
    elif isinstance(err, InvalidInputError):
        status, kind = 413, "Validation"
    elif isinstance(err, ModelNotFoundError):
        status, kind = 404, "Validation"
    elif isinstance(err, OverloadedError):
        status, kind = 429, "Overloaded"
    else:
        status = http_status(err)
        kind = "Unhealthy" if status == 503 else "Backend"
        if status == 500:
            status = 424
        elif status in (401, 403, 499):
            kind = "Validation"
    return RetrievalError(status, _tei(message, kind), _headers(err))


def _tei(message: str, kind: str) -> bytes:
    return orjson.dumps({"error": message, "error_type": kind})


def cohere_error(err: BaseException, redactor: Redactor) -> RetrievalError:
    """Cohere's status and body for ``err`` (500 for a bug, logged)."""
    if not isinstance(err, GpuserveError):
        _unexpected(err)
        return RetrievalError(500, orjson.dumps({"message": "internal server error"}))
    body = orjson.dumps({"message": redactor.text(err.message)})
    return RetrievalError(http_status(err), body, _headers(err))
