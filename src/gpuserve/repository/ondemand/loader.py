"""Loading models at their first request, within limits, and unloading idle ones.

:class:`OnDemand` carries out :mod:`gpuserve.repository.ondemand.residency`'s decisions for the model
manager:

* :meth:`OnDemand.cold` (request path, a dict lookup): whether a request for a model must
  wait for a load first (``load_on_demand``, or a model that was evicted or unloaded idle);
* :meth:`OnDemand.ensure_loaded`: one load per model however many requests wait for it (they
  share it, each up to its own deadline), as the pure core decides
  (:func:`~gpuserve.repository.ondemand.demand.decide`): refused at once while the back-off of a
  failed load lasts (the shared record of :mod:`gpuserve.repository.lifecycle.retry`) or when only
  pinned models leave no room; otherwise the least recently used models with nothing queued
  or running are unloaded (drained, as any unload) until the limits leave room, a model
  larger than the memory limit being served alone; if busy models stand in the way it waits
  for room until the last waiter's deadline, then fails with the reason. A failed load
  answers its waiters with the error and when the next attempt is due;
* the idle loop unloads models with no request for their ``idle_unload_s``;
* :meth:`OnDemand.reserve`: an explicit load (repository API) makes room first, then holds its
  place until it ends, so loads on demand beside it cannot pass the limits.

Loads race unloads (explicit, eviction, idle, a model removed): a load that ends holds the
model's lock until the requests that waited for it are admitted (an unload waiting for the
lock then drains them: they are served), and a request that finds the model unloaded again
after its load waits for the next load, up to its deadline. A request for a model that loads
on demand never meets a 503 just because an unload came first.

Loads and evictions on demand run one at a time (one residency lock, taken before any
model's lock), so the limits hold with loads in flight and each load's memory is measured
alone. Events (:class:`ResidencyEvent`) go to listeners (the metrics layer).
"""

from __future__ import annotations

import asyncio
import logging
import time
from asyncio import FIRST_COMPLETED
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from gpuserve.errors import ModelNotReadyError
from gpuserve.repository.ondemand import demand, estimate, failures, footprint, residency
from gpuserve.repository.lifecycle.devices import cuda_device_count
from gpuserve.repository.lifecycle.executor import Change, take_config
from gpuserve.repository.ondemand.held_arrays import held_bytes
from gpuserve.repository.ondemand.residency import HOST, IDLE, LRU, MEMORY, Limits, Resident
from gpuserve.repository.lifecycle.retry import Failure
from gpuserve.repository.scan import ModelEntry, read_model
from gpuserve.repository.state import Model, VersionState

if TYPE_CHECKING:
    from gpuserve.repository.manager import ModelManager

logger = logging.getLogger(__name__)

#: How often a load waiting for room looks again, seconds (cold path only).
_ROOM_POLL_S = 0.02
#: Longest sleep of the idle loop, seconds (models loaded meanwhile are seen then).
_IDLE_POLL_MAX_S = 1.0
#: Most event loop turns a finished load holds its model's lock for its waiters to be
#: admitted (each needs two or three).
_HANDOVER_TURNS = 100


@dataclass(frozen=True, slots=True)
class _Load:
    """One load on demand in progress, shared by the requests that wait for it.

    Attributes:
        task: The load (raises the error its waiters answer with).
        served: Resolved under the model's lock once the model serves (the waiters are
            admitted before an unload can take it out of the route again).
    """

    task: asyncio.Task[None]
    served: asyncio.Future[None]


@dataclass(frozen=True, slots=True)
class ResidencyEvent:
    """A model loaded on demand, was evicted / unloaded idle, or a load was refused.

    Attributes:
        kind: ``load`` (an attempt), ``evict`` or ``refuse`` (no attempt: the back-off of
            its last failure lasts, or no room can ever be made).
        model: The model name.
        reason: For ``evict``: ``lru``, ``memory`` or ``idle``; for ``refuse``:
            ``backoff`` or ``no_room``; "" for ``load``.
        seconds: For ``load``: how long the load and warm-up took.
        ok: For ``load``: whether a version became READY.
    """

    kind: str
    model: str
    reason: str = ""
    seconds: float = 0.0
    ok: bool = True


