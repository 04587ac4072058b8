"""The model manager: loads the versions a repository selects and routes requests to them.

States of a model version: LOADING -> READY, or LOADING -> FAILED (with the reason), and
READY -> UNLOADING -> UNLOADED. A version that fails never affects the others.

Server readiness rule (documented in the README): the server is ready when the initial load
has finished, it is not shutting down, and at least one model version is READY. A model that
failed to load is reported by its own ready endpoint and the repository index, not by turning
the whole server unready; a repository where nothing could load is not ready (BC-16, BC-17).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass, field
from pathlib import Path

from gpuserve.backends import create_backend
from gpuserve.backends.base import LoadContext
from gpuserve.config import ModelConfig
from gpuserve.engine.instance import Instance
from gpuserve.engine.scheduler import ModelScheduler
from gpuserve.errors import ModelNotFoundError, ModelNotReadyError
from gpuserve.repository.devices import instance_devices
from gpuserve.repository.repository import ModelEntry, scan_repository

logger = logging.getLogger(__name__)


class VersionState(enum.StrEnum):
    LOADING = "LOADING"
    READY = "READY"
    FAILED = "UNAVAILABLE"
    UNLOADING = "UNLOADING"


@dataclass(slots=True)
class ModelVersion:
    """One version of a model and its scheduler (None until loaded)."""

    model: str
    version: int
    path: Path
    config: ModelConfig
    state: VersionState = VersionState.LOADING
    reason: str = ""
    scheduler: ModelScheduler | None = None


@dataclass(slots=True)
class Model:
    """A model of the repository and its versions."""

    name: str
    config: ModelConfig | None
    versions: dict[int, ModelVersion] = field(default_factory=dict)
    error: str | None = None

    def ready_versions(self) -> list[int]:
        return sorted(v for v, mv in self.versions.items() if mv.state is VersionState.READY)


class ModelManager:
    """Owns every loaded model version.

    Args:
        repository: The model repository folder.
    """

    def __init__(self, repository: Path) -> None:
        self.repository = repository
        self.models: dict[str, Model] = {}
        self.initial_load_done = False
        self.shutting_down = False

    # -- loading ---------------------------------------------------------------------------

    async def load_all(self) -> None:
        """Scan the repository and load every selected version, models in parallel."""
        entries = scan_repository(self.repository)
        if not entries:
            logger.warning("model repository %s holds no model", self.repository)
        tasks = [self._load_entry(entry) for entry in entries]
        await asyncio.gather(*tasks)
        self.initial_load_done = True
        ready = [f"{m.name}:{v}" for m in self.models.values() for v in m.ready_versions()]
        logger.info("initial load done: %d version(s) ready: %s", len(ready), ", ".join(ready))

    async def _load_entry(self, entry: ModelEntry) -> None:
        model = Model(entry.name, entry.config, error=entry.error)
        self.models[entry.name] = model
        if entry.error is not None or entry.config is None:
            logger.error("model %s cannot be loaded: %s", entry.name, entry.error)
            return
        for version in entry.versions:
            mv = ModelVersion(entry.name, version, entry.path / str(version), entry.config)
            model.versions[version] = mv
        await asyncio.gather(*(self._load_version(mv) for mv in model.versions.values()))

    async def _load_version(self, mv: ModelVersion) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        scheduler = ModelScheduler(mv.config, str(mv.version))
        instances: list[Instance] = []
        try:
            for index, device in enumerate(instance_devices(mv.config)):
                context = LoadContext(
                    config=mv.config,
                    version_path=mv.path,
                    version=mv.version,
                    device=device,
                    instance_index=index,
                    parameters=dict(mv.config.parameters),
                )
                instance = Instance(
                    f"{mv.model}:{mv.version}#{index}",
                    create_backend(mv.config.backend),
                    context,
                    scheduler.on_batch_done,
                )
                await loop.run_in_executor(None, instance.start)
                instances.append(instance)
        except BaseException as err:
            for instance in instances:
                await loop.run_in_executor(None, instance.stop)
            mv.state = VersionState.FAILED
            mv.reason = f"failed to load: {type(err).__name__}: {err}"
            logger.error("model %s version %d %s", mv.model, mv.version, mv.reason)
            if not isinstance(err, Exception):
                raise
            return
        scheduler.attach(instances, loop)
        mv.scheduler = scheduler
        mv.state = VersionState.READY
        logger.info(
            "model %s version %d ready: %d instance(s) on %s, loaded in %.2f s",
            mv.model,
            mv.version,
            len(instances),
            ", ".join(i.context.device for i in instances),
            loop.time() - started,
        )

    async def close(self, drain_timeout_s: float = 30.0) -> None:
        """Stop taking requests, drain every version (up to the timeout) and unload."""
        self.shutting_down = True
        closing = []
        for model in self.models.values():
            for mv in model.versions.values():
                if mv.scheduler is not None:
                    mv.state = VersionState.UNLOADING
                    closing.append(mv.scheduler.close(drain_timeout_s))
        await asyncio.gather(*closing)

    # -- lookup ----------------------------------------------------------------------------

    def model(self, name: str) -> Model:
        """The model called ``name``.

        Raises:
            ModelNotFoundError: no such model in the repository.
        """
        model = self.models.get(name)
        if model is None:
            known = ", ".join(sorted(self.models)) or "none"
            raise ModelNotFoundError(f"unknown model '{name}' (models in the repository: {known})")
        return model

    def version(self, name: str, version: str | None) -> ModelVersion:
        """The version to serve: the named one, or the highest READY one.

        Raises:
            ModelNotFoundError: unknown model or version.
            ModelNotReadyError: the model or version exists but is not READY.
        """
        model = self.model(name)
        if version:
            if not version.isdigit() or int(version) not in model.versions:
                served = sorted(model.versions)
                raise ModelNotFoundError(
                    f"model '{name}' has no version '{version}' (versions served: {served})"
                )
            mv = model.versions[int(version)]
            if mv.state is not VersionState.READY:
                raise ModelNotReadyError(
                    f"model '{name}' version {version} is not ready: {mv.state.value}"
                    + (f" ({mv.reason})" if mv.reason else "")
                )
            return mv
        ready = model.ready_versions()
        if not ready:
            raise ModelNotReadyError(f"model '{name}' is not ready: {self.model_status(model)}")
        return model.versions[ready[-1]]

    def scheduler(self, name: str, version: str | None) -> ModelScheduler:
        """The scheduler of the version serving ``name`` (see :meth:`version`)."""
        scheduler = self.version(name, version).scheduler
        assert scheduler is not None
        return scheduler

    def model_status(self, model: Model) -> str:
        if model.error:
            return model.error
        states = [
            f"version {v} {mv.state.value}" + (f" ({mv.reason})" if mv.reason else "")
            for v, mv in sorted(model.versions.items())
        ]
        return "; ".join(states) or "no version loaded"

    def is_ready(self) -> bool:
        """Server readiness (rule in the module docstring)."""
        if self.shutting_down or not self.initial_load_done:
            return False
        return any(m.ready_versions() for m in self.models.values())

    def index(self) -> list[dict[str, str]]:
        """The V2 repository index: one row per model version (or per failed model)."""
        rows: list[dict[str, str]] = []
        for name, model in sorted(self.models.items()):
            if model.error or not model.versions:
                rows.append(
                    {
                        "name": name,
                        "version": "",
                        "state": "UNAVAILABLE",
                        "reason": model.error or "no version selected",
                    }
                )
            for version, mv in sorted(model.versions.items()):
                rows.append(
                    {
                        "name": name,
                        "version": str(version),
                        "state": mv.state.value,
                        "reason": mv.reason,
                    }
                )
        return rows
