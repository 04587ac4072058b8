"""KServe V2 (Open Inference Protocol) over HTTP/REST: the request handler.

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
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import orjson

import gpuserve
from gpuserve.config import ModelConfig, ServerConfig
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
from gpuserve.server.http.connection import JSON, HttpRequest
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
    from gpuserve.engine.request import InferenceResponse
    from gpuserve.metrics import ServerMetrics

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("gpuserve.access")

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
    """The request handler of the REST front end (see :mod:`gpuserve.server.http.connection`
    for the HTTP/1.1 transport that calls it).

    Args:
        manager: The model manager requests are routed to.
        config: Server settings (API tokens, limits, access log).
        metrics: Serves ``GET /metrics`` and counts requests refused before they reach a
            model version; None for neither.
    """

    def __init__(
        self,
        manager: ModelManager,
        config: ServerConfig,
        metrics: ServerMetrics | None = None,
    ) -> None:
        self.manager = manager
        self.metrics = metrics
        self.access_log = config.access_log
        self.config = config
        self.repository = RepositoryApi(manager, config)
        self.tokens = Tokens(config)
        self.redactor = Redactor(config.model_repository)
        self.limits = RequestLimits(config.max_tensor_elements, config.max_bytes_element_bytes)
        self._tasks: set[asyncio.Task[None]] = set()

    # -- request handling ------------------------------------------------------------------

    def handle(self, request: HttpRequest) -> None:
        """Answer ``request``: at once, or (inference, ``/metrics``, repository calls) when
        its work is done. Never raises."""
        method = "GET" if request.method == "HEAD" else request.method  # the body is dropped
        path = request.path
        try:
            if (
                self.tokens.api is not None
                and path not in OPEN_HTTP_PATHS
                and not self.repository.handles(path)
                and not self.tokens.allows_api(request.headers)
            ):
                raise HttpError(
                    401,
                    "this endpoint needs 'Authorization: Bearer <API token>'",
                    [(b"www-authenticate", b"Bearer")],
                )
            if method == "POST" and path.endswith("/infer"):
                self._infer(request)
                return
            if method == "GET" and path == "/metrics" and self.metrics is not None:
                self._spawn(self._metrics(request))
                return
            if method == "POST" and self.repository.handles(path):
                self._spawn(self._repository(request))
                return
            status, payload = self._route(method, path)
        except Exception as err:
            self._fail(request, err)
            return
        self._send(request, status, payload)

    def _send(
        self,
        request: HttpRequest,
        status: int,
        payload: bytes,
        content_type: bytes = JSON,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        request.respond(status, payload, content_type, headers or ())
        if self.access_log:
            _log_access(request, status, len(payload), time.monotonic() - request.started_s)

    def _fail(self, request: HttpRequest, err: BaseException) -> None:
        """Answer ``request`` with the status and JSON error for ``err``."""
        headers: list[tuple[bytes, bytes]] = []
        if isinstance(err, GpuserveError):
            status = http_status(err)
            message = err.message
            if isinstance(err, OverloadedError):
                headers = [(b"retry-after", str(max(1, round(err.retry_after_s))).encode())]
        elif isinstance(err, HttpError):
            status, message, headers = err.status, err.message, err.headers
            if request.method == "POST" and request.path.endswith("/infer"):  # path, token
                self._count_unrouted(
                    request.path, None, "unauthorized" if status == 401 else "invalid"
                )
        else:  # a bug: log it, never leak it
            logger.error(
                "unhandled error serving %s %s",
                request.method,
                request.path,
                exc_info=(type(err), err, err.__traceback__),
            )
            status, message = 500, "internal server error"
        self._send(
            request, status, orjson.dumps({"error": self.redactor.text(message)}), JSON, headers
        )

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._tasks.discard)

    def _infer(self, request: HttpRequest) -> None:
        """Decode and queue an inference request; :meth:`_infer_done` answers it. No task
        is created per request: the scheduler's future calls back."""
        name, version, rest = _split_model_path(request.path)
        if rest != "infer":
            raise HttpError(404, f"unknown path {request.path}")
        try:
            check_version_label(name, version)
            mv = self.manager.version(name, version)
        except GpuserveError as err:
            self._count_unrouted(name, version, err.reason)
            raise
        scheduler = mv.scheduler
        assert scheduler is not None
        header_value = request.header(b"inference-header-content-length")
        try:
            decoded = decode_infer_request(
                request.body,
                parse_header_length(
                    None if header_value is None else header_value.decode("latin-1")
                ),
                mv.config,
                name,
                version,
                self.limits,
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
        request.access = (name, scheduler.version, decoded.request)
        # A request whose client disconnects while it waits is dropped when its batch forms,
        # so it never runs (BC-11). The check reads the connection's state lazily: watching
        # each connection would cost more than the check.
        decoded.request.is_cancelled = request.is_disconnected
        future = scheduler.submit(decoded.request)
        future.add_done_callback(
            lambda done: self._infer_done(request, done, decoded.output_options, mv.config)
        )

    def _infer_done(
        self,
        request: HttpRequest,
        future: asyncio.Future[InferenceResponse],
        output_options: Any,
        config: ModelConfig,
    ) -> None:
        try:
            response = future.result()
            encoded = encode_infer_response(response, output_options, config)
        except BaseException as err:
            self._fail(request, err)
            return
        timing = response.timing
        headers = [
            (QUEUE_TIME_US_HEADER, microseconds(timing.queue_s).encode()),
            (COMPUTE_TIME_US_HEADER, microseconds(timing.compute_s).encode()),
        ]
        if encoded.header_length is not None:
            headers.append(
                (b"inference-header-content-length", str(encoded.header_length).encode())
            )
        headers.append(
            (TOTAL_TIME_US_HEADER, microseconds(time.monotonic() - request.started_s).encode())
        )
        self._send(request, 200, encoded.body, encoded.content_type.encode(), headers)

    async def _metrics(self, request: HttpRequest) -> None:
        """``GET /metrics``: rendered off the event loop (NVML reads can take milliseconds)."""
        from gpuserve.metrics import render

        assert self.metrics is not None
        accept = request.header(b"accept")
        loop = asyncio.get_running_loop()
        try:
            body, content_type = await loop.run_in_executor(
                None,
                render,
                self.metrics.registry,
                "" if accept is None else accept.decode("latin-1"),
            )
        except Exception as err:
            self._fail(request, err)
            return
        self._send(request, 200, body, content_type.encode())

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

    async def _repository(self, request: HttpRequest) -> None:
        path = request.path
        try:
            status, payload = await self.repository.handle(path, request.headers, request.body)
        except ManagementDenied as err:
            headers = [(b"www-authenticate", b"Bearer")] if err.status == 401 else []
            self._send(request, err.status, orjson.dumps({"error": err.message}), JSON, headers)
            return
        except LookupError:
            self._fail(request, HttpError(404, f"no endpoint POST {path}"))
            return
        except Exception as err:
            self._fail(request, err)
            return
        self._send(request, status, self.redactor.json(payload))

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


def _log_access(request: HttpRequest, status: int, size: int, total_s: float) -> None:
    """One ``gpuserve.access`` line: client, request line, status, model, version, rows, input
    shapes (never contents), response bytes and total milliseconds; the same fields go to JSON
    logs as keys."""
    if not access_logger.isEnabledFor(logging.INFO):
        return
    client = request.client
    peer = f"{client[0]}:{client[1]}" if client else "-"
    info = request.access
    model = version = "-"
    rows = 0
    shapes: dict[str, list[int]] = {}
    if info is not None:
        model, version, inference = info
        shapes = {name: list(array.shape) for name, array in inference.inputs.items()}
        first = next(iter(shapes.values()), None)
        rows = first[0] if first else 1
    elif request.path.startswith("/v2/models/"):
        model = request.path.split("/")[3] or "-"
    total_ms = round(total_s * 1000, 3)
    access_logger.info(
        '%s "%s %s" %d model=%s version=%s rows=%d shapes=%s bytes=%d %.3f ms',
        peer,
        request.method,
        request.path,
        status,
        model,
        version,
        rows,
        shapes,
        size,
        total_ms,
        extra={
            "client": peer,
            "method": request.method,
            "path": request.path,
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
