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
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import orjson

from gpuserve.errors import InvalidInputError
from gpuserve.service.inference import InferenceService

_SHM = ("/v2/systemsharedmemory", "/v2/cudasharedmemory")
_TRACE = "/trace/setting"


def handles(path: str) -> bool:
    """Whether ``path`` is one of these endpoints (a few string tests)."""
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
    """Handles the endpoints above for one inference service.

    Args:
        service: The inference service (its :attr:`~InferenceService.extensions`).
    """

    def __init__(self, service: InferenceService) -> None:
        self.extensions = service.extensions

    def handle(self, method: str, path: str, body: bytes | bytearray) -> tuple[int, bytes]:
        """Answer one call: (HTTP status, JSON body).

        Raises:
            GpuserveError: the refusal (403 shared memory off, 400 bad body or value, 404
                unknown model).
            LookupError: no such endpoint (the caller answers 404/405).
        """
        path = path.rstrip("/")
        if path.startswith(_SHM):
            return self._shared_memory(method, path, body)
        if path == "/v2/logging":
            logs = self.extensions.logs
            if method == "POST":
                return 200, orjson.dumps(logs.update(_json_object(body, "log settings")))
            if method == "GET":
                return 200, orjson.dumps(logs.get())
            raise LookupError(path)
        model = None
        if path != "/v2/trace/setting":
            model = path[len("/v2/models/") : -len(_TRACE)]
            if not model or "/" in model:
                raise LookupError(path)
            self.extensions.check_model(model)
        traces = self.extensions.traces
        if method == "GET":
            return 200, orjson.dumps(traces.get(model))
        if method != "POST":
            raise LookupError(path)
        changes: dict[str, list[str] | None] = {}
        for key, value in _json_object(body, "trace settings").items():
            if value is None or (type(value) is list and all(type(v) is str for v in value)):
                changes[key] = value
            elif type(value) is str:
                changes[key] = [value]
            else:
                raise InvalidInputError(
                    f"trace setting {key!r} must be a string, a list of strings or null, "
                    f"got {value!r}"
                )
        return 200, orjson.dumps(traces.update(changes, model))

    def _shared_memory(self, method: str, path: str, body: bytes | bytearray) -> tuple[int, bytes]:
        cuda = path.startswith("/v2/cudasharedmemory")
        parts = path.split("/")[3:]  # ['region', name, action] or [action]
        if len(parts) == 1:
            name, action = "", parts[0]
        elif len(parts) == 3 and parts[0] == "region" and parts[1]:
            name, action = parts[1], parts[2]
        else:
            raise LookupError(path)
        if (action == "status") != (method == "GET") or action not in (
            "status",
            "register",
            "unregister",
        ):
            raise LookupError(path)
        if action == "register" and not name:
            raise LookupError(path)
        if cuda:
            return self._cuda(action, name, body)
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

    def _cuda(self, action: str, name: str, body: bytes | bytearray) -> tuple[int, bytes]:
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
