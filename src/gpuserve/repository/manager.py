"""The model manager: loads the versions a repository selects and routes requests to them.

Each model has a **loaded set** (its versions and their states) and a **route** (the default
version for requests that name none, and an optional canary), kept apart (see
:mod:`gpuserve.repository.state`). Every change, whatever asks for it (start-up, the
repository API, the poll loop, rollback, canary), goes through one procedure, under a
per-model lock so concurrent requests for the same model run one after the other:

1. work out the wanted set: the version policy over the loadable version folders, minus held
   back versions, plus the canary;
2. load and warm up what is missing, beside what is serving (a version that fails is reported
   and never replaces one that serves: it is treated as absent);
3. switch: new versions join the loaded set and the route changes in one step;
4. drain: versions that left take no new requests, finish what they had queued and running
   (up to ``unload_timeout_s``), then stop their instances and drop their memory.

Server readiness rule (documented in the README): the server is ready when the initial load
has finished, it is not shutting down, and at least one model version is READY. With
``strict_readiness`` every *required* model must have a READY version instead: the models
loaded at start and those loaded since, until they are unloaded or removed. A failed load
never turns a serving server unready, and an empty server is never ready (BC-16, BC-17).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from gpuserve.config import CONFIG_FILENAME, CanaryConfig, ServerConfig, parse_model_config
from gpuserve.engine.scheduler import ModelScheduler
from gpuserve.errors import ConfigError, InvalidInputError, ModelNotFoundError, ModelNotReadyError
from gpuserve.repository.devices import release_device_memory
from gpuserve.repository.loading import load_version, serving, stop_version
from gpuserve.repository.report import index_rows, model_status, model_summary
from gpuserve.repository.repository import (
    Fingerprint,
    ModelEntry,
    VersionFolder,
    read_version_folder,
    scan_model,
    scan_repository,
)
from gpuserve.repository.routing import desired_versions, install_route
from gpuserve.repository.state import Model, ModelVersion, Route, VersionState

__all__ = ["Model", "ModelManager", "ModelVersion", "Route", "VersionState"]

logger = logging.getLogger(__name__)

ControlMode = Literal["none", "explicit", "poll"]


class ModelManager:
    """Owns every model version: loads, routes, swaps, drains and unloads them.

    Args:
        repository: The model repository folder.
        control_mode: ``none``, ``explicit`` or ``poll`` (see ``ServerConfig``).
        load_models: Models loaded at start in ``explicit`` mode (``*`` = all).
        poll_interval_s: Seconds between repository scans in ``poll`` mode.
        unload_timeout_s: Drain time of a version that leaves, seconds.
        strict_readiness: The readiness rule (module docstring).
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
    ) -> None:
        self.repository = repository
        self.control_mode = control_mode
        self.load_models = list(load_models)
        self.poll_interval_s = poll_interval_s
        self.unload_timeout_s = unload_timeout_s
        self.strict_readiness = strict_readiness
        self.models: dict[str, Model] = {}
        self.initial_load_done = False
        self.shutting_down = False
        #: Called (on the event loop) with each version that is about to turn READY, before
        #: any request can reach it: the metrics layer subscribes to its stats here.
        self.version_listeners: list[Callable[[ModelVersion], None]] = []
        self._locks: dict[str, asyncio.Lock] = {}
        self._seen: dict[str, dict[int, Fingerprint]] = {}  # poll: fingerprints last scan
        self._poll_task: asyncio.Task[None] | None = None

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
        for entry in entries:
            model = self._register(entry)
            if entry.name not in wanted:
                model.source_config = model.config = entry.config
                model.error = entry.error
        self._seen = {e.name: {v: f.fingerprint for v, f in e.folders.items()} for e in entries}
        await asyncio.gather(*(self._initial(e) for e in entries if e.name in wanted))
        self.initial_load_done = True
        ready = [f"{m.name}:{v}" for m in self.models.values() for v in m.ready_versions()]
        logger.info("initial load done: %d version(s) ready: %s", len(ready), ", ".join(ready))
        if self.control_mode == "poll" and not self.shutting_down:
            self._poll_task = loop.create_task(self._poll_loop())

    async def _initial(self, entry: ModelEntry) -> None:
        async with self._lock(entry.name):
            model = self._register(entry)
            model.required = True
            if self._configure(model, entry, reset=True):
                await self._apply(model, entry, retry_failed=True)
            if model.error:
                logger.error("model %s cannot be loaded: %s", entry.name, model.error)

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
        previous, self._seen = (
            self._seen,
            {e.name: {v: f.fingerprint for v, f in e.folders.items()} for e in entries},
        )
        names = {e.name for e in entries}
        tasks = [self._poll_model(e, previous.get(e.name, {})) for e in entries]
        tasks += [self._remove(name) for name in list(self.models) if name not in names]
        await asyncio.gather(*tasks)

    async def _poll_model(self, entry: ModelEntry, previous: dict[int, Fingerprint]) -> None:
        async with self._lock(entry.name):
            if self.shutting_down:
                return
            model = self._register(entry)
            if not self._configure(model, entry, reset=False):
                return

            def settled(version: int, prints: Fingerprint) -> bool:
                return previous.get(version) == prints

            await self._apply(model, entry, settled=settled, retry_failed=False)
            if model.route.default is not None:
                model.required = True

    async def _remove(self, name: str) -> None:
        async with self._lock(name):
            model = self.models.get(name)
            if model is None:
                return
            logger.info("model %s was removed from the repository: unloading", name)
            model.required = False
            retiring = self._take_out_all(model)
            await self._retire(model, retiring, "model removed from the repository")
            if self.models.get(name) is model:
                del self.models[name]

    async def close(self, drain_timeout_s: float = 30.0) -> None:
        """Stop taking requests, drain every version (up to the timeout) and unload."""
        self.shutting_down = True
        if self._poll_task is not None:
            self._poll_task.cancel()
            await asyncio.gather(self._poll_task, return_exceptions=True)
        closing = []
        for model in list(self.models.values()):
            for mv in list(model.versions.values()):
                if mv.scheduler is not None:
                    mv.state = VersionState.UNLOADING
                    closing.append(stop_version(mv, drain_timeout_s))
        await asyncio.gather(*closing)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no version has a queued or running request; False after ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            busy = sum(
                mv.scheduler.in_flight_requests
                for model in list(self.models.values())
                for mv in list(model.versions.values())
                if mv.scheduler is not None
            )
            if busy == 0:
                return True
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.01)

    # -- the repository API ------------------------------------------------------------------

    async def load(self, name: str, config_override: dict[str, Any] | None = None) -> None:
        """Load ``name`` or, if loaded, apply the repository's current state to it (new and
        changed versions, a changed config), with the zero-downtime swap. Clears rollback
        holds and API canaries: the version policy and ``config.yaml`` decide again.

        Args:
            name: Model folder name.
            config_override: A complete model configuration (the ``config.yaml`` fields, as
                JSON) used instead of ``config.yaml`` until the next load (as Triton does).

        Raises:
            InvalidInputError: not in ``explicit`` mode.
            ModelNotFoundError: no such model folder.
            ConfigError: invalid config or override, or a version failed to load (the message
                names each version and its cause; what served before keeps serving).
        """
        self._require_explicit("load")
        path = self.repository / name
        async with self._lock(name):
            entry = await self._scan(path, config_override)
            model = self._register(entry)
            model.override = config_override is not None
            model.failed.clear()
            model.held.clear()
            if not self._configure(model, entry, reset=True):
                raise ConfigError(f"failed to load model '{name}': {entry.error}")
            failures = await self._apply(model, entry, retry_failed=True)
            if model.route.default is not None:
                model.required = True
            self._raise_failures(model, failures)
            if model.route.default is None:
                raise ConfigError(
                    f"failed to load model '{name}': {model.error or self.model_status(model)}"
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
            retiring = self._take_out_all(model)
            await self._retire(model, retiring, "unload requested")

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
            current = model.route.default
            if current is None:
                raise InvalidInputError(
                    f"model '{name}' serves no version, so there is nothing to roll back "
                    f"({self.model_status(model)})"
                )
            entry = await self._scan_existing(model)
            loadable = entry.loadable()
            target = None
            history = list(model.history)
            while history:
                candidate = history.pop()
                if candidate != current.version and candidate in loadable:
                    target = candidate
                    break
            if target is None:
                earlier = [v for v in loadable if v < current.version]
                if not earlier:
                    raise InvalidInputError(
                        f"model '{name}' has no version to roll back to from version "
                        f"{current.version} (version folders: {entry.available})"
                    )
                target = earlier[-1]
            saved = (dict(model.held), model.canary, list(model.history))
            model.history = history
            model.canary = None
            for v in entry.available:
                if v > target and v in entry.folders:
                    model.held[v] = entry.folders[v].fingerprint
            model.held.pop(target, None)
            await self._apply_required(
                model, entry, target, saved, forward=False, why=f"rolled back to version {target}"
            )
            logger.info("model %s rolled back from version %d to %d", name, current.version, target)
            return target

    async def set_canary(self, name: str, version: int, weight: float) -> None:
        """Send ``weight`` of the unversioned requests of ``name`` to ``version`` (loaded and
        warmed up first if needed); the rest keep going to the default version.

        Raises:
            ModelNotFoundError: no such model or version folder.
            InvalidInputError: a weight outside 0..1, or the version is the default one.
            ConfigError: the version failed to load (nothing changes).
        """
        try:
            canary = CanaryConfig(version=version, weight=weight)
        except ValidationError as err:
            problem = err.errors()[0]
            field = ".".join(str(part) for part in problem["loc"])
            raise InvalidInputError(
                f"canary for model '{name}': field '{field}': {problem['msg']} "
                f"(given: {problem.get('input')!r})"
            ) from None
        async with self._lock(name):
            model = self.model(name)
            entry = await self._scan_existing(model, extra=version)
            if version not in entry.folders:
                raise ModelNotFoundError(
                    f"model '{name}' has no version folder {version} (versions: {entry.available})"
                )
            if entry.folders[version].problem is not None:
                raise ConfigError(f"model '{name}': {entry.folders[version].problem}")
            if model.served_version() == version:
                raise InvalidInputError(
                    f"model '{name}' version {version} is already the default version"
                )
            saved = (dict(model.held), model.canary, list(model.history))
            model.canary = canary
            model.held.pop(version, None)
            await self._apply_required(model, entry, version, saved, forward=True, canary=True)
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
            canary = self._current_canary(model)
            entry = await self._scan_existing(model)
            saved = (dict(model.held), model.canary, list(model.history))
            model.canary = None
            model.held.pop(canary, None)
            for v in entry.loadable():
                if v > canary:
                    model.held[v] = entry.folders[v].fingerprint
            await self._apply_required(
                model, entry, canary, saved, forward=True, why=f"canary version {canary} promoted"
            )
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
            canary = self._current_canary(model)
            entry = await self._scan_existing(model)
            model.canary = None
            served = model.served_version()
            if served is not None and canary > served and canary in entry.folders:
                model.held[canary] = entry.folders[canary].fingerprint
            await self._apply(model, entry, retry_failed=False, why="canary aborted")
            logger.info("model %s: canary version %d aborted", name, canary)

    # -- lookup (the request path) -----------------------------------------------------------

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
        """The version to serve: the named one, or the default one of the route.

        Raises:
            ModelNotFoundError: unknown model or version.
            ModelNotReadyError: the model or version exists but is not READY (loading,
                failed, unloading, unloaded), with the reason.
        """
        model = self.models.get(name)
        if model is None:
            model = self.model(name)
        if version:
            mv = model.versions.get(int(version)) if version.isdigit() else None
            if mv is None:
                self._missing_version(model, version)
            assert mv is not None
            if mv.state is not VersionState.READY:
                raise ModelNotReadyError(
                    f"model '{name}' version {version} is not ready: {mv.state.value}"
                    + (f" ({mv.reason})" if mv.reason else "")
                )
            return serving(mv)
        mv = model.route.default
        if mv is None or mv.state is not VersionState.READY:
            raise ModelNotReadyError(f"model '{name}' is not ready: {self.model_status(model)}")
        return serving(mv)

    def split(self, mv: ModelVersion, request_id: str | None) -> ModelVersion:
        """Where an unversioned request that :meth:`version` resolved to ``mv`` goes: ``mv``,
        or the model's canary for the canary's share (by a hash of ``request_id``)."""
        model = self.models.get(mv.model)
        route = model.route if model is not None else None
        if route is None or route.canary is None or route.default is not mv:
            return mv
        chosen = route.pick(request_id)
        return chosen if chosen is not None and chosen.state is VersionState.READY else mv

    def scheduler(self, name: str, version: str | None) -> ModelScheduler:
        """The scheduler of the version serving ``name`` (see :meth:`version`)."""
        scheduler = self.version(name, version).scheduler
        assert scheduler is not None
        return scheduler

    def _missing_version(self, model: Model, version: str) -> None:
        number = int(version) if version.isdigit() else None
        if number is not None and number in model.pending:
            raise ModelNotReadyError(
                f"model '{model.name}' version {version} is not ready: LOADING"
            )
        if number is not None and number in model.notes:
            raise ModelNotReadyError(
                f"model '{model.name}' version {version} is not ready: {model.notes[number]}"
            )
        raise ModelNotFoundError(
            f"model '{model.name}' has no version '{version}' "
            f"(versions served: {model.ready_versions()})"
        )

    # -- readiness and reports ---------------------------------------------------------------

    def is_ready(self) -> bool:
        """Server readiness (rule in the module docstring)."""
        if self.shutting_down or not self.initial_load_done:
            return False
        models = list(self.models.values())
        if not self.strict_readiness:
            return any(m.route.default is not None for m in models)
        required = [m for m in models if m.required]
        return bool(required) and all(m.route.default is not None for m in required)

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

    # -- the one change procedure ------------------------------------------------------------

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

    def _configure(self, model: Model, entry: ModelEntry, *, reset: bool) -> bool:
        """Take ``entry``'s config as the model's; False when there is none to take.

        An invalid config never stops a serving model: it keeps its previous config and the
        problem shows in the index. ``reset`` (start, explicit load) also takes the config's
        canary; otherwise the canary follows the config only when the config's canary changed.
        """
        if entry.config is None:
            if model.route.default is not None:
                model.warning = f"configuration change not applied: {entry.error}"
                logger.error("model %s: %s", model.name, model.warning)
            else:
                model.error = entry.error
                model.config = None
            return False
        previous = model.source_config
        if reset or previous is None or previous.canary != entry.config.canary:
            model.canary = entry.config.canary
        model.source_config = entry.config
        model.warning = None
        model.error = entry.error
        if model.route.default is None:
            model.config = entry.config
        return True

    async def _apply(
        self,
        model: Model,
        entry: ModelEntry,
        *,
        settled: Callable[[int, Fingerprint], bool] | None = None,
        retry_failed: bool,
        require: int | None = None,
        forward: bool = True,
        why: str = "not selected by the version policy",
    ) -> dict[int, str]:
        """Bring ``model`` in line with ``entry`` and its routing settings (steps 1-4 of the
        module docstring). The caller holds the model's lock.

        Args:
            settled: ``poll``: whether a folder's content is the same as on the last scan;
                folders that are still changing are left for a later scan.
            retry_failed: Load versions again that failed before with the same content.
            require: This version must end up loaded, or nothing changes (ConfigError).
            forward: Record the version served before in the rollback history.
            why: Why versions that leave are unloaded (the index shows it).

        Returns:
            The versions that failed to load in this call, with their reasons.
        """
        folders = entry.folders
        for v in list(model.notes):
            if v not in folders and v not in model.versions:
                del model.notes[v]
        for table in (model.failed, model.held):
            for v in [v for v, prints in table.items() if folders.get(v, None) is None]:
                del table[v]
        for v, prints in list(model.held.items()):
            if folders[v].fingerprint != prints:  # someone changed it: no longer held back
                del model.held[v]
        reconfigure = {
            v
            for v, mv in model.versions.items()
            if mv.state is VersionState.READY and mv.source_config != model.source_config
        }
        live = {v: mv for v, mv in model.versions.items() if mv.state is VersionState.READY}
        candidates: list[int] = []
        for v, folder in sorted(folders.items()):
            if folder.problem is not None:
                if v not in live:
                    model.notes[v] = folder.problem
                candidates += [v] if v in live else []
                continue
            if not retry_failed and model.failed.get(v) == folder.fingerprint:
                candidates += [v] if v in live else []
                continue
            if settled is not None and not settled(v, folder.fingerprint) and v not in live:
                model.notes[v] = f"{folder.path}: still changing; loads once it stays unchanged"
                continue
            candidates.append(v)

        def loadable_now(v: int) -> bool:
            folder = folders[v]
            if folder.problem is not None:
                return False
            if not retry_failed and model.failed.get(v) == folder.fingerprint:
                return False
            return settled is None or settled(v, folder.fingerprint)

        def needs_load(v: int) -> bool:
            mv = live.get(v)
            return mv is None or v in reconfigure or mv.fingerprint != folders[v].fingerprint

        fresh: dict[int, ModelVersion] = {}
        failures: dict[int, str] = {}
        try:
            while True:
                desired = desired_versions(model, candidates)
                todo = [
                    v
                    for v in sorted(desired)
                    if v not in fresh and v not in failures and needs_load(v) and loadable_now(v)
                ]
                if not todo:
                    break
                loaded = await asyncio.gather(*(self._load_new(model, folders[v]) for v in todo))
                for mv in loaded:
                    if mv.state is VersionState.READY:
                        fresh[mv.version] = mv
                        continue
                    failures[mv.version] = mv.reason
                    model.failed[mv.version] = folders[mv.version].fingerprint
                    if mv.version not in live:
                        model.notes[mv.version] = mv.reason
                        candidates.remove(mv.version)
                    else:  # the version keeps its previous load
                        model.notes[mv.version] = f"reload failed: {mv.reason}"
                if require is not None and require in failures:
                    raise ConfigError(
                        f"model '{model.name}' version {require} failed to load: "
                        f"{failures[require]}"
                    )
        except BaseException:  # nothing switches: what loaded for this change goes again
            await self._discard(model, fresh.values())
            raise
        if self.shutting_down:
            await self._discard(model, fresh.values())
            return failures
        desired = desired_versions(model, candidates)
        if require is not None and require not in desired:
            await self._discard(model, fresh.values())
            raise ConfigError(
                f"model '{model.name}': version {require} is not selected by the version policy "
                f"of its config (versions loadable: {sorted(candidates)})"
            )
        # -- switch: one synchronous step, so every request sees the old or the new state --
        retiring: list[ModelVersion] = []
        for v, mv in fresh.items():
            old = model.versions.get(v)
            if old is not None and old is not mv:
                retiring.append(old)
            model.versions[v] = mv
            model.notes.pop(v, None)
            model.failed.pop(v, None)
        for v, mv in list(model.versions.items()):
            if v not in desired and mv.state is VersionState.READY:
                retiring.append(mv)
        for mv in retiring:
            mv.state = VersionState.UNLOADING
        install_route(model, forward=forward)
        if fresh or retiring:
            logger.info(
                "model %s: loaded %s, unloading %s, serving %s%s",
                model.name,
                sorted(fresh) or "nothing",
                sorted(mv.version for mv in retiring) or "nothing",
                model.served_version(),
                f" (canary {model.route.canary.version} at {model.route.weight:.3f})"
                if model.route.canary
                else "",
            )
        model.entry = entry
        # -- drain what left --
        await self._retire(model, retiring, why)
        return failures

    async def _apply_required(
        self,
        model: Model,
        entry: ModelEntry,
        version: int,
        saved: tuple[dict[int, Fingerprint], CanaryConfig | None, list[int]],
        *,
        forward: bool,
        canary: bool = False,
        why: str = "not selected by the version policy",
    ) -> None:
        """:meth:`_apply` that must end with ``version`` serving (as default or canary);
        otherwise the routing settings in ``saved`` come back and ConfigError is raised."""
        try:
            await self._apply(
                model, entry, retry_failed=True, require=version, forward=forward, why=why
            )
            route = model.route
            serving = route.canary if canary else route.default
            if serving is None or serving.version != version:
                raise ConfigError(
                    f"model '{model.name}' version {version} could not be made the "
                    f"{'canary' if canary else 'default'} version ({self.model_status(model)})"
                )
        except BaseException:
            model.held, model.canary, model.history = saved
            install_route(model, forward=False)
            raise

    def _take_out_all(self, model: Model) -> list[ModelVersion]:
        retiring = [mv for mv in model.versions.values() if mv.state is VersionState.READY]
        for mv in retiring:
            mv.state = VersionState.UNLOADING
        model.route = Route()
        model.config = model.source_config
        return retiring

    async def _retire(self, model: Model, retiring: list[ModelVersion], why: str) -> None:
        if not retiring:
            return
        await asyncio.gather(*(stop_version(mv, self.unload_timeout_s) for mv in retiring))
        for mv in retiring:
            if model.versions.get(mv.version) is mv:
                del model.versions[mv.version]
                model.notes[mv.version] = f"unloaded ({why})"
        release_device_memory()

    async def _discard(self, model: Model, versions: Iterable[ModelVersion]) -> None:
        """Stop versions that loaded for a change that does not happen (they never were in
        the route) and take them out of the loaded set."""
        for mv in list(versions):
            mv.state = VersionState.UNLOADING
            await stop_version(mv, 0.0)
            number = mv.version
            if model.versions.get(number) is mv:
                del model.versions[number]

    async def _load_new(self, model: Model, folder: VersionFolder) -> ModelVersion:
        assert model.source_config is not None
        mv = ModelVersion(
            model.name,
            folder.version,
            folder.path,
            model.source_config,
            fingerprint=folder.fingerprint,
            source_config=model.source_config,
        )
        replacing = folder.version in model.versions
        if replacing:
            model.pending[folder.version] = mv
        else:
            model.versions[folder.version] = mv
            model.notes.pop(folder.version, None)
        try:
            await self._load_version(mv)
        finally:
            if replacing:
                model.pending.pop(folder.version, None)
            elif mv.state is not VersionState.READY and model.versions.get(mv.version) is mv:
                del model.versions[mv.version]
        return mv

    async def _load_version(self, mv: ModelVersion) -> None:
        await load_version(mv, self.version_listeners)

    # -- helpers -----------------------------------------------------------------------------

    def _require_explicit(self, action: str) -> None:
        if self.control_mode != "explicit":
            raise InvalidInputError(
                f"model {action} requests need model_control_mode 'explicit' "
                f"(this server runs in '{self.control_mode}' mode)"
            )

    def _current_canary(self, model: Model) -> int:
        if model.canary is None:
            raise InvalidInputError(f"model '{model.name}' has no canary")
        return model.canary.version

    async def _scan(self, path: Path, override: dict[str, Any] | None) -> ModelEntry:
        loop = asyncio.get_running_loop()
        if not path.is_dir() or path.name.startswith((".", "_")):
            raise ModelNotFoundError(f"no model '{path.name}' in the repository {path.parent}")
        if override is None and not (path / CONFIG_FILENAME).is_file():
            raise ModelNotFoundError(
                f"no model '{path.name}' in the repository {path.parent} (no {CONFIG_FILENAME})"
            )
        config = None
        if override is not None:
            config = parse_model_config(
                override, Path(f"<load request for {path.name}>"), path.name
            )
        return await loop.run_in_executor(None, scan_model, path, config)

    async def _scan_existing(self, model: Model, extra: int | None = None) -> ModelEntry:
        """The scan the model was last brought in line with (so a rollback or canary never
        picks up other repository changes), plus version folder ``extra`` read now."""
        entry = model.entry
        if entry is None or model.source_config is None:
            raise InvalidInputError(
                f"model '{model.name}' is not loaded ({model.error or self.model_status(model)})"
            )
        folders = dict(entry.folders)
        if extra is not None and extra not in folders:
            assert model.path is not None
            path = model.path / str(extra)
            if path.is_dir():
                loop = asyncio.get_running_loop()
                folders[extra] = await loop.run_in_executor(None, read_version_folder, path)
        return ModelEntry(
            entry.name,
            entry.path,
            config=model.source_config,
            versions=list(entry.versions),
            available=sorted(folders),
            folders=folders,
        )

    def _raise_failures(self, model: Model, failures: dict[int, str]) -> None:
        if not failures:
            return
        served = model.served_version()
        causes = "; ".join(f"version {v}: {reason}" for v, reason in sorted(failures.items()))
        tail = f"; version {served} keeps serving" if served is not None else ""
        raise ConfigError(f"failed to load model '{model.name}': {causes}{tail}")
