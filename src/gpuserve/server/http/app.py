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

The routing is a few string comparisons rather than a framework router, because it sits on
the per-request hot path. Errors are ``{"error": "..."}`` with the status from
:mod:`gpuserve.server.status`; no stack trace ever reaches a client.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

import gpuserve
from gpuserve.config import ServerConfig
from gpuserve.engine.stats import RequestStats
from gpuserve.errors import GpuserveError, InvalidInputError, ModelNotFoundError, OverloadedError
from gpuserve.protocol import decode_infer_request, encode_infer_response, parse_header_length
from gpuserve.repository.manager import ModelManager, ModelVersion
from gpuserve.server.status import http_status

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

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class HttpApp:
    """The ASGI application.

    Args:
        manager: The model manager requests are routed to.
        config: Server settings (body size limit).
        on_startup / on_shutdown: Awaited from the ASGI lifespan protocol.
    """

    def __init__(
        self,
        manager: ModelManager,
        config: ServerConfig,
        on_startup: Callable[[], Awaitable[None]] | None = None,
        on_shutdown: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.manager = manager
        self.config = config
        self.on_startup = on_startup
        self.on_shutdown = on_shutdown
        self.max_body = config.max_request_body_bytes

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
            if method == "POST" and path.endswith("/infer"):
                body = await self._read_body(scope, receive)
                status, payload, content_type, extra_headers = await self._infer(scope, path, body)
            else:
                if method == "POST":
                    await self._read_body(scope, receive)
                status, payload = self._route(method, path)
                content_type = JSON
        except GpuserveError as err:
            status, content_type = http_status(err), JSON
            payload = orjson.dumps({"error": err.message})
            if isinstance(err, OverloadedError):
                extra_headers = [(b"retry-after", str(max(1, round(err.retry_after_s))).encode())]
        except HttpError as err:
            status, content_type = err.status, JSON
            payload = orjson.dumps({"error": err.message})
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
        if access_logger.isEnabledFor(logging.DEBUG):
            access_logger.debug(
                "%s %s %d %d bytes %.2f ms",
                method,
                path,
                status,
                len(payload),
                (time.monotonic() - started) * 1000,
            )

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
        self, scope: Scope, path: str, body: bytes
    ) -> tuple[int, bytes, bytes, list[tuple[bytes, bytes]]]:
        name, version, rest = _split_model_path(path)
        if rest != "infer":
            raise HttpError(404, f"unknown path {path}")
        mv = self.manager.version(name, version)
        scheduler = mv.scheduler
        assert scheduler is not None
        header_value = None
        for key, value in scope["headers"]:
            if key == b"inference-header-content-length":
                header_value = value.decode("latin-1")
                break
        try:
            decoded = decode_infer_request(
                body, parse_header_length(header_value), mv.config, name, version
            )
        except InvalidInputError as err:
            scheduler.stats.record_request(
                RequestStats(name, scheduler.version, 0, 0.0, 0.0, 0.0, err.reason)
            )
            raise
        response = await scheduler.infer(decoded.request)
        encoded = encode_infer_response(response, decoded.output_options, mv.config)
        timing = response.timing
        headers = [
            (b"x-queue-time-us", str(int(timing.queue_s * 1e6)).encode()),
            (b"x-compute-time-us", str(int(timing.compute_s * 1e6)).encode()),
        ]
        if encoded.header_length is not None:
            headers.append(
                (b"inference-header-content-length", str(encoded.header_length).encode())
            )
        return 200, encoded.body, encoded.content_type.encode(), headers

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
            if path == "/v2/models/stats":
                return 200, orjson.dumps({"model_stats": self._stats(None, None)})
            if path.startswith("/v2/models/"):
                name, version, rest = _split_model_path(path)
                if rest == "":
                    return 200, orjson.dumps(self._metadata(name, version))
                if rest == "ready":
                    return self._ready(name, version)
                if rest == "config":
                    return 200, orjson.dumps(self._config(name, version))
                if rest == "stats":
                    return 200, orjson.dumps({"model_stats": self._stats(name, version)})
        elif method == "POST" and path == "/v2/repository/index":
            return 200, orjson.dumps(self.manager.index())
        if path.startswith("/v2"):
            raise HttpError(
                404 if method in ("GET", "POST") else 405, f"no endpoint {method} {path}"
            )
        raise HttpError(404, f"no endpoint {method} {path}")

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
