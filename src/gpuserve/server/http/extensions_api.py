"""Triton's shared-memory, trace-setting and log-setting extensions over HTTP.

    GET  /v2/systemsharedmemory[/region/{r}]/status      registered regions (JSON array)
    POST /v2/systemsharedmemory/region/{r}/register      {"key": "/shm_key", "offset": 0,
                                                          "byte_size": 64}
    POST /v2/systemsharedmemory[/region/{r}]/unregister  one region, or every region
    GET  /v2/cudasharedmemory[/region/{r}]/status        (the same for CUDA regions;
    POST /v2/cudasharedmemory/region/{r}/register         {"raw_handle": {"b64": "..."},
    POST /v2/cudasharedmemory[/region/{r}]/unregister     "device_id": 0, "byte_size": 64})
    GET  /v2/trace/setting, /v2/models/{m}/trace/setting the trace settings in effect
    POST /v2/trace/setting, /v2/models/{m}/trace/setting {"trace_level": ["TIMESTAMPS"],
                                                          "trace_rate": "1", ...}
    GET  /v2/logging                                     the log settings
    POST /v2/logging                                     {"log_verbose_level": 1, ...}

The shared-memory endpoints answer 403 unless the server allows client shared memory
(``--allow-client-shm``). Success bodies of register/unregister are empty, as Triton's; errors
are ``{"error": "..."}`` with the status of the one error table.

The endpoints are the rows of :meth:`ExtensionsApi.routes`, a table the HTTP app mounts on the
paths :func:`handles` takes (a trailing "/" ignored); a path or method no row takes is 404.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import orjson

from gpuserve.errors import InvalidInputError
from gpuserve.server.http.request import HttpRequest
from gpuserve.server.http.routes import (
    GET,
    POST,
    Answer,
    Exact,
    Handler,
    HttpError,
    Params,
    Route,
    Router,
    Template,
)
from gpuserve.service.inference import InferenceService

_SHM = ("/v2/systemsharedmemory", "/v2/cudasharedmemory")
_TRACE = "/trace/setting"
_MODEL_TRACE = "/v2/models/{model}" + _TRACE


def handles(path: str) -> bool:
    """Whether ``path`` is below this API's mount (a few string tests; the table decides
    the rest)."""
    if path.startswith(_SHM) or path == "/v2/logging" or path == "/v2/trace/setting":
        return True
    return path.startswith("/v2/models/") and path.endswith(_TRACE)


def _json_object(body: bytes | bytearray, what: str) -> dict[str, Any]:
    if not body.strip():
        return {}
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as err:
        raise InvalidInputError(f"{what}: the body is not valid JSON: {err}") from None
    if type(document) is not dict:
        raise InvalidInputError(f"{what}: the body must be a JSON object")
    return document


def _integer(document: dict[str, Any], key: str, what: str, default: int | None = None) -> int:
    value = document.get(key, default)
    if type(value) is not int or value < 0:
        raise InvalidInputError(f"{what}: {key!r} must be a non-negative integer, got {value!r}")
    return value


class ExtensionsApi:
    """The table of the endpoints above for one inference service: :attr:`router`, the rows
    of :meth:`routes`.

    Args:
        service: The inference service (its :attr:`~InferenceService.extensions`).
    """

    def __init__(self, service: InferenceService) -> None:
        self.extensions = service.extensions
        #: The table the HTTP app mounts on :func:`handles` (V2's errors; a path no row
        #: takes is 404, whatever the method).
        self.router = Router(self.routes, self._miss, strip=True)

    def routes(self) -> list[Route]:
        """The endpoints, one row each (the paths without their trailing "/"s)."""
        rows = []
        for cuda, base in ((False, _SHM[0]), (True, _SHM[1])):
            region = base + "/region/{name}/"
            rows += [
                Route(GET, Exact(base + "/status"), self._shm("status", cuda)),
                Route(GET, Template(region + "status"), self._shm("status", cuda)),
                Route(POST, Template(region + "register"), self._shm("register", cuda)),
                Route(POST, Exact(base + "/unregister"), self._shm("unregister", cuda)),
                Route(POST, Template(region + "unregister"), self._shm("unregister", cuda)),
            ]
        return [
            *rows,
            Route(GET, Exact("/v2/logging"), self._logs),
            Route(POST, Exact("/v2/logging"), self._set_logs),
            Route(GET, Exact("/v2/trace/setting"), self._traces),
            Route(POST, Exact("/v2/trace/setting"), self._set_traces),
            Route(GET, Template(_MODEL_TRACE), self._traces),
            Route(POST, Template(_MODEL_TRACE), self._set_traces),
        ]

    def _miss(
        self, request: HttpRequest, method: str, path: str, allowed: frozenset[str] | None
    ) -> Answer:
        """404 ``no endpoint``, whatever the method (an unknown model's own 404 first)."""
        if allowed is not None and path.startswith("/v2/models/"):
            self.extensions.check_model(path.split("/")[3])
        raise HttpError(404, f"no endpoint {method} {request.path}")

    # -- the rows' handlers: (request, method, params), an answer (status, JSON body) -------

    def _logs(self, _request: HttpRequest, _method: str, _: Params) -> Answer:
        return 200, orjson.dumps(self.extensions.logs.get())

    def _set_logs(self, request: HttpRequest, _method: str, _: Params) -> Answer:
        changes = _json_object(request.body, "log settings")
        return 200, orjson.dumps(self.extensions.logs.update(changes))

    def _traces(self, _request: HttpRequest, _method: str, params: Params) -> Answer:
        """The trace settings: the server's (no params), or a model's."""
        model = self._trace_model(params)
        return 200, orjson.dumps(self.extensions.traces.get(model))

    def _set_traces(self, request: HttpRequest, _method: str, params: Params) -> Answer:
        model = self._trace_model(params)
        changes: dict[str, list[str] | None] = {}
        for key, value in _json_object(request.body, "trace settings").items():
            if value is None or (type(value) is list and all(type(v) is str for v in value)):
                changes[key] = value
            elif type(value) is str:
                changes[key] = [value]
            else:
                raise InvalidInputError(
                    f"trace setting {key!r} must be a string, a list of strings or null, "
                    f"got {value!r}"
                )
        return 200, orjson.dumps(self.extensions.traces.update(changes, model))

    def _trace_model(self, params: Params) -> str | None:
        """The model of a model's trace-setting row (checked: 404 unknown), else None."""
        if params is None:
            return None
        (model,) = params
        self.extensions.check_model(model)
        return str(model)

    def _shm(self, action: str, cuda: bool) -> Handler:
        """The handler of a shared-memory row: ``action`` on the system or CUDA registry,
        of one region (the row's ``{name}``) or of every one."""

        def handler(request: HttpRequest, _method: str, params: Params) -> Answer:
            name = params[0] if params else ""
            if cuda:
                return self._cuda(action, name, request.body)
            return self._system(action, name, request.body)

        return handler

    def _system(self, action: str, name: str, body: bytes | bytearray) -> Answer:
        registry = self.extensions.system_registry()
        if action == "status":
            return 200, orjson.dumps(registry.status(name or None))
        if action == "unregister":
            registry.unregister(name or None)
            return 200, b""
        what = f"register system shared-memory region {name!r}"
        document = _json_object(body, what)
        key = document.get("key")
        if type(key) is not str:
            raise InvalidInputError(f"{what}: 'key' must be a string, got {key!r}")
        registry.register(
            name,
            key,
            _integer(document, "offset", what, 0),
            _integer(document, "byte_size", what),
        )
        return 200, b""

    def _cuda(self, action: str, name: str, body: bytes | bytearray) -> Answer:
        registry = self.extensions.cuda_registry()
        if action == "status":
            return 200, orjson.dumps(registry.status(name or None))
        if action == "unregister":
            registry.unregister(name or None)
            return 200, b""
        what = f"register CUDA shared-memory region {name!r}"
        document = _json_object(body, what)
        device_id = _integer(document, "device_id", what, 0)
        byte_size = _integer(document, "byte_size", what, 0)
        registry.check_available(name, device_id, byte_size)  # the clear refusal comes first
        registry.register(name, _raw_handle(document, what), device_id, byte_size)
        return 200, b""


def _raw_handle(document: dict[str, Any], what: str) -> bytes:
    """The ``cudaIpcMemHandle_t`` bytes of ``{"raw_handle": {"b64": "..."}}``."""
    handle = document.get("raw_handle")
    encoded = handle.get("b64") if type(handle) is dict else None
    if type(encoded) is not str:
        raise InvalidInputError(
            f"{what}: 'raw_handle' must be {{'b64': <base64 of the cudaIpcMemHandle_t>}}, "
            f"got {handle!r}"
        )
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInputError(f"{what}: 'raw_handle.b64' is not valid base64") from None
