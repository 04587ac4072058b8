"""The model manager: loads the versions a repository selects and routes requests to them.

A thin façade that keeps the per-model locks, the control modes, the poll loop, start and
close, over parts with one job each: :mod:`~gpuserve.repository.lifecycle.planner` and
:mod:`~gpuserve.repository.lifecycle.rollout` decide (pure: which versions load and retire, the route),
:mod:`~gpuserve.repository.lifecycle.executor` does (load and warm up, switch, drain), and
:mod:`~gpuserve.repository.router` answers the request path and the readiness rule.

Every change, whatever asks for it, is one reconcile of the executor under the model's lock,
so concurrent changes of one model run one after the other; a version that fails to load
never replaces one that serves (see :mod:`gpuserve.repository.state` for the model's loaded
set and route).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from gpuserve.config import ServerConfig
from gpuserve.engine.admission import AdmissionPool
from gpuserve.engine.runners.base import VersionRunner
from gpuserve.errors import ConfigError, InvalidInputError
from gpuserve.repository.lifecycle import rollout
from gpuserve.repository.lifecycle.ensemble_loading import load_ensemble
from gpuserve.repository.lifecycle.executor import Change, Executor, adopt, last_scan, stop_all, take_config
from gpuserve.repository.lifecycle.loading import load_version
from gpuserve.repository.ondemand.loader import OnDemand
from gpuserve.repository.lifecycle.planner import Settings
from gpuserve.repository.report import (
    index_rows,
    load_failed,
    load_summary,
    model_status,
    model_summary,
)
from gpuserve.repository.ondemand.residency import Limits
from gpuserve.repository.router import Router
from gpuserve.repository.scan import Fingerprint, ModelEntry, read_model, scan_repository
from gpuserve.repository.state import Model, ModelVersion, Route, VersionState

__all__ = ["Model", "ModelManager", "ModelVersion", "Route", "VersionState"]

logger = logging.getLogger(__name__)

ControlMode = Literal["none", "explicit", "poll"]


class ModelManager(Router):
    """Owns every model version: loads, routes, swaps, drains and unloads them.

    The request path (``model``, ``version``, ``split``, ``runner``, ``is_ready``) is
    :class:`~gpuserve.repository.router.Router`'s.

    Args:
        repository: The model repository folder.
        control_mode: ``none``, ``explicit`` or ``poll`` (see ``ServerConfig``).
        load_models: Models loaded at start in ``explicit`` mode (``*`` = all).
        poll_interval_s: Seconds between repository scans in ``poll`` mode.
        unload_timeout_s: Drain time of a version that leaves, seconds.
        strict_readiness: The readiness rule (see :mod:`gpuserve.repository.router`).
        load_on_demand: Load models at their first request, not at start (pinned models
            and, in ``explicit`` mode, ``load_models`` still load at start, pinned).
        limits: Most models / memory per device loaded at once (see
            :mod:`gpuserve.repository.ondemand.residency`).
        idle_unload_s: Server default idle time before a model unloads, seconds (0: never).
        model_load_timeout_s: How long a request waits for its model to load, seconds.

    Attributes:
        on_demand: Load on demand, limits and idle unload
            (:class:`~gpuserve.repository.ondemand.loader.OnDemand`).
    """

    def __init__(
        self,
        repository: Path,
        *,
        control_mode: ControlMode = "none",
        load_models: list[str] | tuple[str, ...] = (),
        poll_interval_s: float = 15.0,
        unload_timeout_s: float = 30.0,
        strict_readiness: bool = False,
        load_on_demand: bool = False,
        limits: Limits | None = None,
        idle_unload_s: float = 0.0,
        model_load_timeout_s: float = 120.0,
        admission_pool: AdmissionPool | None = None,
        auto_complete: bool = True,
    ) -> None:
        super().__init__({}, strict_readiness=strict_readiness)
        #: Models and backends complete omitted config fields at load (Triton's
        #: auto-complete; off with ``--disable-auto-complete-config``).
        self.auto_complete = auto_complete
        #: The admission threads every loaded version's runner shares (None: steps inline).
        self.admission_pool = admission_pool
        self.ready_when_empty = load_on_demand
        self.repository = repository
        self.control_mode = control_mode
        self.load_models = list(load_models)
        self.poll_interval_s = poll_interval_s
        self.unload_timeout_s = unload_timeout_s
        #: Called (on the event loop) with each version that is about to turn READY, before
        #: any request can reach it: the metrics layer subscribes to its stats here.
        self.version_listeners: list[Callable[[ModelVersion], None]] = []
        #: Called (on the event loop) with each version whose runner has stopped (drained
        #: and closed after an unload, a swap or a load that did not switch), and that
        #: runner: the metrics layer drops the version's series here.
        self.stop_listeners: list[Callable[[ModelVersion, VersionRunner], None]] = []
        #: Called (on the event loop) with the name of each model that left the repository,
        #: once its versions have unloaded: the metrics layer drops its series here.
        self.removal_listeners: list[Callable[[str], None]] = []
        self._locks: dict[str, asyncio.Lock] = {}
        self._seen: dict[str, dict[int, Fingerprint]] = {}  # poll: fingerprints last scan
        self._poll_task: asyncio.Task[None] | None = None
        self._logged_errors: dict[str, str] = {}  # why a model cannot load, as last logged
        # the hooks are looked up per call, so a test can wrap ``_load_version``
        self._executor = Executor(
            lambda mv: self._load_version(mv),
            lambda: self.shutting_down,
            lambda: self.unload_timeout_s,
            stopped=self._version_stopped,
        )
        self.on_demand = OnDemand(
            self,
            enabled=load_on_demand,
            limits=limits,
            idle_unload_s=idle_unload_s,
            timeout_s=model_load_timeout_s,
        )

    @classmethod
    def from_config(cls, config: ServerConfig) -> ModelManager:
        """A manager with the lifecycle settings of ``config``."""
        return cls(
            config.model_repository,
            control_mode=config.model_control_mode,
            load_models=config.load_model,
            poll_interval_s=config.repository_poll_interval_s,
            unload_timeout_s=config.unload_timeout_s,
            strict_readiness=config.strict_readiness,
            load_on_demand=config.load_on_demand,
            limits=Limits(config.max_loaded_models, config.loaded_models_memory_bytes),
            idle_unload_s=config.idle_unload_s,
            model_load_timeout_s=config.model_load_timeout_s,
            admission_pool=AdmissionPool(
                config.admission_workers, config.admission_queue, config.admission_inline_bytes
            ),
            auto_complete=not config.disable_auto_complete_config,
        )

    # -- start, poll, stop -----------------------------------------------------------------

    async def load_all(self) -> None:
        """The initial load: every model (``none``, ``poll``) or ``load_models``
        (``explicit``), models in parallel; then start polling in ``poll`` mode.

        Raises:
            ConfigError: the repository folder cannot be read.
        """
        loop = asyncio.get_running_loop()
        entries = await loop.run_in_executor(None, scan_repository, self.repository)
        if not entries:
            logger.warning("model repository %s holds no model", self.repository)
        wanted = {e.name for e in entries}
        if self.control_mode == "explicit" and "*" not in self.load_models:
            unknown = sorted(set(self.load_models) - wanted)
            if unknown:
                logger.error("--load-model names model(s) not in %s: %s", self.repository, unknown)
            wanted &= set(self.load_models)
        pinned = set(wanted) if self.control_mode == "explicit" else set()
        if self.on_demand.enabled:  # only pinned models load at start
            wanted = pinned | {e.name for e in entries if e.config is not None and e.config.pinned}
        for entry in entries:
            model = self._register(entry)
            model.pinned = entry.name in pinned
            if entry.name not in wanted:
                model.source_config = model.config = entry.config
                model.canary = entry.config.canary if entry.config is not None else None
                model.error = entry.error
        self._seen = _fingerprints(entries)
        await asyncio.gather(*(self._initial(e) for e in entries if e.name in wanted))
        self.initial_load_done = True
        summary, failures = load_summary(self.models.values(), wanted)
        (logger.warning if failures else logger.info)("initial load done: %s", summary)
        if self.control_mode == "poll" and not self.shutting_down:
            self._poll_task = loop.create_task(self._poll_loop())
        if not self.shutting_down:
            self.on_demand.start()

    async def _initial(self, entry: ModelEntry) -> None:
        async with self._lock(entry.name):
            model = self._register(entry)
            model.required = True
            if take_config(model, entry, reset=True):
                await self._executor.reconcile(model, entry, Change(retry_failed=True))
            self._log_error(model)

    def _log_error(self, model: Model) -> None:
        """Log why ``model`` cannot be loaded (its configuration, its version folders), as
        the initial load does, once per distinct reason: a poll finds the same one every
        scan until the folder is fixed. (A version whose load fails logs its own error.)"""
        error = model.error
        if not error:
            self._logged_errors.pop(model.name, None)
            return
        if self._logged_errors.get(model.name) != error:
            logger.error("model %s cannot be loaded: %s", model.name, error)
            self._logged_errors[model.name] = error

    async def _poll_loop(self) -> None:
        while not self.shutting_down:
            await asyncio.sleep(self.poll_interval_s)
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("polling the model repository %s failed", self.repository)

    async def poll_once(self) -> None:
        """Scan the repository once and apply what changed (``poll`` mode; tests call it).

        New models and versions load, removed ones unload, a changed ``config.yaml`` reloads
        every version, a changed version folder reloads that version. A new or changed folder
        loads only once two scans in a row saw the same content (it is not being written).
        """
        loop = asyncio.get_running_loop()
        entries = await loop.run_in_executor(None, scan_repository, self.repository)
        previous, self._seen = self._seen, _fingerprints(entries)
        names = {e.name for e in entries}
        tasks = [self._poll_model(e, previous.get(e.name)) for e in entries]
        tasks += [self._remove(name) for name in list(self.models) if name not in names]
        await asyncio.gather(*tasks)

    async def _poll_model(self, entry: ModelEntry, previous: dict[int, Fingerprint] | None) -> None:
        """Apply one scan to one model; ``previous``: its version folders' fingerprints at
        the scan before (None: it was not there)."""
        seen = previous or {}
        settled = {v for v, f in entry.folders.items() if seen.get(v) == f.fingerprint}
        # what a half-copied folder shows is not worth an error: a model is judged once two
        # scans in a row saw it the same
        steady = previous is not None and settled == set(entry.folders)
        async with self._lock(entry.name):
            if self.shutting_down:
                return
            model = self._register(entry)
            if not take_config(model, entry, reset=False):
                if steady:  # a new model, or one not serving, with a bad config
                    self._log_error(model)
                return
            if self.on_demand.dormant(model):  # loads at its next request
                return
            await self._executor.reconcile(
                model, entry, Change(retry_failed=False, settled=settled)
            )
            if steady:
                self._log_error(model)
            if model.route.default is not None:
                model.required = True

    async def _remove(self, name: str) -> None:
        async with self._lock(name):
            model = self.models.get(name)
            if model is None:
                return
            logger.info("model %s was removed from the repository: unloading", name)
            model.required = False
            await self._executor.unload_all(model, "model removed from the repository")
            if self.models.get(name) is model:
                del self.models[name]
                self._logged_errors.pop(name, None)
                for listener in self.removal_listeners:
                    try:
                        listener(name)
                    except Exception:
                        logger.exception("a model removal listener failed")

    async def close(self, drain_timeout_s: float = 30.0) -> None:
        """Stop taking requests, drain every version (up to the timeout, seconds), unload."""
        self.shutting_down = True
        await self.on_demand.stop()
        if self._poll_task is not None:
            self._poll_task.cancel()
            await asyncio.gather(self._poll_task, return_exceptions=True)
        await stop_all(self.models, drain_timeout_s)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no version has a queued or running request; False after ``timeout_s``
        seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            if self.in_flight() == 0:
                return True
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.01)

    # -- the repository API ------------------------------------------------------------------

    def cold(self, name: str) -> bool:
        """Whether a request for ``name`` must wait for :meth:`ensure_loaded` (a dict
        lookup; see :meth:`OnDemand.cold`)."""
        return self.on_demand.cold(name)

    async def ensure_loaded(self, name: str) -> None:
        """Load ``name`` on demand, within the limits (see :meth:`OnDemand.ensure_loaded`).

        Raises:
            ModelNotFoundError: no such model.
            ModelNotReadyError: it could not be loaded in time (the reason).
        """
        await self.on_demand.ensure_loaded(name)

    async def load(
        self,
        name: str,
        config_override: dict[str, Any] | None = None,
        folder: Path | None = None,
    ) -> None:
        """Load ``name`` or, if loaded, apply the repository's current state to it (new and
        changed versions, a changed config), with the zero-downtime swap. Clears rollback
        holds and API canaries: the version policy and ``config.yaml`` decide again.

        Args:
            name: Model folder name.
            config_override: A complete model configuration (the ``config.yaml`` fields, as
                JSON) used instead of ``config.yaml`` until the next load (as Triton does).
            folder: A model folder (named ``name``) outside the repository to load the
                versions from instead of the repository's (a load request's files); the
                model keeps its repository name and path.

        Raises:
            InvalidInputError: not in ``explicit`` mode.
            ModelNotFoundError: no such model folder.
            ConfigError: invalid config or override, or a version failed to load (the message
                names each version and its cause; what served before keeps serving).
            ModelNotReadyError: loading it would pass ``--max-loaded-models`` or
                ``--loaded-models-memory-bytes`` and no loaded model can be evicted (503).
        """
        self._require_explicit("load")
        path = folder if folder is not None else self.repository / name
        if not path.is_dir():  # answered by the read (no such model)
            await self._load_explicit(name, path, config_override, folder)
            return
        # within --max-loaded-models / memory limits: room is made first, and the load
        # holds its place until it ends, so loads on demand beside it cannot take it
        async with self.on_demand.reserve(name, path, config_override):
            await self._load_explicit(name, path, config_override, folder)

    async def _load_explicit(
        self, name: str, path: Path, config_override: dict[str, Any] | None, folder: Path | None
    ) -> None:
        async with self._lock(name):
            loop = asyncio.get_running_loop()
            entry = await loop.run_in_executor(None, read_model, path, config_override)
            model = self._register(entry)
            model.path = self.repository / name  # a load from files does not move it
            model.override = config_override is not None
            model.failed.clear()
            model.held.clear()
            if not take_config(model, entry, reset=True):
                raise ConfigError(f"failed to load model '{name}': {entry.error}")
            failures = await self._executor.reconcile(model, entry, Change(retry_failed=True))
            if model.route.default is not None:
                model.required = True
            if failures:
                raise ConfigError(load_failed(name, failures, model.served_version()))
            if model.route.default is None:
                raise ConfigError(
                    f"failed to load model '{name}': {model.error or model_status(model)}"
                )

    async def unload(self, name: str) -> None:
        """Unload every version of ``name``: new requests get 503 at once, queued and running
        ones finish (up to ``unload_timeout_s``); returns when the instances have stopped.

        Raises:
            InvalidInputError: not in ``explicit`` mode.
            ModelNotFoundError: no such model.
        """
        self._require_explicit("unload")
        async with self._lock(name):
            model = self.model(name)
            model.required = False
            model.evicted = None  # stays unloaded (unless models load on demand)
            model.memory_bytes = {}
            await self._executor.unload_all(model, "unload requested")

    async def rollback(self, name: str) -> int:
        """Serve the previously served version again (zero-downtime swap).

        The version served now, and any version above the target, are held back (the policy
        skips them) until the model is loaded explicitly, a canary of them is promoted, or
        their folder changes. The canary, if any, ends.

        Returns:
            The version now served.

        Raises:
            ModelNotFoundError: no such model.
            InvalidInputError: nothing is served, or there is no earlier version.
            ConfigError: the target version failed to load (the current one keeps serving).
        """
        async with self._lock(name):
            model = self.model(name)
            current = model.served_version()
            if current is None:
                raise InvalidInputError(
                    f"model '{name}' serves no version, so there is nothing to roll back "
                    f"({model_status(model)})"
                )
            entry = await last_scan(model)
            plan = rollout.plan_rollback(name, current, Settings.of(model), entry.folders)
            why = f"rolled back to version {plan.target}"
            await self._executor.command(
                model, entry, plan.settings, plan.target, forward=False, why=why
            )
            logger.info("model %s rolled back from version %d to %d", name, current, plan.target)
            return plan.target

    async def set_canary(self, name: str, version: int, weight: float) -> None:
        """Send ``weight`` (0..1) of the unversioned requests of ``name`` to ``version``
        (loaded and warmed up first if needed); the rest keep going to the default version.

        Raises:
            ModelNotFoundError: no such model or version folder.
            InvalidInputError: a weight outside 0..1, or the version is the default one.
            ConfigError: the version failed to load (nothing changes).
        """
        canary = rollout.canary_config(name, version, weight)
        async with self._lock(name):
            model = self.model(name)
            entry = await last_scan(model, extra=version)
            settings = rollout.plan_canary(
                name, canary, model.served_version(), Settings.of(model), entry.folders
            )
            await self._executor.command(model, entry, settings, version, forward=True, canary=True)
            logger.info("model %s: canary version %d at weight %.3f", name, version, weight)

    async def promote_canary(self, name: str) -> int:
        """Make the canary the default version (zero-downtime swap); returns it.

        Raises:
            ModelNotFoundError: no such model.
            InvalidInputError: no canary.
            ConfigError: the canary could not be loaded (nothing changes).
        """
        async with self._lock(name):
            model = self.model(name)
            canary = rollout.current_canary(name, model.canary)
            entry = await last_scan(model)
            settings = rollout.plan_promote(canary, Settings.of(model), entry.folders)
            why = f"canary version {canary} promoted"
            await self._executor.command(model, entry, settings, canary, forward=True, why=why)
            logger.info("model %s: canary version %d promoted", name, canary)
            return canary

    async def abort_canary(self, name: str) -> None:
        """End the canary: all unversioned traffic goes to the default version again, and the
        canary version is held back (unloaded unless the version policy keeps it).

        Raises:
            ModelNotFoundError: no such model.
            InvalidInputError: no canary.
        """
        async with self._lock(name):
            model = self.model(name)
            canary = rollout.current_canary(name, model.canary)
            entry = await last_scan(model)
            served = model.served_version()
            adopt(model, rollout.plan_abort(canary, served, Settings.of(model), entry.folders))
            await self._executor.reconcile(model, entry, Change(False, why="canary aborted"))
            logger.info("model %s: canary version %d aborted", name, canary)

    # -- reports -----------------------------------------------------------------------------

    def model_status(self, model: Model) -> str:
        """One line: why ``model`` serves or does not."""
        return model_status(model)

    def index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        """The V2 repository index (see :mod:`gpuserve.repository.report`)."""
        return index_rows(self.models, ready_only)

    def status(self, name: str) -> dict[str, Any]:
        """One model's served version, canary, held back versions and index rows.

        Raises:
            ModelNotFoundError: no such model.
        """
        return model_summary(self.model(name))

    # -- helpers -----------------------------------------------------------------------------

    def _lock(self, name: str) -> asyncio.Lock:
        lock = self._locks.get(name)
        if lock is None:
            lock = self._locks[name] = asyncio.Lock()
        return lock

    def _register(self, entry: ModelEntry) -> Model:
        model = self.models.get(entry.name)
        if model is None:
            model = Model(entry.name, entry.config, path=entry.path, error=entry.error)
            model.source_config = entry.config
            self.models[entry.name] = model
        return model

    def _version_stopped(self, mv: ModelVersion, runner: VersionRunner) -> None:
        for listener in self.stop_listeners:
            try:
                listener(mv, runner)
            except Exception:
                logger.exception("a version stop listener failed")

    async def _load_version(self, mv: ModelVersion) -> None:
        if mv.config.ensemble is not None:  # steps run on other models' schedulers
            await load_ensemble(mv, self.version_listeners, self)
            return
        await load_version(
            mv,
            self.version_listeners,
            router=self,
            admission_pool=self.admission_pool,
            auto_complete=self.auto_complete,
        )

    def _require_explicit(self, action: str) -> None:
        """Refuse a load or unload outside ``explicit`` mode in Triton's words (its clients
        and tests look for them), then why. 400, not Triton's 503: the refusal is permanent
        for this server, and 503 tells a client to retry."""
        if self.control_mode != "explicit":
            raise InvalidInputError(
                "explicit model load / unload is not allowed if polling is enabled (model "
                f"{action} requests need model_control_mode 'explicit'; this server runs in "
                f"'{self.control_mode}' mode)"
            )


def _fingerprints(entries: list[ModelEntry]) -> dict[str, dict[int, Fingerprint]]:
    """Each model's version folder fingerprints, by model name and version."""
    return {e.name: {v: f.fingerprint for v, f in e.folders.items()} for e in entries}
