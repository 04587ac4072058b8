"""One client interface over both front ends, for the parametrised front-end suite
(``tests/integration/test_frontends_*.py``): each test takes the ``frontend`` fixture and runs
once over HTTP and once over gRPC, against the real server, asserting the same outcome class
(:class:`Status`, from one table of HTTP statuses and gRPC codes) and the same message.

What only one protocol has (HTTP transport, JSON and binary-extension specifics, gRPC streams,
malformed protobuf messages, metadata and trailers) stays in that protocol's own test files.
"""

from __future__ import annotations

from typing import Any

import httpx

from tests.integration.frontends.api import (
    HTTP_STATUS,
    Frontend,
    FrontendError,
    IndexRow,
    InferResult,
    ModelConfigView,
    ModelMetadata,
    ModelStats,
    ServerMetadata,
    Status,
    Tensor,
    TensorMetadata,
    attempt,
    status_of,
    tensor,
)
from tests.integration.frontends.grpc_frontend import GrpcFrontend
from tests.integration.frontends.http_frontend import TLS, HttpFrontend

__all__ = [
    "FRONTENDS",
    "HTTP_STATUS",
    "Frontend",
    "FrontendError",
    "GrpcFrontend",
    "HttpFrontend",
    "IndexRow",
    "InferResult",
    "ModelConfigView",
    "ModelMetadata",
    "ModelStats",
    "ServerMetadata",
    "Status",
    "Tensor",
    "TensorMetadata",
    "attempt",
    "failure_reasons",
    "open_frontend",
    "status_of",
    "tensor",
]

#: The ids of the ``frontend`` fixture's parameters.
FRONTENDS = ("http", "grpc")


def open_frontend(kind: str, server: Any, token: str | None = None) -> Frontend:
    """A client of ``server`` (a :class:`tests.helpers.InProcessServer` or
    :class:`~tests.helpers.SubprocessServer`) over ``kind`` ("http" or "grpc")."""
    if kind == "http":
        return HttpFrontend(server.url, token)
    if kind == "grpc":
        return GrpcFrontend(server.grpc_url, token)
    raise ValueError(f"unknown front end {kind!r}")


def failure_reasons(server: Any, model: str, token: str | None = None) -> dict[str, int]:
    """Failures of ``model``'s default version by reason (``invalid``, ``timeout``,
    ``cancelled``, ``backend_error``, ...): only the HTTP statistics carry them, so both
    protocols' tests read them here."""
    headers = {} if token is None else {"authorization": f"Bearer {token}"}
    url = f"{server.url}/v2/models/{model}/stats"
    response = httpx.get(url, headers=headers, timeout=10, verify=TLS)
    response.raise_for_status()
    return dict(response.json()["model_stats"][0]["failure_reasons"])
