"""The scheduler: one per loaded model version; the single loop that drives its batcher.

It runs on the server's asyncio event loop. ``infer`` admits a request into the
:class:`~gpuserve.engine.batcher.DynamicBatcher` and awaits its result; whenever something
changes (an arrival, a finished batch, a timer) ``_pump`` asks the batcher for due batches
while an instance is free and hands them to the least-busy instance. One timer at most is
armed, at the batcher's next wake-up time, so an idle server uses no CPU (no polling).

Instances report on their own threads; results hop onto the loop with
``call_soon_threadsafe``, so the batcher, the futures and the statistics are only ever touched
from the loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gpuserve.config import ModelConfig
from gpuserve.engine import tracing
from gpuserve.engine.adaptive import AdaptiveBatching
from gpuserve.engine.batcher import Batch, DynamicBatcher, Pending
from gpuserve.engine.instance import BatchResult, Instance
from gpuserve.engine.request import InferenceRequest, InferenceResponse, RequestTiming
from gpuserve.engine.stats import BatchStats, ModelStats, RequestStats
from gpuserve.errors import (
    BackendError,
    CancelledRequestError,
    GpuserveError,
    InvalidInputError,
    OverloadedError,
    RequestTimeoutError,
    UnavailableError,
)

logger = logging.getLogger(__name__)


class ModelScheduler:
    """Queue, batch and dispatch the requests of one model version.

    Args:
        config: The model's configuration.
        version: Version number as a string.
        clock: Monotonic clock, seconds (injectable for tests).
    """

    def __init__(
        self,
        config: ModelConfig,
        version: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.name = config.name or ""
        self.version = version
        self.clock = clock
        db = config.dynamic_batching
        self.batcher = DynamicBatcher(
            max_batch_size=config.max_batch_size,
            max_queue_delay_s=db.max_queue_delay_us / 1e6,
            preferred_batch_sizes=db.preferred_batch_sizes,
            max_queue_size=db.max_queue_size,
            priority_levels=db.priority_levels,
            early_dispatch=db.early_dispatch,
        )
        # adaptive batching: a policy sets the batcher's delay and row cap (engine/adaptive.py)
        self.adaptive = (
            AdaptiveBatching(
                db.adaptive.target_p99_ms / 1e3, config.max_batch_size, db.max_queue_delay_us / 1e6
            )
            if db.adaptive is not None
            else None
        )
        self.stats = ModelStats(self.name, version)
        self.instances: list[Instance] = []
        self.in_flight_requests = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._closing = False
        self._retry: deque[Batch] = deque()  # halves of failed batches, run before new work
        self._respawn: Callable[[Instance], Awaitable[Instance]] | None = None
        self._running: dict[Instance, set[int]] = {}  # instance -> ids of its batches in flight
        self._batches: dict[int, Batch] = {}
        self._replacing = 0
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
        self.instances = instances
        self._loop = loop
        self._respawn = respawn

    def start_trace(self, batches: int, directory: Path) -> None:
        """Profile the next ``batches`` batches of every instance into ``directory``."""
        for instance in self.instances:
            instance.start_trace(batches, directory)

    @property
    def healthy(self) -> bool:
        """Whether at least one instance can run batches (False while all are replaced)."""
        return bool(self.instances)

    def on_batch_done(self, result: BatchResult) -> None:
        """Instance-thread callback: move the result onto the loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._complete, result)

    # -- admission -------------------------------------------------------------------------

    def shape_key(self, request: InferenceRequest) -> tuple[Any, ...]:
        """Non-batch shapes of the inputs: only requests with equal keys share a batch."""
        return tuple((name, arr.shape[1:]) for name, arr in request.inputs.items())

    async def infer(self, request: InferenceRequest) -> InferenceResponse:
        """Queue ``request``, wait for its batch to run, and return its own rows. Cancelling
        the caller takes the request out of the queue if its batch has not formed yet.

        Raises:
            OverloadedError: the queue is full (nothing was queued).
            RequestTimeoutError: the queue timeout passed before the request ran.
            BackendError: the model failed on this request.
            UnavailableError: the version is shutting down.
        """
        item, future = self._admit(request)
        try:
            return await future
        except asyncio.CancelledError:
            if self.batcher.remove(item):
                self._finish_failed(item, CancelledRequestError("client cancelled"), item.arrival_s)
            raise

    def submit(self, request: InferenceRequest) -> asyncio.Future[InferenceResponse]:
        """Queue ``request`` and return the future of its response, without a task per
        request (the HTTP front end answers from the future's done callback). The future
        fails with the errors :meth:`infer` raises; admission errors raise at once."""
        return self._admit(request)[1]

    def _admit(
        self, request: InferenceRequest
    ) -> tuple[Pending, asyncio.Future[InferenceResponse]]:
        if self._closing or self._loop is None:
            raise self._refused(
                UnavailableError(f"model '{self.name}' version {self.version} is unloading")
            )
        db = self.config.dynamic_batching
        priority = request.priority or db.default_priority_level
        if priority > db.priority_levels:
            raise self._refused(
                InvalidInputError(
                    f"parameter 'priority': {priority} is not a level of model '{self.name}' "
                    f"(1..{db.priority_levels}, 1 = highest)"
                )
            )
        timeout_us = request.timeout_us if request.timeout_us else db.default_timeout_us
        now = self.clock()
        rows = next(iter(request.inputs.values())).shape[0] if self.config.max_batch_size else 1
        future: asyncio.Future[InferenceResponse] = self._loop.create_future()
        item = Pending(
            request=request,
            rows=rows,
            shape_key=self.shape_key(request),
            arrival_s=now,
            deadline_s=now + timeout_us / 1e6 if timeout_us else None,
            priority=priority,
            token=future,
        )
        try:
            self.batcher.add(item)
        except OverloadedError as err:
            self.stats.record_request(
                RequestStats(self.name, self.version, rows, 0.0, 0.0, 0.0, err.reason)
            )
            raise
        self.in_flight_requests += 1
        tracing.queue_enter(item, self.name)
        self._idle.clear()
        self._pump()
        return item, future

    # -- the loop --------------------------------------------------------------------------

    def _free_instance(self) -> Instance | None:
        """The least-busy instance with room for another batch, or None."""
        best: Instance | None = None
        for instance in self.instances:
            if instance.in_flight < instance.capacity and (
                best is None or instance.in_flight < best.in_flight
            ):
                best = instance
        return best

    def _dispatch(self, instance: Instance, batch: Batch) -> None:
        instance.in_flight += 1
        batch.extra["instance"] = instance
        timeout_s = self.config.execution_timeout_s
        if timeout_s:
            assert self._loop is not None
            self._running.setdefault(instance, set()).add(id(batch))
            self._batches[id(batch)] = batch
            batch.extra["watchdog"] = self._loop.call_later(
                timeout_s, self._instance_hung, instance, batch
            )
        instance.submit(batch)

    def _instance_hung(self, instance: Instance, batch: Batch) -> None:
        """Watchdog: ``instance`` did not finish ``batch`` within ``execution_timeout_s``.

        Its batches in flight fail with a 500 that says so; the instance is dropped (its thread
        cannot be stopped, so it is abandoned) and, when a ``respawn`` callback was given, a
        replacement is loaded. Meanwhile the model reports not ready if no instance is left.
        """
        if instance not in self.instances:
            return
        timeout_s = self.config.execution_timeout_s
        logger.error(
            "model %s version %s: instance %s did not finish a batch of %d rows within %.1f s; "
            "replacing it",
            self.name,
            self.version,
            instance.name,
            batch.rows,
            timeout_s,
        )
        self.instances.remove(instance)
        error = BackendError(
            f"model '{self.name}' instance {instance.name} did not finish within "
            f"{timeout_s:g} s (execution_timeout_s); it is being restarted"
        )
        end = self.clock()
        for batch_id in self._running.pop(instance, set()):
            stuck = self._batches.pop(batch_id)
            for item in stuck.items:
                self._resolve(item, error, 0.0, end - item.arrival_s, end - item.arrival_s)
        if self._respawn is not None and self._loop is not None:
            self._replacing += 1
            self._loop.create_task(self._replace(instance))
        elif not self.instances:
            self._fail_queued(UnavailableError(f"model '{self.name}' has no working instance"))
        self._pump()

    async def _replace(self, dead: Instance) -> None:
        assert self._respawn is not None
        try:
            fresh = await self._respawn(dead)
        except Exception as err:
            logger.error("model %s: replacing instance %s failed: %s", self.name, dead.name, err)
            if not self.instances:
                self._fail_queued(
                    UnavailableError(f"model '{self.name}' has no working instance: {err}")
                )
            return
        finally:
            self._replacing -= 1
        logger.info("model %s: instance %s replaced", self.name, dead.name)
        self.instances.append(fresh)
        self._pump()

    def _fail_queued(self, error: GpuserveError) -> None:
        now = self.clock()
        for item in self.batcher.drain():
            self._finish_failed(item, error, now)

    def _pump(self) -> None:
        now = self.clock()
        for item in self.batcher.expire(now):
            waited_ms = (now - item.arrival_s) * 1000
            self._finish_failed(
                item,
                RequestTimeoutError(
                    f"request timed out in the queue of model '{self.name}' after "
                    f"{waited_ms:.0f} ms without running"
                ),
                now,
            )
        while self._retry:
            instance = self._free_instance()
            if instance is None:
                break
            self._dispatch(instance, self._retry.popleft())
        while len(self.batcher):
            instance = self._free_instance()
            if instance is None:
                break
            if self.adaptive is not None:
                self.adaptive.apply(self.batcher)
            batch = self.batcher.next_batch(now)
            if batch is None:
                break
            self._dispatch(instance, batch)
        for item in self.batcher.take_cancelled():
            self._finish_failed(item, CancelledRequestError("client went away"), now)
        self._arm_timer()

    def _arm_timer(self) -> None:
        wake = self.batcher.next_wakeup(self._free_instance() is not None)
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
        delay = max(0.0, wake - self.clock())
        self._timer_at = wake
        self._timer = self._loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = self._timer_at = None
        self._pump()

    # -- completion ------------------------------------------------------------------------

    def _complete(self, result: BatchResult) -> None:
        batch: Batch = result.batch
        instance: Instance = batch.extra["instance"]
        instance.in_flight -= 1
        watchdog = batch.extra.pop("watchdog", None)
        if watchdog is not None:
            watchdog.cancel()
            self._running.get(instance, set()).discard(id(batch))
            if self._batches.pop(id(batch), None) is None:
                return  # declared hung and already failed; a late result is dropped
        self.stats.record_batch(
            BatchStats(
                self.name,
                self.version,
                batch.rows,
                len(batch.items),
                result.preprocess_s,
                result.forward_s,
                result.postprocess_s,
                result.error is None,
            )
        )
        if self.adaptive is not None and result.error is None:
            self.adaptive.observe(batch, result.finished_s - result.started_s)
        self.batcher.instance_freed(self.clock(), result.finished_s - result.started_s, batch.rows)
        if result.error is not None:
            self._batch_failed(batch, result.error, result.retryable, result.started_s)
        else:
            compute_s = result.finished_s - result.started_s
            end = self.clock()
            for item, outcome in zip(batch.items, result.results, strict=True):
                queue_s = result.started_s - item.arrival_s
                self._resolve(item, outcome, queue_s, compute_s, end - item.arrival_s)
        self._pump()

    def _batch_failed(
        self, batch: Batch, error: GpuserveError, retryable: bool, started_s: float
    ) -> None:
        """Split a failed batch of several requests in halves and run them again (ahead of new
        work), so that only the request that causes the failure fails, and a batch that ran out
        of device memory still gets results; otherwise fail every member with ``error``."""
        items = batch.items
        if retryable and len(items) > 1:
            logger.warning(
                "model %s version %s: batch of %d requests (%d rows) failed (%s); "
                "retrying it in halves",
                self.name,
                self.version,
                len(items),
                batch.rows,
                error.message,
            )
            middle = len(items) // 2
            for part in (items[:middle], items[middle:]):
                self._retry.append(Batch(part, sum(i.rows for i in part), self.clock()))
            return
        end = self.clock()
        for item in items:
            self._resolve(item, error, started_s - item.arrival_s, 0.0, end - item.arrival_s)

    def _resolve(
        self,
        item: Pending,
        outcome: dict[str, Any] | GpuserveError,
        queue_s: float,
        compute_s: float,
        total_s: float,
    ) -> None:
        future: asyncio.Future[InferenceResponse] = item.token
        if isinstance(outcome, GpuserveError):
            self._record(item, queue_s, compute_s, total_s, outcome.reason)
            if not future.done():
                future.set_exception(outcome)
            return
        self._record(item, queue_s, compute_s, total_s, None)
        if not future.done():
            future.set_result(
                InferenceResponse(
                    self.name,
                    self.version,
                    item.request.id,
                    outcome,
                    RequestTiming(queue_s, compute_s, total_s),
                )
            )

    def _refused(self, error: GpuserveError) -> GpuserveError:
        """Record a request refused before it was queued (so a failure is never uncounted)."""
        self.stats.record_request(
            RequestStats(self.name, self.version, 0, 0.0, 0.0, 0.0, error.reason)
        )
        return error

    def _finish_failed(self, item: Pending, error: GpuserveError, now: float) -> None:
        tracing.queue_exit((item,))
        total = self.clock() - item.arrival_s
        self._record(item, total, 0.0, total, error.reason)
        future: asyncio.Future[InferenceResponse] = item.token
        if not future.done():
            future.set_exception(error)

    def _record(
        self, item: Pending, queue_s: float, compute_s: float, total_s: float, reason: str | None
    ) -> None:
        self.in_flight_requests -= 1
        if self.in_flight_requests == 0:
            self._idle.set()
        self.stats.record_request(
            RequestStats(self.name, self.version, item.rows, queue_s, compute_s, total_s, reason)
        )

    # -- shutdown --------------------------------------------------------------------------

    async def close(self, drain_timeout_s: float = 30.0) -> None:
        """Refuse new requests, let queued and running ones finish (up to the timeout), then
        fail what is left with 503 and stop the instances."""
        self._closing = True
        try:
            await asyncio.wait_for(self._idle.wait(), drain_timeout_s)
        except TimeoutError:
            now = self.clock()
            for item in self.batcher.drain():
                self._finish_failed(
                    item, UnavailableError(f"model '{self.name}' unloaded before it ran"), now
                )
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        for instance in self.instances:
            await loop.run_in_executor(None, instance.stop)
