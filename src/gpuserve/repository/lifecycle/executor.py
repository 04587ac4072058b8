"""The executor: carries out the planner's plans on a :class:`Model` (the side effects).

:meth:`Executor.reconcile` drives one change (see :mod:`gpuserve.repository.lifecycle.planner`):

1. plan (what may serve, what would load) and apply the bookkeeping;
2. load and warm up, round by round, what the plan asks for, beside what is serving (a
   version that fails is recorded and never replaces one that serves);
3. switch: new versions join the loaded set and the route changes in one synchronous step, so
   every request sees the old state or the new one;
4. drain: versions that left take no new requests, finish what they had queued and running
   (up to ``unload_timeout_s``), then stop their instances and drop their memory.

The caller (the manager) holds the model's lock.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

from gpuserve.engine.runners.base import VersionRunner
from gpuserve.errors import ConfigError, InvalidInputError
from gpuserve.repository.lifecycle.devices import release_device_memory
from gpuserve.repository.lifecycle.loading import stop_version
from gpuserve.repository.lifecycle.planner import (
    NOT_SELECTED,
    LoadResult,
    Settings,
    Switch,
    next_loads,
    plan_reconcile,
    plan_switch,
    snapshot,
)
from gpuserve.repository.report import model_status
from gpuserve.repository.lifecycle.retry import RetryBackoff
from gpuserve.repository.scan import ModelEntry, VersionFolder, read_version_folder
from gpuserve.repository.state import Model, ModelVersion, Route, VersionState
from gpuserve.repository.traffic import RoutePlan, plan_route, signature

logger = logging.getLogger(__name__)

#: Loads and warms up one version, marking it READY or failed (raises no Exception).
LoadFn = Callable[[ModelVersion], Awaitable[None]]
#: Told of each version whose runner stopped (drained and closed), with that runner.
StoppedFn = Callable[[ModelVersion, VersionRunner], None]


@dataclass(frozen=True, slots=True)
class Change:
    """How one reconcile runs.

    Attributes:
        retry_failed: Load versions again that failed before with the same content. Without
            it (``poll``), such a version is tried again once its back-off has passed (see
            :mod:`gpuserve.repository.lifecycle.retry`).
        settled: ``poll``: the versions whose folder is the same as on the last scan (the
            others are left for a later scan); None: every folder is settled.
        require: This version must end up loaded, or nothing changes (ConfigError).
        forward: Record the version served before in the rollback history.
        why: Why versions that leave are unloaded (the index shows it).
    """

    retry_failed: bool
    settled: Collection[int] | None = None
    require: int | None = None
    forward: bool = True
    why: str = NOT_SELECTED


class Executor:
    """Loads, switches, drains and discards model versions as the planner decides.

    Args:
        load: Loads one version (the manager's ``_load_version``, so tests can wrap it).
        closing: Whether the server is shutting down (nothing switches then).
        unload_timeout_s: The drain time of a version that leaves, seconds (read per drain).
        retry: When a failed version is tried again by a poll (default back-off).
        stopped: Called with each version whose runner stopped, and that runner (the
            manager's stop listeners: the metrics layer drops the version's series).

    Attributes:
        retry: The :class:`RetryBackoff` in use (tests give it a fake clock).
    """

    def __init__(
        self,
        load: LoadFn,
        closing: Callable[[], bool],
        unload_timeout_s: Callable[[], float],
        retry: RetryBackoff | None = None,
        stopped: StoppedFn | None = None,
    ) -> None:
        self._load = load
        self._closing = closing
        self._unload_timeout_s = unload_timeout_s
        self.retry = retry if retry is not None else RetryBackoff()
        self._stopped = stopped

    async def _stop(self, mv: ModelVersion, timeout_s: float) -> None:
        """Drain and stop ``mv`` (see :func:`~gpuserve.repository.lifecycle.loading.stop_version`),
        then tell the ``stopped`` hook."""
        runner = mv.runner
        await stop_version(mv, timeout_s)
        if runner is not None and self._stopped is not None:
            self._stopped(mv, runner)

    async def reconcile(self, model: Model, entry: ModelEntry, change: Change) -> dict[int, str]:
        """Bring ``model`` in line with ``entry`` and its routing settings (steps 1-4 of
        the module docstring).

        Returns:
            The versions that failed to load in this call, with their reasons.

        Raises:
            ConfigError: ``change.require`` failed to load or is not selected (nothing
                switched; what loaded for the change is unloaded again).
        """
        folders = entry.folders
        if not change.retry_failed:
            self._release_due(model, folders)
        state = snapshot(model)
        plan = plan_reconcile(
            state, folders, settled=change.settled, retry_failed=change.retry_failed
        )
        for v in plan.drop_notes:
            del model.notes[v]
        for v in plan.drop_failed:
            del model.failed[v]
        for v in plan.drop_held:
            del model.held[v]
        model.notes.update(plan.notes)
        results: dict[int, LoadResult] = {}
        fresh: dict[int, ModelVersion] = {}
        failures: dict[int, str] = {}
        try:
            while True:
                step = next_loads(state, plan, results, change.require)
                if step.refused is not None:
                    raise ConfigError(step.refused)
                if not step.versions:
                    break
                loaded = await asyncio.gather(
                    *(self.load_new(model, folders[v]) for v in step.versions)
                )
                for mv in loaded:
                    v = mv.version
                    ready = mv.state is VersionState.READY
                    results[v] = LoadResult(ready, mv.reason, signature(mv.config))
                    if ready:
                        fresh[v] = mv
                        self.retry.forget(model.name, v)
                        continue
                    failures[v] = mv.reason
                    model.failed[v] = folders[v].fingerprint
                    model.notes[v] = plan.failure_note(v, mv.reason)
                    wait_s = self.retry.failed(
                        model.name,
                        v,
                        folders[v].fingerprint,
                        mv.reason,
                        (mv.source_config or mv.config).model_dump_json(),
                    )
                    logger.debug(
                        "model %s version %d: a poll or a request tries it again in %.0f s "
                        "unless its folder changes first",
                        model.name,
                        v,
                        wait_s,
                    )
        except BaseException:  # nothing switches: what loaded for this change goes again
            await self.discard(model, fresh.values())
            raise
        if self._closing():
            await self.discard(model, fresh.values())
            return failures
        switch = plan_switch(state, plan, results, require=change.require, forward=change.forward)
        if switch.refused is not None:
            await self.discard(model, fresh.values())
            raise ConfigError(switch.refused)
        retiring = self.switch(model, fresh, switch)
        model.entry = entry
        await self.retire(model, retiring, change.why)
        return failures

    def _release_due(self, model: Model, folders: Mapping[int, VersionFolder]) -> None:
        """Forget the failure records whose back-off has passed, so the plan loads those
        versions again although their folder did not change."""
        for v, fingerprint in list(model.failed.items()):
            if v in folders and self.retry.due(model.name, v, fingerprint):
                logger.info(
                    "model %s version %d: trying the load that failed again (attempt %d)",
                    model.name,
                    v,
                    self.retry.attempts(model.name, v) + 1,
                )
                del model.failed[v]

    def switch(
        self, model: Model, fresh: dict[int, ModelVersion], plan: Switch
    ) -> list[ModelVersion]:
        """Install ``plan`` in one synchronous step (no await: every request sees the old
        state or the new one); returns the versions that left, now UNLOADING."""
        retiring: list[ModelVersion] = []
        for v in plan.install:
            mv = fresh[v]
            old = model.versions.get(v)
            if old is not None and old is not mv:
                retiring.append(old)
            model.versions[v] = mv
            model.notes.pop(v, None)
            model.failed.pop(v, None)
        for v in plan.retire:
            mv = model.versions[v]
            if mv.state is VersionState.READY:
                retiring.append(mv)
        for mv in retiring:
            mv.state = VersionState.UNLOADING
        install_route(model, plan.route)
        if plan.install or retiring:
            route = model.route
            logger.info(
                "model %s: loaded %s, unloading %s, serving %s%s",
                model.name,
                list(plan.install) or "nothing",
                sorted(mv.version for mv in retiring) or "nothing",
                model.served_version(),
                f" (canary {route.canary.version} at {route.weight:.3f})" if route.canary else "",
            )
        return retiring

    async def command(
        self,
        model: Model,
        entry: ModelEntry,
        settings: Settings,
        version: int,
        *,
        forward: bool,
        canary: bool = False,
        why: str = NOT_SELECTED,
    ) -> None:
        """A rollback or canary command: adopt ``settings`` and reconcile, which must end
        with ``version`` serving (as the default, or the canary with ``canary``); otherwise
        the settings from before come back, routed by again.

        Raises:
            ConfigError: ``version`` failed to load, is not selected, or does not serve.
        """
        saved = Settings.of(model)
        adopt(model, settings)
        change = Change(retry_failed=True, require=version, forward=forward, why=why)
        try:
            await self.reconcile(model, entry, change)
            route = model.route
            serving = route.canary if canary else route.default
            if serving is None or serving.version != version:
                raise ConfigError(
                    f"model '{model.name}' version {version} could not be made the "
                    f"{'canary' if canary else 'default'} version ({model_status(model)})"
                )
        except BaseException:
            adopt(model, saved)
            reroute(model, forward=False)
            raise

    async def unload_all(self, model: Model, why: str, *, frozen: bool = True) -> None:
        """Take every READY version of ``model`` out of the route at once (new requests get
        503), then drain and unload them (:meth:`retire`; ``frozen``: see
        :func:`~gpuserve.repository.lifecycle.devices.release_device_memory`)."""
        retiring = [mv for mv in model.versions.values() if mv.state is VersionState.READY]
        for mv in retiring:
            mv.state = VersionState.UNLOADING
        model.route = Route()
        model.config = model.source_config
        await self.retire(model, retiring, why, frozen=frozen)

    async def retire(
        self, model: Model, retiring: list[ModelVersion], why: str, *, frozen: bool = True
    ) -> None:
        """Drain ``retiring`` (up to ``unload_timeout_s``), unload them, note ``why`` in the
        index and return the device memory they held."""
        if not retiring:
            return
        timeout_s = self._unload_timeout_s()
        await asyncio.gather(*(self._stop(mv, timeout_s) for mv in retiring))
        for mv in retiring:
            if model.versions.get(mv.version) is mv:
                del model.versions[mv.version]
                model.notes[mv.version] = f"unloaded ({why})"
        release_device_memory(frozen=frozen)

    async def discard(self, model: Model, versions: Iterable[ModelVersion]) -> None:
        """Stop versions that loaded for a change that does not happen (they never were in
        the route) and take them out of the loaded set."""
        for mv in list(versions):
            mv.state = VersionState.UNLOADING
            await self._stop(mv, 0.0)
            if model.versions.get(mv.version) is mv:
                del model.versions[mv.version]

    async def load_new(self, model: Model, folder: VersionFolder) -> ModelVersion:
        """Load and warm up the version in ``folder`` beside what serves.

        A new version number shows in the loaded set while it loads (LOADING); a new load of
        a loaded number shows as pending, and the loaded one keeps serving until the switch.
        A version that fails leaves the loaded set again.
        """
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
            await self._load(mv)
        finally:
            if replacing:
                model.pending.pop(folder.version, None)
            elif mv.state is not VersionState.READY and model.versions.get(mv.version) is mv:
                del model.versions[mv.version]
        return mv


async def last_scan(model: Model, extra: int | None = None) -> ModelEntry:
    """The scan ``model`` was last brought in line with (so a rollback or canary never picks
    up other repository changes), plus version folder ``extra`` read now.

    Raises:
        InvalidInputError: the model is not loaded.
    """
    entry = model.entry
    if entry is None or model.source_config is None:
        raise InvalidInputError(
            f"model '{model.name}' is not loaded ({model.error or model_status(model)})"
        )
    folders = dict(entry.folders)
    if extra is not None and extra not in folders and model.path is not None:
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


async def stop_all(models: Mapping[str, Model], drain_timeout_s: float) -> None:
    """Shutdown: drain every loaded version (up to ``drain_timeout_s`` seconds) and unload."""
    closing = []
    for model in list(models.values()):
        for mv in list(model.versions.values()):
            if mv.runner is not None:
                mv.state = VersionState.UNLOADING
                closing.append(stop_version(mv, drain_timeout_s))
    await asyncio.gather(*closing)


def adopt(model: Model, settings: Settings) -> None:
    """Set ``model``'s routing settings (holds, canary, history) to ``settings``."""
    model.held = dict(settings.held)
    model.canary = settings.canary
    model.history = list(settings.history)


def reroute(model: Model, *, forward: bool) -> None:
    """Plan the route over ``model``'s READY versions and install it (see
    :func:`~gpuserve.repository.lifecycle.planner.plan_route`)."""
    ready = {
        v: signature(mv.config)
        for v, mv in model.versions.items()
        if mv.state is VersionState.READY
    }
    plan = plan_route(
        ready,
        held=model.held,
        canary=model.canary,
        history=tuple(model.history),
        before=model.served_version(),
        forward=forward,
    )
    install_route(model, plan)


def install_route(model: Model, plan: RoutePlan) -> None:
    """Install ``plan`` as ``model``'s route in one assignment; ``model.config`` follows the
    default. Nothing changes when the route would lead to the same version objects."""
    if plan.warning is not None:
        model.warning = plan.warning
    versions = model.versions
    default = versions[plan.default] if plan.default is not None else None
    canary = versions[plan.canary] if plan.canary is not None else None
    old = model.route
    if old.default is default and old.canary is canary and old.weight == plan.weight:
        return
    model.route = Route(default, canary, plan.weight)
    model.config = default.config if default is not None else model.source_config
    model.history = list(plan.history)


def take_config(model: Model, entry: ModelEntry, *, reset: bool) -> bool:
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
