"""The model repository extension over HTTP, and gpuserve's lifecycle endpoints beside it.

    POST /v2/repository/index                         every model version and its state
    POST /v2/repository/models/{m}/load               load or reload (explicit mode)
    POST /v2/repository/models/{m}/unload             drain and unload (explicit mode)
    POST /v2/repository/models/{m}/rollback           serve the previous version again
    POST /v2/repository/models/{m}/canary             {"version": N, "weight": 0.1}
    POST /v2/repository/models/{m}/canary/promote     the canary becomes the default
    POST /v2/repository/models/{m}/canary/abort       the canary ends
    POST /v2/repository/models/{m}/status             the model's routing and versions
    POST /v2/repository/models/{m}/trace              {"batches": N}: profile N batches

An adapter: it parses the path and the JSON body and calls the service's typed
:class:`~gpuserve.service.commands.RepositoryCommands`, which own the checks (management
disabled -> 403, missing token -> 401 with ``WWW-Authenticate: Bearer``; names; configuration
paths). A load may carry a configuration, as Triton's does:
``{"parameters": {"config": "<the model configuration as a JSON string>"}}``, and the model's
files, base64-encoded, as ``"file:<relative path>": "<base64>"`` parameters (``config`` then
required; see :mod:`gpuserve.service.model_files`).

Success bodies are the model's status view.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import orjson

from gpuserve.errors import InvalidInputError
from gpuserve.server.security import Headers, bearer_token, check_model_name
from gpuserve.service.commands import CanaryRequest
from gpuserve.service.inference import InferenceService
from gpuserve.service.model_files import FILE_PREFIX

_PREFIX = "/v2/repository/models/"
_READ_ONLY = {"status"}
_ACTIONS = {
    "load",
    "unload",
    "rollback",
    "canary",
    "canary/promote",
    "canary/abort",
    "status",
    "trace",
}


class RepositoryApi:
    """Handles ``POST /v2/repository/...``.

    Args:
        service: The inference service whose repository commands the calls run.
    """

    def __init__(self, service: InferenceService) -> None:
        self.commands = service.repository

    def handles(self, path: str) -> bool:
        """Whether ``path`` is one of these endpoints."""
        return path == "/v2/repository/index" or path.startswith(_PREFIX)

    async def handle(self, path: str, headers: Headers, body: bytes | bytearray) -> bytes:
        """Serve one call; returns the JSON body of a 200 answer.

        Raises:
            GpuserveError: refused or failed (mapped by the status table).
            LookupError: an unknown path (the caller answers 404).
        """
        commands = self.commands
        token = bearer_token(headers)
        if path == "/v2/repository/index":
            commands.authorize_read(token)
            ready_only = bool(_json_body(body).get("ready", False))
            return orjson.dumps(commands.index(ready_only))
        name, _, action = path[len(_PREFIX) :].partition("/")
        if not name or action not in _ACTIONS:
            raise LookupError(path)
        if action in _READ_ONLY:
            commands.authorize_read(token)
        else:
            commands.authorize_change(token)
        check_model_name(name)
        if action == "load":
            request = _json_body(body)
            view = await commands.load(name, _config_override(request), _files(request))
        elif action == "unload":
            view = await commands.unload(name)
        elif action == "rollback":
            view = await commands.rollback(name)
        elif action == "canary":
            view = await commands.set_canary(name, _canary_body(_json_body(body)))
        elif action == "canary/promote":
            view = await commands.promote_canary(name)
        elif action == "canary/abort":
            view = await commands.abort_canary(name)
        elif action == "trace":
            return orjson.dumps(commands.trace(name, _batches(_json_body(body))))
        else:
            view = commands.status(name)
        return orjson.dumps(view)


def _json_body(body: bytes | bytearray) -> dict[str, Any]:
    if not body.strip():
        return {}
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as err:
        raise InvalidInputError(f"request body is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise InvalidInputError(f"request body must be a JSON object, got {type(value).__name__}")
    return value


def _config_override(request: dict[str, Any]) -> object:
    """The ``parameters.config`` of a load request (a JSON string, or an object; the load
    command parses it), or None."""
    parameters = request.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidInputError("field 'parameters' must be an object")
    return parameters.get("config")


def _files(request: dict[str, Any]) -> dict[str, bytes]:
    """The ``file:<path>`` parameters of a load request, base64-decoded, by relative path.

    Raises:
        InvalidInputError: a value that is not a base64 string (names the parameter).
    """
    parameters = request.get("parameters") or {}
    files = {}
    for key, value in parameters.items():
        if not key.startswith(FILE_PREFIX):
            continue
        if not isinstance(value, str):
            raise InvalidInputError(
                f"parameter {key!r}: expected the file's content as a base64 string, got "
                f"{type(value).__name__}"
            )
        try:
            files[key[len(FILE_PREFIX) :]] = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as err:
            raise InvalidInputError(
                f"parameter {key!r}: not valid base64 ({err}); expected the file's content "
                "as a base64 string"
            ) from None
    return files


def _canary_body(request: dict[str, Any]) -> CanaryRequest:
    version, weight = request.get("version"), request.get("weight")
    if isinstance(version, str) and version.isascii() and version.isdigit():
        version = int(version)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise InvalidInputError(f"field 'version': expected a positive integer, got {version!r}")
    if not isinstance(weight, (int, float)) or isinstance(weight, bool):
        raise InvalidInputError(f"field 'weight': expected a number 0..1, got {weight!r}")
    return CanaryRequest(version, float(weight))


def _batches(request: dict[str, Any]) -> int:
    batches = request.get("batches", 1)
    if not isinstance(batches, int) or isinstance(batches, bool) or not 1 <= batches <= 1000:
        raise InvalidInputError(f"field 'batches': expected an integer 1..1000, got {batches!r}")
    return batches
