"""The batching runner: the asyncio driver of one version's scheduling core.

The runner of every version that is not an ensemble or generative (dynamic batching, or
sequence batching: the core's batcher is the one its config asks for). It implements the
:class:`~gpuserve.engine.runners.base.VersionRunner` contract (admission steps included).
A decoupled version's runner (:class:`~gpuserve.engine.runners.streaming.StreamingRunner`)
is this driver too, on the same core and instances; it answers each request through a stream
instead of a future (its hooks: ``_open``, ``_dispatched``, ``_complete``, ``_deliver``).

Every decision is :class:`~gpuserve.engine.scheduling.SchedulerCore`'s (admission, batch
formation, dispatch, retry halves, expiry, the watchdog, statistics); this module only does the
waiting, on the server's asyncio event loop:

* a future per request, resolved from the core's outcomes (no task per request);
* one loop timer at most, armed at ``core.next_wakeup`` (queue delay, regather window, request
  deadlines and watchdog deadlines alike), so an idle server uses no CPU (no polling);
* instances report on their own threads; results hop onto the loop with
  ``call_soon_threadsafe``, so the core, the futures and the statistics are only ever touched
  from the loop thread;
* a task per hung instance that loads its replacement, and ``close`` (drain, then stop).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

from gpuserve.backends.base import Capabilities
from gpuserve.config import ModelConfig
from gpuserve.engine.admission import AdmissionPool
from gpuserve.engine.assembly import ShapeKey, shape_key
from gpuserve.engine.batch import Batch, BatchResult, Pending
from gpuserve.engine.instance import Instance
from gpuserve.engine.request import InferenceRequest, InferenceResponse
from gpuserve.engine.runners.base import VersionRunner
from gpuserve.engine.scheduling import SchedulerCore
from gpuserve.errors import UnavailableError

logger = logging.getLogger(__name__)


def _unattached() -> asyncio.Future[InferenceResponse]:
    raise RuntimeError("BatchingRunner.attach was not called")


class BatchingRunner(VersionRunner):
    """Queue, batch and dispatch the requests of one model version.

    Args:
        config: The model's configuration.
        version: Version number as a string.
        capabilities: What its instances declared at load (the batcher is built for them:
            unpadded rows, row ids).
        admission_pool: Threads for the admission steps of large requests (None: inline).
        clock: Monotonic clock, seconds (injectable for tests).
        on_gpu: Whether an instance runs on a GPU (the default token budget).
        regather_beyond_delay: Let a closed loop's regather window pass the queue delay
            (see :mod:`gpuserve.engine.regather`).

    Attributes:
        core: The scheduling core this drives.
        stats: The version's statistics (``core.stats``).
        batcher: Its queue (``core.batcher``; ``len()`` is the queue depth).
        adaptive: Its adaptive batching policy, or None (``core.adaptive``).
    """

    kind = "batching"

    def __init__(
        self,
        config: ModelConfig,
        version: str,
        capabilities: Capabilities | None = None,
        admission_pool: AdmissionPool | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        on_gpu: bool = False,
        regather_beyond_delay: bool = False,
    ) -> None:
        capabilities = capabilities or Capabilities()
        super().__init__(config, version, capabilities, admission_pool, clock)
        self.core: SchedulerCore[Instance] = SchedulerCore(
            config, version, capabilities, on_gpu, regather_beyond_delay
        )
        self.stats = self.core.stats
        self.batcher = self.core.batcher
        self.adaptive = self.core.adaptive
        self._loop: asyncio.AbstractEventLoop | None = None
        # the loop's create_future once attached (the core refuses requests before that)
        self._new_future: Callable[[], asyncio.Future[InferenceResponse]] = _unattached
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._waiters: dict[Pending, asyncio.Future[InferenceResponse]] = {}
        self._respawn: Callable[[Instance], Awaitable[Instance]] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def attach(
        self,
        instances: list[Instance],
        loop: asyncio.AbstractEventLoop,
        respawn: Callable[[Instance], Awaitable[Instance]] | None = None,
    ) -> None:
        """Give the scheduler its (started) instances and the loop it runs on.

        Args:
            respawn: Builds and starts a replacement for an instance found hung (see
                ``execution_timeout_s``); None means a hung instance is only removed.
        """
        self._loop = loop
        self._new_future = loop.create_future
        self._respawn = respawn
        self.core.attach(instances)

    @property
    def instances(self) -> list[Instance]:
        """The instances that take batches (a hung one leaves, its replacement joins)."""
        return self.core.instances

    @instances.setter
    def instances(self, instances: list[Instance]) -> None:
        self.core.instances = instances

    @property
    def in_flight_requests(self) -> int:
        """Requests admitted and not yet answered: queued, retrying or running."""
        return self.core.in_flight_requests

    @property
    def queued(self) -> int:
        """Requests waiting in the batcher's queue."""
        return len(self.core.batcher)

    def lane_queued(self) -> tuple[int, int]:
        """Rows waiting in each lane: (interactive, bulk)."""
        return self.core.batcher.lane_queued()

    @property
    def healthy(self) -> bool:
        """Whether at least one instance can run batches (False while all are replaced)."""
        return bool(self.core.instances)

    @property
    def unhealthy_reason(self) -> str | None:
        """Why the version cannot take requests now, or None."""
        if self.core.instances:
            return None
        return "its instance is being restarted after it stopped responding"

    def start_trace(self, batches: int, directory: Path) -> None:
        """Profile the next ``batches`` batches of every instance into ``directory``."""
        for instance in self.core.instances:
            instance.start_trace(batches, directory)

    def on_batch_done(self, result: BatchResult) -> None:
        """Instance-thread callback: move the result onto the loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._complete, result)

    # -- admission -------------------------------------------------------------------------

    def shape_key(self, request: InferenceRequest) -> ShapeKey:
        """Non-batch shapes of the inputs (padded dimensions as -1): only requests with equal
        keys share a batch."""
        padding = self.core.padding
        return shape_key(request) if padding is None else padding.key(request)

    def _queue(self, request: InferenceRequest) -> asyncio.Future[InferenceResponse]:
        """Queue ``request`` and return the future of its response, without a task per
        request (the HTTP front end answers from the future's done callback).

        Cancelling the future is how every caller says it went away (an HTTP client that
        closed its connection, a cancelled gRPC call or stream, a BLS caller past its
        deadline, an ensemble run that ended, a cancelled awaiting task): the request leaves
        the queue at once and never runs, or, when its batch already runs, is counted
        cancelled when the batch returns (:meth:`SchedulerCore.cancel`).

        The future fails with OverloadedError (queue full), RequestTimeoutError (the queue
        timeout passed before it ran), BackendError (the model failed on it) or
        UnavailableError (the version shut down); admission errors raise at once.
        """
        now = self.clock()
        item = self.core.admit(request, now)  # refuses unless attached and not closing
        future = self._new_future()
        self._waiters[item] = future
        future.add_done_callback(lambda done: self._abandon(item, done))
        self._idle.clear()
        self._pump(now)  # may already finish it (client gone): the future is set then
        return future

    def _abandon(self, item: Pending, future: asyncio.Future[InferenceResponse]) -> None:
        """The future of ``item`` is done: when it was cancelled, its caller went away."""
        if future.cancelled() and self.core.cancel(item, self.clock()):
            self._deliver((item,))

    # -- the loop --------------------------------------------------------------------------

    def _pump(self, now: float) -> None:
        """Let the core act at ``now``: the watchdog, expiry, dispatch; then re-arm the timer."""
        core = self.core
        if core.execution_timeout_s is not None:
            self._check_hung(now)
        plan = core.schedule(now)
        for record in plan.dispatched:
            self._dispatched(record.batch, now)
            record.instance.submit(record.batch)
        if plan.finished:
            self._deliver(plan.finished)
        self._arm_timer(core.next_wakeup(now))

    def _dispatched(self, batch: Batch, now: float) -> None:
        """``batch`` goes to its instance at ``now`` (the streaming runner starts its
        streams' clocks here); nothing to do for requests answered by their batch."""

    def _check_hung(self, now: float) -> None:
        respawn = self._respawn
        for hung in self.core.hung(now, respawn is not None):
            self._deliver(hung.finished)
            if respawn is not None and self._loop is not None:
                task = self._loop.create_task(self._replace(hung.instance, respawn))
                self._tasks.add(task)  # held until done: the loop keeps only weak references
                task.add_done_callback(self._tasks.discard)

    async def _replace(
        self, dead: Instance, respawn: Callable[[Instance], Awaitable[Instance]]
    ) -> None:
        try:
            fresh = await respawn(dead)
        except Exception as err:
            logger.error("model %s: replacing instance %s failed: %s", self.name, dead.name, err)
            self._deliver(self.core.replacement_failed(str(err), self.clock()))
            return
        logger.info("model %s: instance %s replaced", self.name, dead.name)
        self.core.add_instance(fresh)
        self._pump(self.clock())

    def _arm_timer(self, wake: float | None) -> None:
        if wake is None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = self._timer_at = None
            return
        if self._timer is not None and self._timer_at is not None and self._timer_at <= wake:
            return
        if self._timer is not None:
            self._timer.cancel()
        assert self._loop is not None
        self._timer_at = wake
        self._timer = self._loop.call_later(max(0.0, wake - self.clock()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = self._timer_at = None
        self._pump(self.clock())

    # -- completion ------------------------------------------------------------------------

    def _complete(self, result: BatchResult) -> None:
        now = self.clock()
        done = self.core.complete(result, now)
        if done.finished:
            self._deliver(done.finished)
        self._pump(now)

    def _deliver(self, items: Iterable[Pending]) -> None:
        """Resolve the futures of finished ``items`` with their outcomes."""
        waiters = self._waiters
        for item in items:
            future = waiters.pop(item, None)
            if future is None or future.done():
                continue  # e.g. the caller was cancelled
            outcome = item.outcome
            if isinstance(outcome, InferenceResponse):
                future.set_result(outcome)
            elif outcome is not None:
                future.set_exception(outcome)
        if not self.core.in_flight_requests:
            self._idle.set()

    # -- shutdown --------------------------------------------------------------------------

    async def close(self, drain_timeout_s: float = 30.0) -> None:
        """Refuse new requests, let queued and running ones finish (up to the timeout), then
        fail what is left with 503 and stop the instances."""
        self.core.close()
        try:
            await asyncio.wait_for(self._idle.wait(), drain_timeout_s)
        except TimeoutError:
            error = UnavailableError(f"model '{self.name}' unloaded before it ran")
            self._deliver(self.core.drain(error, self.clock()))
        if self._timer is not None:
            self._timer.cancel()
            self._timer = self._timer_at = None
        loop = asyncio.get_running_loop()
        for instance in self.core.instances:
            await loop.run_in_executor(None, instance.stop)


#: The former name of the batching runner.
ModelScheduler = BatchingRunner
