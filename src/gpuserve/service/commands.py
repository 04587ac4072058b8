"""Typed repository commands: load, unload, rollback, canary, trace; and who may call them.

Every front end calls these directly with already-parsed arguments (no front end builds
another's paths or bodies). The changing commands are off unless management is enabled
(:attr:`~gpuserve.config.ServerConfig.management_enabled`; :class:`PermissionDeniedError`
otherwise) and need the management token when one is set, else the API token when one is set
(:class:`UnauthenticatedError` without it). The read-only ones (index, status) take either
token. Each changing command answers the model's status view afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from gpuserve.config import ServerConfig
from gpuserve.errors import (
    ConfigError,
    InvalidInputError,
    ModelNotFoundError,
    PermissionDeniedError,
    UnauthenticatedError,
)
from gpuserve.repository.manager import ModelManager
from gpuserve.service.auth import Tokens
from gpuserve.service.model_files import (
    FILE_PREFIX,
    LoadedFiles,
    check_files,
    code_files,
    discard,
    with_detected_backend,
    write_model_folder,
)
from gpuserve.service.names import check_model_name, check_override_paths
from gpuserve.service.views import IndexRow, ModelStatusView, TraceView, Views

logger = logging.getLogger(__name__)

_DISABLED = (
    "model management is disabled on this server (enable it with "
    "--enable-management or --management-token; --model-control-mode explicit "
    "or poll enables it too, unless --disable-management)"
)


@dataclass(frozen=True, slots=True)
class CanaryRequest:
    """``weight`` (0..1) of the unversioned requests of a model go to ``version``."""

    version: int
    weight: float


def config_from_json(config: Any) -> dict[str, Any]:
    """A load request's configuration (a JSON string, or an already parsed object) as a dict.

    Raises:
        InvalidInputError: not JSON, or not a JSON object.
    """
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


def failed_to_load(name: str, message: str) -> str:
    """A load failure in Triton's wording, ``failed to load '<name>': <why>``, which Triton's
    clients and tools look for."""
    ours = f"failed to load model '{name}'"
    if message.startswith(ours):
        return f"failed to load '{name}'" + message[len(ours) :]
    return f"failed to load '{name}': {message}"


class RepositoryCommands:
    """The model repository's commands over the model manager.

    Args:
        manager: The model manager the commands act on.
        views: Builds the status views the commands answer.
        config: Whether management is enabled, the tokens, the trace directory.
    """

    def __init__(self, manager: ModelManager, views: Views, config: ServerConfig) -> None:
        self.manager = manager
        self.views = views
        self.disabled = not config.management_enabled
        self.tokens = Tokens(config)
        self.trace_dir = config.trace_dir
        self.max_files_bytes = config.max_request_body_bytes
        #: Files that run code may be uploaded: a token guards management, or the operator
        #: allowed it (``allow_model_upload_code``).
        self.code_uploads = (
            config.allow_model_upload_code
            or self.tokens.management is not None
            or self.tokens.api is not None
        )
        #: The temporary folder of each model loaded from a load request's files.
        self.loaded_files = LoadedFiles()
        self._file_locks: dict[str, asyncio.Lock] = {}

    # -- authorization ---------------------------------------------------------------------

    def authorize_read(self, token: bytes | None) -> None:
        """Allow a read-only repository call (index, status) with bearer ``token``.

        Raises:
            UnauthenticatedError: an API token is set and ``token`` is neither token.
        """
        if not self.tokens.read_token_ok(token):
            raise UnauthenticatedError(
                "this endpoint needs 'Authorization: Bearer <API or management token>'"
            )

    def authorize_change(self, token: bytes | None) -> None:
        """Allow a changing call (load, unload, rollback, canary, trace) with ``token``.

        Raises:
            PermissionDeniedError: management is disabled.
            UnauthenticatedError: ``token`` is not the token management needs.
        """
        if self.disabled:
            raise PermissionDeniedError(_DISABLED)
        if not self.tokens.management_token_ok(token):
            which = "management" if self.tokens.management is not None else "API"
            raise UnauthenticatedError(
                f"model management needs 'Authorization: Bearer <{which} token>'"
            )

    def check_code_upload(self, name: str, files: Mapping[tuple[str, ...], bytes]) -> None:
        """The upload policy: files that run code when ``name`` loads (``model.py``, pickled
        or TorchScript files; see :func:`~gpuserve.service.model_files.code_files`) are
        accepted only when a token guards management (the caller passed
        :meth:`authorize_change` with it) or ``allow_model_upload_code`` is set.

        Raises:
            PermissionDeniedError: code files, no token and no ``allow_model_upload_code``
                (403 / PERMISSION_DENIED), naming the files and both ways to allow them.
        """
        if self.code_uploads:
            return
        code = code_files(files)
        if code:
            listed = ", ".join(f"'{FILE_PREFIX}{path}'" for path in code)
            raise PermissionDeniedError(
                f"failed to load '{name}': the load request uploads files that run code when "
                f"the model loads ({listed}), and this server has no management token: set "
                "--management-token (and send it as 'Authorization: Bearer <token>'), or start "
                "the server with --allow-model-upload-code"
            )

    # -- reading ---------------------------------------------------------------------------

    def index(self, ready_only: bool = False) -> list[IndexRow]:
        """The repository index (every model version and its state)."""
        return self.views.index(ready_only)

    def status(self, name: str) -> ModelStatusView:
        """Model ``name``'s routing and versions.

        Raises:
            InvalidInputError: not a plain model name.
            ModelNotFoundError: no such model.
        """
        check_model_name(name)
        return self.views.model_status(name)

    # -- changing --------------------------------------------------------------------------

    async def load(
        self, name: str, config: object = None, files: Mapping[str, bytes] | None = None
    ) -> ModelStatusView:
        """Load or reload ``name`` (explicit mode), with ``config`` (the model configuration
        as a JSON object or a JSON string of one: ``config.yaml``'s fields, or Triton's
        ModelConfig JSON, told apart by
        :func:`~gpuserve.repository.triton.config.is_triton_config`) in place of its config
        file when given. With ``files`` (Triton's ``file:<path>`` parameters: contents by
        relative path, e.g. ``1/model.onnx``; ``config`` then required) the versions load
        from those files, written to a private temporary folder
        (:mod:`gpuserve.service.model_files`), not from the repository's folder; the model
        keeps its name. A ``config`` naming no backend gets the one its model files tell
        (:func:`~gpuserve.service.model_files.with_detected_backend`). A failure's message
        starts with Triton's ``failed to load '<name>'``.

        Raises:
            InvalidInputError: a bad name, a configuration that is not a JSON object, or one
                pointing outside the model; files without ``config``.
            RepositoryPollError: a file path that is absolute, holds ``..`` or a component
                over 255 bytes (500 / INTERNAL, as Triton answers).
            GpuserveError: what :meth:`ModelManager.load` raises.
        """
        check_model_name(name)
        lock = self._file_locks.setdefault(name, asyncio.Lock())
        async with lock:  # one load or unload of ``name`` at a time: its folder follows
            root: Path | None = None
            try:
                checked = None
                if files:
                    checked = check_files(files, self.max_files_bytes)
                    self.check_code_upload(name, checked)
                    if config is None:
                        raise InvalidInputError(
                            f"parameter 'config' is required when the load request carries "
                            f"'{FILE_PREFIX}<path>' parameters (expected the model "
                            "configuration as a JSON string)"
                        )
                override = None if config is None else config_from_json(config)
                if override is not None:
                    check_override_paths(override)
                folder = None
                if checked is not None:
                    loop = asyncio.get_running_loop()
                    folder = await loop.run_in_executor(None, write_model_folder, name, checked)
                    root = folder.parent
                if override is not None:
                    source = folder or self.manager.repository / name
                    override = with_detected_backend(override, source)
                await self.manager.load(name, override, folder)
            except (ConfigError, ModelNotFoundError, InvalidInputError) as err:
                if root is not None:
                    await discard(root)
                raise type(err)(failed_to_load(name, err.message)) from None
            except BaseException:
                if root is not None:
                    await discard(root)
                raise
            await self.loaded_files.replace(name, root)
        return self._changed("load", name)

    async def unload(self, name: str) -> ModelStatusView:
        """Drain and unload every version of ``name`` (explicit mode)."""
        check_model_name(name)
        async with self._file_locks.setdefault(name, asyncio.Lock()):
            await self.manager.unload(name)
            await self.loaded_files.replace(name, None)
        return self._changed("unload", name)

    async def rollback(self, name: str) -> ModelStatusView:
        """Serve the previously served version of ``name`` again."""
        check_model_name(name)
        await self.manager.rollback(name)
        return self._changed("rollback", name)

    async def set_canary(self, name: str, canary: CanaryRequest) -> ModelStatusView:
        """Send ``canary.weight`` of ``name``'s unversioned requests to ``canary.version``.

        Raises:
            InvalidInputError: a weight outside 0..1 (the message names the field).
            GpuserveError: what :meth:`ModelManager.set_canary` raises.
        """
        check_model_name(name)
        await self.manager.set_canary(name, canary.version, canary.weight)
        return self._changed("canary", name)

    async def promote_canary(self, name: str) -> ModelStatusView:
        """Make ``name``'s canary its default version."""
        check_model_name(name)
        await self.manager.promote_canary(name)
        return self._changed("canary/promote", name)

    async def abort_canary(self, name: str) -> ModelStatusView:
        """End ``name``'s canary."""
        check_model_name(name)
        await self.manager.abort_canary(name)
        return self._changed("canary/abort", name)

    def trace(self, name: str, batches: int) -> TraceView:
        """Profile the next ``batches`` (1..1000) batches of the version serving ``name``
        with ``torch.profiler`` into a new folder of the trace directory.

        Raises:
            InvalidInputError: ``batches`` out of range.
            ModelNotFoundError / ModelNotReadyError: nothing serves ``name``.
        """
        check_model_name(name)
        if not 1 <= batches <= 1000:
            raise InvalidInputError(
                f"field 'batches': expected an integer 1..1000, got {batches!r}"
            )
        runner = self.manager.runner(name, None)
        directory = self.trace_dir / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        runner.start_trace(batches, directory)
        logger.info("repository API: trace %s for %d batch(es) into %s", name, batches, directory)
        return TraceView(name, runner.version, batches, directory.name)

    def close(self) -> None:
        """Remove the temporary folders of models loaded from a request's files (at
        shutdown, once the models are unloaded)."""
        self.loaded_files.close()

    def _changed(self, action: str, name: str) -> ModelStatusView:
        logger.info("repository API: %s %s", action, name)
        return self.views.model_status(name)