class OnDemand:
    """Load on demand, limits and idle unload over a model manager.

    Args:
        manager: The manager (its models, locks and executor).
        enabled: ``load_on_demand``: models load at their first request.
        limits: Count and memory limits.
        idle_unload_s: Server default idle time before unload, seconds (0: never).
        timeout_s: How long a request waits for a load when its model sets no
            ``default_timeout_us``, seconds.
        clock: Wall-clock seconds (the engine's ``last_inference`` is wall-clock).

    Attributes:
        listeners: Called with each :class:`ResidencyEvent` (on the event loop).
    """

    def __init__(
        self,
        manager: ModelManager,
        *,
        enabled: bool = False,
        limits: Limits | None = None,
        idle_unload_s: float = 0.0,
        timeout_s: float = 120.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.manager = manager
        self.enabled = enabled
        self.limits = limits or Limits()
        self.idle_unload_s = idle_unload_s
        self.timeout_s = timeout_s
        self.clock = clock
        self.listeners: list[Callable[[ResidencyEvent], None]] = []
        self._lock = asyncio.Lock()
        self._waiting: Counter[str] = Counter()
        self._loads: dict[str, _Load] = {}
        self._deadlines: dict[str, float] = {}
        self._measured: dict[str, dict[str, int]] = {}
        self._blocked: dict[str, str] = {}  # why a waiting load has no room yet
        # explicit loads in progress, and what each is expected to hold (see reserve)
        self._reserved: Counter[str] = Counter()
        self._reserved_need: dict[str, dict[str, int]] = {}
        self._idle_task: asyncio.Task[None] | None = None
        self._gpus: int | None = None  # visible GPUs, counted at the first estimate

    # -- the request path --------------------------------------------------------------------

    def cold(self, name: str) -> bool:
        """Whether a request for ``name`` must wait for :meth:`ensure_loaded` first (False
        for an unknown model: admission answers 404)."""
        model = self.manager.models.get(name)
        if model is None or model.route.default is not None:
            return False
        return (self.enabled or model.evicted is not None) and model.source_config is not None

    def dormant(self, model: Model) -> bool:
        """Whether ``model`` is left unloaded until a request (a poll does not load it)."""
        return (
            (self.enabled or model.evicted is not None)
            and not model.versions
            and model.route.default is None
        )

    def wait_s(self, model: Model) -> float:
        """How long a request for ``model`` waits for its load, seconds."""
        config = model.source_config
        if config is not None and config.dynamic_batching.default_timeout_us > 0:
            return config.dynamic_batching.default_timeout_us / 1e6
        return self.timeout_s

    async def ensure_loaded(self, name: str) -> None:
        """Load ``name`` if it serves nothing, making room first; requests arriving meanwhile
        share the load. Returns when it is loaded (or its load failed: admission then answers
        with the reason); the caller must admit without awaiting in between, so the model
        cannot be evicted before its request is queued.

        Raises:
            ModelNotFoundError: no such model.
            ModelNotReadyError: no room could be made, or the load did not finish, within
                the wait (503 with the reason).
        """
        model = self.manager.model(name)
        loop = asyncio.get_running_loop()
        wait_s = self.wait_s(model)
        deadline = loop.time() + wait_s
        self._deadlines[name] = max(self._deadlines.get(name, 0.0), deadline)
        self._waiting[name] += 1
        try:
            while True:
                load = self._loads.get(name)
                if load is None or load.task.done():
                    load = self._loads[name] = _Load(
                        loop.create_task(self._load(name)), loop.create_future()
                    )
                    load.task.add_done_callback(_retrieve)
                # the load's end, or (first) the moment it serves: the load then holds the
                # model's lock until its waiters have been admitted, so an unload that waits
                # for the lock drains them instead of refusing them
                waits: set[asyncio.Future[None]] = {load.task}
                if not load.served.done():
                    waits.add(load.served)
                done, _ = await asyncio.wait(
                    waits, timeout=max(0.0, deadline - loop.time()), return_when=FIRST_COMPLETED
                )
                if not done:
                    why = self._blocked.get(name) or self.manager.model_status(model)
                    raise ModelNotReadyError(
                        f"model '{name}' is not ready: it did not load within {wait_s:g} s ({why})"
                    )
                if load.task in done:
                    load.task.result()  # a failed load answers with its error
                if not self._unloaded_again(name, model):
                    return
                # an unload (explicit, eviction, idle) took it out of the route before this
                # request's turn: it waits for the next load instead of meeting the
                # unloading version
                logger.debug("model %s was unloaded before its waiters ran: loading again", name)
        finally:
            self._waiting[name] -= 1
            if not self._waiting[name]:
                del self._waiting[name]

    def _unloaded_again(self, name: str, model: Model) -> bool:
        """After a load of ``name`` ended without an error: whether the model serves nothing
        again although a request may still load it (it is the same model, the server is not
        shutting down), so the request must wait for another load."""
        return (
            self.manager.models.get(name) is model
            and model.path is not None
            and not self.manager.shutting_down
            and self.cold(name)
        )

    # -- loading and evicting ----------------------------------------------------------------

    def _decide(self, name: str, entry: ModelEntry, now_s: float) -> demand.Verdict:
        """What the pure core says of loading ``name`` (read as ``entry``) now."""
        return demand.decide(
            name,
            self.residents(),
            self.expected_memory(name, entry),
            self.limits,
            self.holding(entry),
            now_s,
        )

    async def _load(self, name: str) -> None:
        loop = asyncio.get_running_loop()
        retry = self.manager._executor.retry
        while True:
            model = self.manager.models.get(name)
            if model is None or model.path is None:
                return
            # a model held back by its back-off, or left no room by pinned models, is
            # answered at once, not after the load of another model that holds the lock (the
            # folder as read now is the one the load uses)
            entry = await loop.run_in_executor(None, read_model, model.path, None)

            early = self._decide(name, entry, retry.clock())
            if early.action == "refuse":
                self._refuse(name, early)
            async with self._lock:
                model = self.manager.models.get(name)
                if (
                    model is None
                    or model.route.default is not None
                    or model.path is None
                    or self.manager.shutting_down
                ):
                    return
                verdict = self._decide(name, entry, retry.clock())
                if verdict.action == "refuse":
                    self._refuse(name, verdict)
                if verdict.action == "load":
                    self._blocked.pop(name, None)
                    self._deadlines.pop(name, None)
                    if verdict.room.alone:
                        logger.warning("%s", verdict.room.alone)
                    for victim in verdict.room.evict:
                        await self.evict(victim, verdict.room.reason, incoming=name)
                    # not held back although a failure is recorded for this content: its
                    # configuration changed (or the back-off passed: the plan releases it)
                    retry_failed = failures.held_by_folders(retry, entry)
                    await self._load_now(model, entry, retry_failed=retry_failed)
                    await self._fit_after(name, warned=bool(verdict.room.alone))
                    if model.route.default is None:
                        raise failures.failed_error(retry, model, entry)
                    return
            self._blocked[name] = verdict.why
            if loop.time() >= self._deadlines.get(name, 0.0):
                self._deadlines.pop(name, None)
                self._blocked.pop(name, None)
                logger.warning("%s", verdict.why)
                raise ModelNotReadyError(verdict.why)
            await asyncio.sleep(_ROOM_POLL_S)

    def _refuse(self, name: str, verdict: demand.Verdict) -> NoReturn:
        """Answer a refused load on demand: count it, 503 with the reason (and, for a
        back-off, when to try again)."""
        self._deadlines.pop(name, None)
        self._blocked.pop(name, None)
        logger.info("model %s: load on demand refused: %s", name, verdict.why)
        self._emit(ResidencyEvent("refuse", name, reason=verdict.refusal))
        retry_after = verdict.retry_in_s if verdict.refusal == demand.BACKOFF else None
        raise ModelNotReadyError(verdict.why, retry_after)

    def holding(self, entry: ModelEntry) -> Failure | None:
        """The failure whose back-off holds back a load of ``entry``'s model now, or None
        (see :func:`gpuserve.repository.ondemand.failures.holding`)."""
        return failures.holding(self.manager._executor.retry, entry)

    def expected_memory(self, name: str, entry: ModelEntry | None) -> dict[str, int]:
        """What ``name`` is expected to hold once loaded, by device, bytes: its own last
        measurement, else its configured ``expected_memory_bytes`` or its files' estimate
        (:mod:`gpuserve.repository.ondemand.estimate`), never another model's."""
        if self._gpus is None:
            self._gpus = cuda_device_count()
        guess = estimate.expected(entry, self._gpus) if entry is not None else {}
        return residency.expected_memory(name, self._measured, guess)

    def ready_reason(self, name: str) -> str | None:
        """For a model that is not loaded and that a request would load: None when such a
        request would load it now (its readiness answers ready), else why not (see
        :func:`gpuserve.repository.ondemand.failures.ready_reason`)."""
        model = self.manager.models.get(name)
        if model is None:
            return None
        return failures.ready_reason(self.manager._executor.retry, model)

    async def _load_now(self, model: Model, entry: ModelEntry, *, retry_failed: bool) -> None:
        manager = self.manager
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with manager._lock(model.name):
            if model.route.default is not None:  # loaded meanwhile (an explicit load)
                await self._hand_over(model.name)
                return
            if model.path is None:
                return
            if not take_config(model, entry, reset=False):
                logger.error("model %s cannot be loaded: %s", model.name, model.error)
                return
            await loop.run_in_executor(None, footprint.collect_garbage)
            with footprint.measuring():
                before = footprint.sample()
                # without retry_failed, a failed version loads again when its back-off has
                # passed or its folder changed (the record polls and explicit loads share:
                # gpuserve.repository.lifecycle.retry); with it (a changed configuration), every
                # version tries again
                change = Change(retry_failed=retry_failed)
                await manager._executor.reconcile(model, entry, change)
                after = footprint.sample()
            instances = [
                instance
                for mv in model.versions.values()
                if mv.runner is not None
                for instance in mv.runner.instances
            ]
            devices = [instance.context.device for instance in instances]
            ok = model.route.default is not None
            if ok:
                # the largest of its loads and at least the arrays it holds: a sampled
                # difference undercounts by whatever the rest of the process freed meanwhile,
                # never overcounts by much, and a limit must not let one model too many in
                backends = [instance.backend for instance in instances]
                held = await loop.run_in_executor(None, held_bytes, backends)
                measured = {
                    k: max(v, held.get(k, 0))
                    for k, v in footprint.footprint(before, after, devices).items()
                }
                earlier = self._measured.get(model.name, {})
                model.memory_bytes = {k: max(v, earlier.get(k, 0)) for k, v in measured.items()}
                self._measured[model.name] = dict(model.memory_bytes)
                model.loaded_at_s = self.clock()
                model.evicted = None
                await self._hand_over(model.name)
        seconds = loop.time() - started
        logger.info(
            "model %s loaded on demand in %.2f s%s (memory %s; host RSS %d -> %d B)",
            model.name,
            seconds,
            "" if ok else " (failed)",
            model.memory_bytes or "not measured",
            before.get(HOST, 0),
            after.get(HOST, 0),
        )
        self._emit(ResidencyEvent("load", model.name, seconds=seconds, ok=ok))

    async def _hand_over(self, name: str) -> None:
        """With ``name`` serving and its lock held: resolve its load's ``served`` future and
        give the requests waiting for the load a few event loop turns to be admitted, so an
        unload waiting for the lock drains them instead of refusing them."""
        load = self._loads.get(name)
        if load is not None and not load.served.done():
            load.served.set_result(None)
        for _ in range(_HANDOVER_TURNS):
            if not self._waiting.get(name):
                return
            await asyncio.sleep(0)

    @asynccontextmanager
    async def reserve(
        self, name: str, path: Path | None = None, config_override: dict[str, Any] | None = None
    ) -> AsyncIterator[None]:
        """Around an explicit load of ``name`` (repository API): first unload least recently
        used models until it fits the limits, then hold its place until the load ends. While
        held it counts as loaded (busy, with its expected memory) for every other load, and
        is never evicted, so loads on demand beside it cannot pass the limits. Nothing when
        no limit is set; no room is made when ``name`` is loaded already (a reload replaces
        its own versions). ``path`` (the folder it loads from) and ``config_override`` give
        its estimate before its first load.

        Raises:
            ModelNotReadyError: nothing can be evicted (all pinned or busy): 503 naming why.
        """
        if not self.limits.limited:
            yield
            return
        async with self._lock:
            model = self.manager.models.get(name)
            if model is None or (model.route.default is None and not model.versions):
                entry = None
                if path is not None and path.is_dir():
                    loop = asyncio.get_running_loop()
                    entry = await loop.run_in_executor(None, read_model, path, config_override)
                need = self.expected_memory(name, entry)
                room = residency.make_room(self.residents(), name, need, self.limits)
                if room.blocked is not None:
                    self._emit(ResidencyEvent("refuse", name, reason=demand.NO_ROOM))
                    raise ModelNotReadyError(f"failed to load '{name}': {room.blocked}")
                if room.alone:
                    logger.warning("%s", room.alone)
                for victim in room.evict:
                    await self.evict(victim, room.reason, incoming=name)
                self._reserved_need[name] = need
            self._reserved[name] += 1
        try:
            yield
        finally:
            self._reserved[name] -= 1
            if not self._reserved[name]:
                del self._reserved[name]
                self._reserved_need.pop(name, None)

    async def _fit_after(self, name: str, *, warned: bool = False) -> None:
        """After a load measured more than expected: unload least recently used models until
        the memory limit holds again (nothing when they are all pinned or busy). ``warned``:
        the served-alone warning was logged before the load already."""
        if self.limits.memory_bytes <= 0:
            return
        room = residency.over_budget(self.residents(), name, self.limits)
        if room.alone and not warned:
            logger.warning("%s", room.alone)
        if room.blocked is not None:
            logger.warning("%s", room.blocked)
        for victim in room.evict:
            await self.evict(victim, MEMORY, incoming=name)

    async def evict(self, name: str, reason: str, incoming: str | None = None) -> None:
        """Unload every version of ``name`` (drained: what it has queued or running
        finishes); the index notes why. Its next request loads it again."""
        model = self.manager.models.get(name)
        if model is None:
            return
        if reason == IDLE:
            why = f"evicted: idle for {self.idle_s(model):g} s"
        elif reason == LRU:
            why = (
                f"evicted: least recently used, to make room for '{incoming}' "
                f"(limit of {self.limits.max_models} loaded models)"
            )
        else:
            why = (
                f"evicted: least recently used, to make room for '{incoming}' "
                f"(limit of {self.limits.memory_bytes} bytes of loaded models per device)"
            )
        async with self.manager._lock(name):
            if model.route.default is None and not model.versions:
                return
            logger.info("model %s %s", name, why)
            model.required = False
            # loaded on demand: never frozen, so no full walk of the heap (~0.1 s) is needed
            await self.manager._executor.unload_all(model, why, frozen=not model.loaded_at_s)
            model.memory_bytes = {}
            model.evicted = reason
        self._emit(ResidencyEvent("evict", name, reason=reason))

    # -- idle unload -------------------------------------------------------------------------

    def idle_s(self, model: Model) -> float:
        """``model``'s idle time before unload, seconds (0: never)."""
        config = model.source_config
        if config is not None and config.idle_unload_s is not None:
            return config.idle_unload_s
        return self.idle_unload_s

    def start(self) -> None:
        """Start the idle loop (once), when any model may unload when idle."""
        wants_idle = self.idle_unload_s > 0 or any(
            m.source_config is not None and m.source_config.idle_unload_s
            for m in self.manager.models.values()
        )
        if wants_idle and self._idle_task is None:
            self._idle_task = asyncio.get_running_loop().create_task(self._idle_loop())

    async def stop(self) -> None:
        """Stop the idle loop and the loads in progress."""
        loads = [load.task for load in self._loads.values()]
        tasks = [t for t in (self._idle_task, *loads) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._idle_task = None

    async def _idle_loop(self) -> None:
        while not self.manager.shutting_down:
            wait = residency.next_idle_check(self.residents(), self.clock())
            await asyncio.sleep(min(_IDLE_POLL_MAX_S, max(0.05, wait or _IDLE_POLL_MAX_S)))
            try:
                await self.unload_idle()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("unloading idle models failed")

    async def unload_idle(self) -> tuple[str, ...]:
        """Unload the models idle for their ``idle_unload_s`` now; returns their names."""
        async with self._lock:
            due = residency.idle_due(self.residents(), self.clock())
            for name in due:
                await self.evict(name, IDLE)
        return due

    # -- what the policy reads ---------------------------------------------------------------

    def residents(self) -> list[Resident]:
        """Every model with a loaded or loading version, as the policy sees it."""
        rows = []
        for model in list(self.manager.models.values()):
            if not model.versions and model.name not in self._reserved:
                continue
            rows.append(
                Resident(
                    name=model.name,
                    last_used_s=self.last_used_s(model),
                    busy=self._busy(model),
                    pinned=model.pinned
                    or (model.source_config is not None and model.source_config.pinned),
                    memory_bytes=dict(
                        model.memory_bytes
                        if model.versions
                        else self._reserved_need.get(model.name, {})
                    ),
                    idle_unload_s=self.idle_s(model),
                )
            )
        # an explicit load of a model the manager has not registered yet holds its place too
        for name in self._reserved.keys() - self.manager.models.keys():
            need = self._reserved_need.get(name, {})
            rows.append(Resident(name, self.clock(), busy=True, memory_bytes=dict(need)))
        return rows

    def last_used_s(self, model: Model) -> float:
        """``model``'s last successful request or its load, whichever is later (wall-clock
        seconds; read from its statistics, so the request path pays nothing for it)."""
        last_ms = max(
            (
                mv.runner.stats.last_inference_ms
                for mv in list(model.versions.values())
                if mv.runner is not None
            ),
            default=0,
        )
        return max(model.loaded_at_s, last_ms / 1000.0)

    def _busy(self, model: Model) -> bool:
        if (
            self._waiting.get(model.name)
            or self._reserved.get(model.name)
            or self.manager._lock(model.name).locked()
        ):
            return True
        for mv in list(model.versions.values()):
            if mv.state is not VersionState.READY:
                return True
            if mv.runner is not None and mv.runner.in_flight_requests:
                return True
        return False

    def _emit(self, event: ResidencyEvent) -> None:
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:
                logger.exception("a residency listener failed")


def _retrieve(task: asyncio.Task[None]) -> None:
    """Mark a load's failure as seen (its waiters may all have timed out already)."""
    if not task.cancelled():
        task.exception()
