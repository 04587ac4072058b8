"""The model repository extension over HTTP, and gpuserve's lifecycle endpoints beside it.

    POST /v2/repository/index                         every model version and its state
    POST /v2/repository/models/{m}/load               load or reload (explicit mode)
    POST /v2/repository/models/{m}/unload             drain and unload (explicit mode)
    POST /v2/repository/models/{m}/rollback           serve the previous version again
    POST /v2/repository/models/{m}/canary             {"version": N, "weight": 0.1}
    POST /v2/repository/models/{m}/canary/promote     the canary becomes the default
    POST /v2/repository/models/{m}/canary/abort       the canary ends
    POST /v2/repository/models/{m}/status             the model's routing and versions

``index`` and ``status`` only read, and are open (with an API token set, they take it or the
management token). The others change what is served: they are off unless management is
enabled (:attr:`~gpuserve.config.ServerConfig.management_enabled`; 403 otherwise), and need
``Authorization: Bearer <token>`` when a management token is set, else the API token when one
is set (401 without it). Model names are checked to be one folder of the repository, and a
configuration sent with a load cannot point at files outside the version folder
(:mod:`gpuserve.server.security`). A load may carry a configuration, as Triton's
does: ``{"parameters": {"config": "<the model configuration as a JSON string>"}}``.

Success bodies are the model's :meth:`~gpuserve.repository.manager.ModelManager.status`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson

from gpuserve.config import ServerConfig
from gpuserve.errors import InvalidInputError
from gpuserve.repository.manager import ModelManager
from gpuserve.server.security import Tokens, check_model_name, check_override_paths

logger = logging.getLogger(__name__)

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


class ManagementDenied(Exception):
    """Management refused: ``status`` 401 (no or wrong token) or 403 (disabled)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class RepositoryApi:
    """Handles ``POST /v2/repository/...``.

    Args:
        manager: The model manager the calls go to.
        config: Whether management is enabled, and the tokens.
    """

    def __init__(self, manager: ModelManager, config: ServerConfig) -> None:
        self.manager = manager
        self.disabled = not config.management_enabled
        self.tokens = Tokens(config)
        self.trace_dir = config.trace_dir

    def handles(self, path: str) -> bool:
        """Whether ``path`` is one of these endpoints."""
        return path == "/v2/repository/index" or path.startswith(_PREFIX)

    async def handle(
        self, path: str, headers: list[tuple[bytes, bytes]], body: bytes | bytearray
    ) -> tuple[int, bytes]:
        """Serve one call; returns (status, JSON body).

        Raises:
            ManagementDenied: disabled (403) or missing/wrong token (401).
            GpuserveError: what the manager raised (mapped by the status table).
            LookupError: an unknown path (the caller answers 404).
        """
        if path == "/v2/repository/index":
            self._authorize_read(headers)
            request = _json_body(body)
            ready_only = bool(request.get("ready", False))
            return 200, orjson.dumps(self.manager.index(ready_only))
        name, _, action = path[len(_PREFIX) :].partition("/")
        if not name or action not in _ACTIONS:
            raise LookupError(path)
        if action in _READ_ONLY:
            self._authorize_read(headers)
        else:
            self._authorize(headers)
        check_model_name(name)
        manager = self.manager
        if action == "load":
            override = _config_override(_json_body(body))
            if override is not None:
                check_override_paths(override)
            await manager.load(name, override)
        elif action == "unload":
            await manager.unload(name)
        elif action == "rollback":
            await manager.rollback(name)
        elif action == "canary":
            version, weight = _canary_body(_json_body(body))
            await manager.set_canary(name, version, weight)
        elif action == "canary/promote":
            await manager.promote_canary(name)
        elif action == "canary/abort":
            await manager.abort_canary(name)
        elif action == "trace":
            return 200, orjson.dumps(self._trace(name, _json_body(body)))
        if action != "status":
            logger.info("repository API: %s %s", action, name)
        return 200, orjson.dumps(manager.status(name))

    def _trace(self, name: str, request: dict[str, Any]) -> dict[str, Any]:
        """Start a ``torch.profiler`` trace of the next N batches of the serving version."""
        batches = request.get("batches", 1)
        if not isinstance(batches, int) or isinstance(batches, bool) or not 1 <= batches <= 1000:
            raise InvalidInputError(
                f"field 'batches': expected an integer 1..1000, got {batches!r}"
            )
        scheduler = self.manager.scheduler(name, None)
        directory = self.trace_dir / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        scheduler.start_trace(batches, directory)
        logger.info("repository API: trace %s for %d batch(es) into %s", name, batches, directory)
        return {
            "model": name,
            "version": scheduler.version,
            "batches": batches,
            "trace": directory.name,  # relative to trace_dir: bodies carry no host paths
        }

    def _authorize_read(self, headers: list[tuple[bytes, bytes]]) -> None:
        if not self.tokens.allows_read(headers):
            raise ManagementDenied(
                401, "this endpoint needs 'Authorization: Bearer <API or management token>'"
            )

    def _authorize(self, headers: list[tuple[bytes, bytes]]) -> None:
        if self.disabled:
            raise ManagementDenied(
                403,
                "model management is disabled on this server (enable it with "
                "--enable-management or --management-token; --model-control-mode explicit "
                "or poll enables it too, unless --disable-management)",
            )
        if not self.tokens.allows_management(headers):
            which = "management" if self.tokens.management is not None else "API"
            raise ManagementDenied(
                401, f"model management needs 'Authorization: Bearer <{which} token>'"
            )


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


def _config_override(request: dict[str, Any]) -> dict[str, Any] | None:
    """The ``parameters.config`` of a load request (a JSON string, or an object), or None."""
    parameters = request.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidInputError("field 'parameters' must be an object")
    config = parameters.get("config")
    if config is None:
        return None
    if isinstance(config, str):
        try:
            config = orjson.loads(config)
        except orjson.JSONDecodeError as err:
            raise InvalidInputError(
                f"parameter 'config' is not valid JSON: {err} (expected the model "
                "configuration as a JSON string)"
            ) from None
    if not isinstance(config, dict):
        raise InvalidInputError(
            f"parameter 'config' must be a JSON object, got {type(config).__name__}"
        )
    return config


def _canary_body(request: dict[str, Any]) -> tuple[int, float]:
    version, weight = request.get("version"), request.get("weight")
    if isinstance(version, str) and version.isascii() and version.isdigit():
        version = int(version)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise InvalidInputError(f"field 'version': expected a positive integer, got {version!r}")
    if not isinstance(weight, (int, float)) or isinstance(weight, bool):
        raise InvalidInputError(f"field 'weight': expected a number 0..1, got {weight!r}")
    return version, float(weight)
