"""KServe V2 (Open Inference Protocol) over HTTP/REST, as a bare ASGI application.

Endpoints (V2 core, plus Triton's model-configuration, statistics and repository-index
extensions):

    GET  /v2/health/live                      200 while the process serves HTTP
    GET  /v2/health/ready                     200 when ready (rule: ModelManager.is_ready)
    GET  /v2                                  server metadata
    GET  /v2/models/{m}[/versions/{v}]        model metadata
    GET  /v2/models/{m}[/versions/{v}]/ready  model readiness
    POST /v2/models/{m}[/versions/{v}]/infer  inference (JSON or binary tensor extension)
    GET  /v2/models/{m}[/versions/{v}]/config the model's configuration
    GET  /v2/models[/{m}[/versions/{v}]]/stats statistics extension
    POST /v2/repository/index                 every model version and its state
    POST /v2/repository/models/{m}/...        load, unload, rollback, canary (see
                                              gpuserve.server.http.repository)
    GET  /v2/openapi.json                     this API as an OpenAPI 3 document
    GET  /metrics                             Prometheus metrics

With an API token configured, every endpoint but the health checks, ``/metrics`` and
``/v2/openapi.json`` needs ``Authorization: Bearer <token>`` (401 without it; see
:mod:`gpuserve.server.security`). Error bodies and load-failure reasons never carry file paths
outside the repository-relative part.

The routing is a few string comparisons rather than a framework router, because it sits on
the per-request hot path. Errors are ``{"error": "..."}`` with the status from
:mod:`gpuserve.server.status`; no stack trace ever reaches a client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson

import gpuserve
from gpuserve.config import ServerConfig
from gpuserve.engine.stats import RequestStats
from gpuserve.errors import (
    GpuserveError,
    ModelNotFoundError,
    OverloadedError,
    UnavailableError,
)
from gpuserve.protocol import decode_infer_request, encode_infer_response, parse_header_length
from gpuserve.protocol.limits import RequestLimits
from gpuserve.repository.manager import ModelManager, ModelVersion
from gpuserve.server.http.openapi import openapi_json
from gpuserve.server.http.repository import ManagementDenied, RepositoryApi
from gpuserve.server.security import OPEN_HTTP_PATHS, Redactor, Tokens, check_version_label
from gpuserve.server.status import http_status
from gpuserve.server.timing import (
    COMPUTE_TIME_US_HEADER,
    QUEUE_TIME_US_HEADER,
    TOTAL_TIME_US_HEADER,
    microseconds,
)

if TYPE_CHECKING:
    from gpuserve.metrics import ServerMetrics

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("gpuserve.access")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

JSON = b"application/json"
_EXTENSIONS = ["binary_tensor_data", "statistics", "model_configuration", "model_repository"]
_PLATFORM = {"python": "python", "torch": "pytorch_libtorch"}


class HttpError(Exception):
    """A protocol-level failure that is not a GpuserveError (bad route, body too large)."""

    def __init__(
        self, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or []


class HttpApp:
    """The ASGI application.

    Args:
        manager: The model manager requests are routed to.
        config: Server settings (body size limit).
        on_startup / on_shutdown: Awaited from the ASGI lifespan protocol.
        metrics: Serves ``GET /metrics`` and counts requests refused before they reach a
            model version; None for neither.
    """

    def __init__(
        self,
        manager: ModelManager,
        config: ServerConfig,
        on_startup: Callable[[], Awaitable[None]] | None = None,
        on_shutdown: Callable[[], Awaitable[None]] | None = None,
        metrics: ServerMetrics | None = None,
    ) -> None:
        self.manager = manager
        self.metrics = metrics
        self.access_log = config.access_log
        self.config = config
        self.on_startup = on_startup
        self.on_shutdown = on_shutdown
        self.max_body = config.max_request_body_bytes
        self.repository = RepositoryApi(manager, config)
        self.tokens = Tokens(config)
        self.redactor = Redactor(config.model_repository)
        self.limits = RequestLimits(config.max_tensor_elements, config.max_bytes_element_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                if self.on_startup is not None:
                    await self.on_startup()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.on_shutdown is not None:
                    await self.on_shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- request handling ------------------------------------------------------------------

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.monotonic()
        method: str = scope["method"]
        path: str = scope["path"]
        extra_headers: list[tuple[bytes, bytes]] = []
        try:
            if (
                self.tokens.api is not None
                and path not in OPEN_HTTP_PATHS
                and not self.repository.handles(path)
                and not self.tokens.allows_api(scope["headers"])
            ):
                raise HttpError(
                    401,
                    "this endpoint needs 'Authorization: Bearer <API token>'",
                    [(b"www-authenticate", b"Bearer")],
                )
            if method == "POST" and path.endswith("/infer"):
                body = await self._read_body(scope, receive)
                status, payload, content_type, extra_headers = await self._infer(
                    scope, receive, path, body
                )
                total = microseconds(time.monotonic() - started).encode()
                extra_headers.append((TOTAL_TIME_US_HEADER, total))
            elif method == "GET" and path == "/metrics" and self.metrics is not None:
                status, payload, content_type = 200, *await self._metrics(scope)
            elif method == "POST" and self.repository.handles(path):
                body = await self._read_body(scope, receive)
                status, payload, extra_headers = await self._repository(scope, path, body)
                content_type = JSON
            else:
                if method == "POST":
                    await self._read_body(scope, receive)
                status, payload = self._route(method, path)
                content_type = JSON
        except GpuserveError as err:
            status, content_type = http_status(err), JSON
            payload = orjson.dumps({"error": self.redactor.text(err.message)})
            if isinstance(err, OverloadedError):
                extra_headers = [(b"retry-after", str(max(1, round(err.retry_after_s))).encode())]
        except HttpError as err:
            status, content_type = err.status, JSON
            payload = orjson.dumps({"error": self.redactor.text(err.message)})
            extra_headers = err.headers
            if method == "POST" and path.endswith("/infer"):  # body too large, bad path, token
                self._count_unrouted(path, None, "unauthorized" if status == 401 else "invalid")
        except Exception:  # a bug: log it, never leak it
            logger.exception("unhandled error serving %s %s", method, path)
            status, content_type = 500, JSON
            payload = orjson.dumps({"error": "internal server error"})
        headers = [
            (b"content-type", content_type),
            (b"content-length", str(len(payload)).encode()),
            *extra_headers,
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
        if self.access_log:
            _log_access(scope, status, len(payload), time.monotonic() - started)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body:
                raise HttpError(
                    413,
                    f"request body of {int(value)} bytes exceeds the limit "
                    f"of {self.max_body} bytes (max_request_body_bytes)",
                )
        message = await receive()
        body = message.get("body", b"")
        if not message.get("more_body", False):
            return body
        chunks = [body]
        size = len(body)
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise HttpError(400, "client disconnected while sending the body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise HttpError(
                    413,
                    f"request body exceeds the limit of {self.max_body} bytes "
                    "(max_request_body_bytes)",
                )
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _infer(
        self, scope: Scope, receive: Receive, path: str, body: bytes
    ) -> tuple[int, bytes, bytes, list[tuple[bytes, bytes]]]:
        name, version, rest = _split_model_path(path)
        if rest != "infer":
            raise HttpError(404, f"unknown path {path}")
        try:
            check_version_label(name, version)
            mv = self.manager.version(name, version)
        except GpuserveError as err:
            self._count_unrouted(name, version, err.reason)
            raise
        scheduler = mv.scheduler
        assert scheduler is not None
        header_value = None
        for key, value in scope["headers"]:
            if key == b"inference-header-content-length":
                header_value = value.decode("latin-1")
                break
        try:
            decoded = decode_infer_request(
                body, parse_header_length(header_value), mv.config, name, version, self.limits
            )
            if self.manager.shutting_down:
                raise UnavailableError("server is shutting down; retry on another replica")
        except GpuserveError as err:  # counted here: it never reaches the scheduler
            scheduler.stats.record_request(
                RequestStats(name, scheduler.version, 0, 0.0, 0.0, 0.0, err.reason)
            )
            raise
        if version is None:  # a canary may take this request (by a hash of its id)
            routed = self.manager.split(mv, decoded.request.id)
            if routed is not mv and routed.scheduler is not None:
                mv, scheduler = routed, routed.scheduler
        scope["gpuserve.access"] = (name, scheduler.version, decoded.request)
        # A request whose client disconnects while it waits is dropped when its batch forms,
        # so it never runs (BC-11). The check reads the connection's state lazily: watching
        # each connection with its own task would halve the request rate.
        decoded.request.is_cancelled = _disconnect_probe(receive)
        response = await scheduler.infer(decoded.request)
        encoded = encode_infer_response(response, decoded.output_options, mv.config)
        timing = response.timing
        headers = [
            (QUEUE_TIME_US_HEADER, microseconds(timing.queue_s).encode()),
            (COMPUTE_TIME_US_HEADER, microseconds(timing.compute_s).encode()),
        ]
        if encoded.header_length is not None:
            headers.append(
                (b"inference-header-content-length", str(encoded.header_length).encode())
            )
        return 200, encoded.body, encoded.content_type.encode(), headers

    async def _metrics(self, scope: Scope) -> tuple[bytes, bytes]:
        """``GET /metrics``: rendered off the event loop (NVML reads can take milliseconds)."""
        from gpuserve.metrics import render

        assert self.metrics is not None
        accept = ""
        for key, value in scope["headers"]:
            if key == b"accept":
                accept = value.decode("latin-1")
        loop = asyncio.get_running_loop()
        body, content_type = await loop.run_in_executor(None, render, self.metrics.registry, accept)
        return body, content_type.encode()

    def _count_unrouted(self, name_or_path: str, version: str | None, reason: str) -> None:
        """Count a failed inference request that never reached a model version."""
        if self.metrics is None:
            return
        if name_or_path.startswith("/"):
            parts = name_or_path.split("/")  # ['', 'v2', 'models', name, ...]
            name_or_path = parts[3] if len(parts) > 3 else ""
        self.metrics.record_unrouted(name_or_path, version, reason)

    def _route(self, method: str, path: str) -> tuple[int, bytes]:
        path = path.rstrip("/") or "/"
        if method == "GET":
            if path == "/v2/health/live":
                return 200, b'{"live":true}'
            if path == "/v2/health/ready":
                ready = self.manager.is_ready()
                return (200 if ready else 503), orjson.dumps({"ready": ready})
            if path == "/v2":
                return 200, orjson.dumps(
                    {"name": "gpuserve", "version": gpuserve.__version__, "extensions": _EXTENSIONS}
                )
            if path == "/v2/openapi.json":
                return 200, openapi_json()
            if path == "/v2/models/stats":
                return 200, orjson.dumps({"model_stats": self._stats(None, None)})
            if path.startswith("/v2/models/"):
                name, version, rest = _split_model_path(path)
                check_version_label(name, version)
                if rest == "":
                    return 200, self.redactor.json(orjson.dumps(self._metadata(name, version)))
                if rest == "ready":
                    status, body = self._ready(name, version)
                    return status, self.redactor.json(body)
                if rest == "config":
                    return 200, orjson.dumps(self._config(name, version))
                if rest == "stats":
                    return 200, orjson.dumps({"model_stats": self._stats(name, version)})
        if path.startswith("/v2"):
            raise HttpError(
                404 if method in ("GET", "POST") else 405, f"no endpoint {method} {path}"
            )
        raise HttpError(404, f"no endpoint {method} {path}")

    async def _repository(
        self, scope: Scope, path: str, body: bytes
    ) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        try:
            status, payload = await self.repository.handle(path, scope["headers"], body)
        except ManagementDenied as err:
            headers = [(b"www-authenticate", b"Bearer")] if err.status == 401 else []
            return err.status, orjson.dumps({"error": err.message}), headers
        except LookupError:
            raise HttpError(404, f"no endpoint POST {path}") from None
        return status, self.redactor.json(payload), []

    # -- endpoint bodies -------------------------------------------------------------------

    def _lookup(self, name: str, version: str | None) -> tuple[Any, list[ModelVersion]]:
        model = self.manager.model(name)
        if version is None:
            return model, list(model.versions.values())
        if not version.isdigit() or int(version) not in model.versions:
            raise ModelNotFoundError(
                f"model '{name}' has no version '{version}' (versions: {sorted(model.versions)})"
            )
        return model, [model.versions[int(version)]]

    def _metadata(self, name: str, version: str | None) -> dict[str, Any]:
        model, versions = self._lookup(name, version)
        config = model.config
        if config is None:
            raise self._not_ready(name, model.error)
        batch = [-1] if config.max_batch_size else []
        return {
            "name": name,
            "versions": [str(mv.version) for mv in versions],
            "version_states": [  # gpuserve: state, reason and traffic share of each version
                row
                for row in self.manager.status(name)["versions"]
                if version is None or row["version"] == version
            ],
            "platform": _PLATFORM.get(config.backend, config.backend),
            "inputs": [
                {"name": t.name, "datatype": t.datatype, "shape": batch + list(t.shape)}
                for t in config.inputs
            ],
            "outputs": [
                {"name": t.name, "datatype": t.datatype, "shape": batch + list(t.shape)}
                for t in config.outputs
            ],
        }

    def _not_ready(self, name: str, reason: str | None) -> GpuserveError:
        from gpuserve.errors import ModelNotReadyError

        return ModelNotReadyError(f"model '{name}' is not ready: {reason}")

    def _ready(self, name: str, version: str | None) -> tuple[int, bytes]:
        try:
            self.manager.version(name, version)
        except ModelNotFoundError:
            raise
        except GpuserveError as err:
            return 503, orjson.dumps({"ready": False, "reason": err.message})
        return 200, b'{"ready":true}'

    def _config(self, name: str, version: str | None) -> dict[str, Any]:
        model, _ = self._lookup(name, version)
        if model.config is None:
            raise self._not_ready(name, model.error)
        config = model.config.model_dump(mode="json")
        config["platform"] = _PLATFORM.get(model.config.backend, model.config.backend)
        return config

    def _stats(self, name: str | None, version: str | None) -> list[dict[str, Any]]:
        if name is None:
            versions = [mv for m in self.manager.models.values() for mv in m.versions.values()]
        else:
            _, versions = self._lookup(name, version)
        return [mv.scheduler.stats.as_dict() for mv in versions if mv.scheduler is not None]


def _disconnect_probe(receive: Receive) -> Callable[[], bool] | None:
    """A cheap "has the client gone?" check for the request that ``receive`` belongs to.

    uvicorn's ``receive`` is a method of its per-request cycle object, which records
    ``disconnected`` when the connection is lost. Servers without that attribute get no probe
    (requests then run even if their client left).
    """
    cycle = getattr(receive, "__self__", None)
    if cycle is None or not hasattr(cycle, "disconnected"):
        return None
    return lambda: bool(cycle.disconnected)


def _log_access(scope: Scope, status: int, size: int, total_s: float) -> None:
    """One ``gpuserve.access`` line: client, request line, status, model, version, rows, input
    shapes (never contents), response bytes and total milliseconds; the same fields go to JSON
    logs as keys."""
    if not access_logger.isEnabledFor(logging.INFO):
        return
    client = scope.get("client")
    peer = f"{client[0]}:{client[1]}" if client else "-"
    info = scope.get("gpuserve.access")
    model = version = "-"
    rows = 0
    shapes: dict[str, list[int]] = {}
    if info is not None:
        model, version, request = info
        shapes = {name: list(array.shape) for name, array in request.inputs.items()}
        first = next(iter(shapes.values()), None)
        rows = first[0] if first else 1
    elif scope["path"].startswith("/v2/models/"):
        model = scope["path"].split("/")[3] or "-"
    total_ms = round(total_s * 1000, 3)
    access_logger.info(
        '%s "%s %s" %d model=%s version=%s rows=%d shapes=%s bytes=%d %.3f ms',
        peer,
        scope["method"],
        scope["path"],
        status,
        model,
        version,
        rows,
        shapes,
        size,
        total_ms,
        extra={
            "client": peer,
            "method": scope["method"],
            "path": scope["path"],
            "status": status,
            "model": model,
            "version": version,
            "rows": rows,
            "shapes": shapes,
            "bytes": size,
            "total_ms": total_ms,
        },
    )


def _split_model_path(path: str) -> tuple[str, str | None, str]:
    """``/v2/models/m[/versions/v][/rest]`` -> (m, v or None, rest)."""
    parts = path.split("/")
    # ['', 'v2', 'models', name, ...]
    if len(parts) < 4 or not parts[3]:
        raise HttpError(404, f"no endpoint {path}")
    name = parts[3]
    tail = parts[4:]
    version = None
    if len(tail) >= 2 and tail[0] == "versions":
        version = tail[1]
        tail = tail[2:]
    return name, version, "/".join(tail)
