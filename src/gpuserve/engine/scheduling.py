"""The scheduling core of one model version: a synchronous state machine on an injected clock.

It decides everything the scheduler does and does none of the waiting: no asyncio, no threads,
no clock of its own (every method takes ``now``, seconds on the caller's monotonic clock). A
driver (:class:`~gpuserve.engine.runners.batching.BatchingRunner` on an asyncio loop, or a
test with a fake clock) calls it::

    item = core.admit(request, now)       # queue it, or raise (full / bad priority / closing)
    plan = core.schedule(now)             # due batches -> instances, and requests that left
    for record in plan.dispatched:        #   the queue without running (timed out, client gone)
        record.instance.submit(record.batch)
    done = core.complete(result, now)     # an instance's BatchResult -> answered requests
    for hung in core.hung(now, respawn):  # instances past execution_timeout_s: dropped
        ...
    wake = core.next_wakeup(now)          # when to call schedule/hung again if nothing happens

A finished request has ``item.outcome`` set (its :class:`InferenceResponse` or error) and is
returned exactly once, by whichever call finished it; the driver hands the outcome to whoever
waits (a future). Every request gets exactly one outcome. Statistics are recorded here, into
``stats``, as each request and batch finishes.

Rules the core keeps:

* **Dispatch**: retry halves first, then the batcher's due batches, each to the least-busy
  instance with room (``in_flight < capacity``).
* **Retry in halves**: a failed batch of several requests with a retryable error (anything but
  :class:`~gpuserve.engine.assembly.OutputMismatch`) is split in halves that run again ahead of
  new work, so only the request that causes the failure fails, and a batch that ran out of
  device memory still gets results.
* **Cancel**: a request whose caller went away (``cancel``) leaves the queue, or the retry
  half it waits in, at once and is finished ``cancelled``; one whose batch runs is marked, then
  counted cancelled (never a success) and not retried. A request's ``is_cancelled`` probe is
  read as batches form too, for callers that cannot say so themselves.
* **Streams**: a decoupled model's requests (``streams``) are admitted, queued, batched,
  dispatched, timed out, cancelled and watched like any other, each with the sink its
  responses go to (``Pending.sink``); its instance calls the backend's ``stream`` /
  ``stream_batch`` with the sinks. A stream batch's result frees its instance and counts the
  execution (the call's time, which adaptive batching observes); its requests finish when
  their streams end (:meth:`SchedulerCore.stream_ended`), never by the result, and are never
  retried (their responses may have gone out).
* **Watchdog**: each in-flight batch has a deadline ``execution_timeout_s`` after dispatch; an
  instance past one is declared hung: its batches fail with a 500 naming the timeout, it is
  dropped from ``instances`` (its thread cannot be stopped), and a late result from it is
  ignored. Deadlines follow dispatch order, so the oldest in-flight record holds the earliest.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Hashable, Sequence
from typing import Any, Generic

from gpuserve.backends.base import Capabilities
from gpuserve.backends.streaming import ResponseSink
from gpuserve.config import ModelConfig
from gpuserve.engine import tracing
from gpuserve.engine.adaptive import AdaptiveBatching
from gpuserve.engine.assembly import request_rows, shape_key
from gpuserve.engine.batch import Batch, Batcher, BatchResult, Pending
from gpuserve.engine.batcher import DynamicBatcher
from gpuserve.engine.checks import priority_level
from gpuserve.engine.inflight import InFlight, InFlightTable, W, Worker
from gpuserve.engine.lengths import default_batch_tokens
from gpuserve.engine.outcomes import Completion, Hung, Outcomes, Schedule
from gpuserve.engine.padding import PaddingSpec
from gpuserve.engine.request import InferenceRequest
from gpuserve.engine.reshape import ReshapeSpec
from gpuserve.engine.sequence.batcher import SequenceBatch, SequenceBatcher
from gpuserve.engine.stats import ModelStats
from gpuserve.errors import (
    BackendError,
    CancelledRequestError,
    GpuserveError,
    InvalidInputError,
    OverloadedError,
    RequestTimeoutError,
    UnavailableError,
)

__all__ = [  # the records live in engine/inflight.py and engine/outcomes.py
    "Completion",
    "Hung",
    "InFlight",
    "Schedule",
    "SchedulerCore",
    "Worker",
]

logger = logging.getLogger(__name__)

_NONE: tuple[Pending, ...] = ()
#: The one shape key of a decoupled model's requests (each keeps its own tensors).
_STREAMS = "stream"
_NO_DISPATCH: tuple[InFlight[Any], ...] = ()


class SchedulerCore(Generic[W]):
    """Admission, batching, dispatch, completion, expiry and the watchdog of one model version.

    Args:
        config: The model's configuration (batching, priorities, timeouts, outputs).
        version: Version number as a string.
        capabilities: What its instances declared at load (unpadded rows, streams).
        on_gpu: Whether an instance runs on a GPU (the default token budget).
        regather_beyond_delay: Let a closed loop's regather window pass the queue delay
            (see :mod:`gpuserve.engine.regather`).

    Attributes:
        stats: Statistics of this version, recorded as requests and batches finish.
        batcher: The queue and batch-formation policy (a :class:`SequenceBatcher` for a
            model with ``sequence_batching``: its batches go to the instance of their lane).
        adaptive: The adaptive batching policy, when configured.
        instances: The instances batches may go to (least busy first).
        in_flight_requests: Requests admitted and not yet finished (queued, retrying or
            running).
        accepting: Whether :meth:`admit` takes requests (after :meth:`attach`, until
            :meth:`close`).
    """

    def __init__(
        self,
        config: ModelConfig,
        version: str,
        capabilities: Capabilities | None = None,
        on_gpu: bool = False,
        regather_beyond_delay: bool = False,
    ) -> None:
        self.config = config
        self.name = config.name or ""
        self.version = version
        capabilities = capabilities or Capabilities()
        db = config.dynamic_batching
        #: How variable-length inputs are padded into one batch (None: they are not).
        self.padding = PaddingSpec.of(config)
        # The batcher is built complete: its token budget (the config's, else the device's
        # default) and whether the instances run unpadded are known here, at load.
        #: Requests of a decoupled model: each answered by a stream (``Pending.sink``), not
        #: by its batch's result (see "Streams" in the module docstring).
        self.streams = config.model_transaction_policy.decoupled
        # a decoupled model's sequence ids reach it through its sinks' parameters, its
        # requests batched by the dynamic batcher whatever its sequence_batching says
        sequence = None if self.streams else config.sequence_batching
        tokens = db.max_batch_tokens if sequence is None else sequence.max_batch_tokens
        if tokens is None:
            tokens = default_batch_tokens(on_gpu)
        self.batcher: Batcher = (
            SequenceBatcher(config, lambda: self.instances, tokens)
            if sequence is not None  # a stateful model (engine/sequence/batcher.py)
            else DynamicBatcher.for_config(
                config,
                tokens,
                capabilities.unpadded,
                capabilities.streams_batches,
                regather_beyond_delay,
            )
        )
        self.adaptive = (
            AdaptiveBatching(
                db.adaptive.target_p99_ms / 1e3, config.max_batch_size, db.max_queue_delay_us / 1e6
            )
            if db.adaptive is not None
            else None
        )
        self.stats = ModelStats(self.name, version)
        self._outcomes = Outcomes(self.name, version, self.stats)
        self.instances: list[W] = []
        self.in_flight_requests = 0
        self.accepting = False
        #: Seconds a batch may run before its instance counts as hung; None = no watchdog.
        self.execution_timeout_s: float | None = config.execution_timeout_s or None
        self._batched = config.max_batch_size > 0
        #: Tensors whose reshape differs from their shape (None: none do).
        self.reshape = ReshapeSpec.of(config)
        self._default_timeout_us = db.default_timeout_us
        self._retry: deque[Batch] = deque()
        self._in_flight: InFlightTable[W] = InFlightTable(self.execution_timeout_s)
        self._nothing: Schedule[W] = Schedule(_NO_DISPATCH, _NONE)  # returned when nothing happens
        #: The batcher's level of bulk requests (0: the batcher has no bulk lane).
        batcher = self.batcher
        self._bulk_level = batcher.bulk_level if isinstance(batcher, DynamicBatcher) else 0

    # -- lifecycle -------------------------------------------------------------------------

    def attach(self, instances: list[W]) -> None:
        """Take ``instances`` (the list itself is kept) and start accepting requests."""
        self.instances = instances
        self.accepting = True

    def add_instance(self, instance: W) -> None:
        """A new instance (a replacement) can take batches."""
        self.instances.append(instance)

    def close(self) -> None:
        """Refuse new requests; queued and running ones carry on (see :meth:`drain`)."""
        self.accepting = False

    @property
    def queued(self) -> int:
        """Requests waiting in the queue (not counting retry halves)."""
        return len(self.batcher)

    @property
    def retrying(self) -> list[Batch]:
        """Halves of failed batches waiting to run again, in the order they will run."""
        return list(self._retry)

    @property
    def in_flight(self) -> list[InFlight[W]]:
        """Batches running on instances, oldest (earliest watchdog deadline) first."""
        return list(self._in_flight)

    # -- admission -------------------------------------------------------------------------

    def admit(
        self, request: InferenceRequest, now: float, sink: ResponseSink | None = None
    ) -> Pending:
        """Queue ``request`` at ``now``; the returned item is its handle until it finishes.
        A decoupled model's request comes with the ``sink`` its responses go to.

        Raises:
            UnavailableError: not accepting (not attached yet, or closing).
            InvalidInputError: its priority is not a level of this model.
            OverloadedError: the queue is full (nothing was queued).
        """
        if not self.accepting:
            raise self._outcomes.refused(
                UnavailableError(f"model '{self.name}' version {self.version} is unloading")
            )
        try:  # the runner's entry checked it (engine/checks.py); the core is used alone too
            priority = priority_level(self.config, self.name, request.priority)
        except InvalidInputError as err:
            raise self._outcomes.refused(err) from None
        if request.lane == "bulk" and self._bulk_level:
            priority = self._bulk_level
        timeout_us = request.timeout_us or self._default_timeout_us
        if self.reshape is not None:  # the model's shapes from here on (engine/reshape.py)
            try:
                request = self.reshape.request(request)
            except InvalidInputError as err:
                raise self._outcomes.refused(err) from None
        rows = request_rows(request) if self._batched else 1
        padding = self.padding
        if self.streams:  # never stacked: requests of any shapes share a batch
            key: Hashable = _STREAMS
        else:
            key = shape_key(request) if padding is None else padding.key(request)
        item = Pending(
            request,
            rows,
            key,
            now,
            now + timeout_us / 1e6 if timeout_us else None,
            priority,
            sink=sink,
        )
        cost = request.cost
        if cost is None and padding is not None:
            cost = request.cost = padding.cost(request, rows)
        if cost is not None and cost.lengths:
            item.length = max(1, cost.longest)
            item.tokens = cost.tokens
        try:
            self.batcher.add(item)
        except (OverloadedError, InvalidInputError) as err:  # invalid: sequence flags
            self._outcomes.refused(err, rows)
            raise
        self.in_flight_requests += 1
        tracing.queue_enter(item, self.name)
        return item

    def cancel(self, item: Pending, now: float) -> bool:
        """Its caller went away (a cancelled future, a closed connection, a caller's
        deadline): take ``item`` out of the queue, or out of a retry half that waits, and
        finish it with CancelledRequestError; True then, and the driver delivers it.

        An item whose batch runs now is marked ``cancelled`` instead: whatever its batch
        gives it, it is counted cancelled (never a success), and it is not retried. False
        then, as for an item already finished.
        """
        if item.outcome is not None:
            return False
        if self.batcher.remove(item) or self._unretry(item):
            self._finish_unrun(item, CancelledRequestError("client cancelled"), now)
            return True
        item.cancelled = True
        return False

    def _unretry(self, item: Pending) -> bool:
        """Take ``item`` out of the retry half holding it; False when none does."""
        retry = self._retry
        for index, half in enumerate(retry):
            if item in half.items:
                rest = [other for other in half.items if other is not item]
                if rest:
                    retry[index] = Batch.of(rest, half.formed_s)
                else:
                    del retry[index]
                return True
        return False

    # -- the queue -> instances --------------------------------------------------------------

    def expire(self, now: float) -> list[Pending]:
        """Finish, with RequestTimeoutError, the queued requests whose deadline is at or before
        ``now``, and return them."""
        expired = self.batcher.expire(now)
        for item in expired:
            waited_ms = (now - item.arrival_s) * 1000
            self._finish_unrun(
                item,
                RequestTimeoutError(
                    f"request timed out in the queue of model '{self.name}' after "
                    f"{waited_ms:.0f} ms without running"
                ),
                now,
            )
        return expired

    def schedule(self, now: float) -> Schedule[W]:
        """Expire, then dispatch what is due while an instance has room: retry halves first,
        then new batches. Requests found cancelled (probe) while batches form are finished."""
        batcher = self.batcher
        finished: Sequence[Pending] = self.expire(now) if batcher.has_deadlines else _NONE
        instance = self._free_instance() if self._retry or len(batcher) else None
        if instance is None:  # nothing to run, or (the common case under load) no room
            if batcher.has_cancelled:
                finished = self._drop_cancelled(finished, now)
            return Schedule(_NO_DISPATCH, finished) if finished else self._nothing
        dispatched: list[InFlight[W]] = []
        retry = self._retry
        adaptive = self.adaptive
        while True:  # an instance has room and there is work
            if retry:
                batch = retry.popleft()
            else:
                if adaptive is not None:
                    adaptive.apply(batcher)
                batcher.bulk_may_lead = instance.in_flight == 0  # bulk only onto an idle one
                formed = batcher.next_batch(now)
                if formed is None:
                    break
                batch = formed
                # a sequence batch runs on the instance that holds its sequences
                pinned = formed.instance if isinstance(formed, SequenceBatch) else None
                if pinned is not None:
                    instance = pinned
            dispatched.append(self._in_flight.add(instance, batch, now))
            if self.streams:  # a stream's queue time ends here, its run goes on past its batch
                for item in batch.items:
                    item.started_s = now
            if not (retry or len(batcher)):
                break
            instance = self._free_instance()
            if instance is None:
                break
        if batcher.has_cancelled:
            finished = self._drop_cancelled(finished, now)
        return Schedule(dispatched, finished)

    def _drop_cancelled(self, finished: Sequence[Pending], now: float) -> list[Pending]:
        dropped = self.batcher.take_cancelled()
        for item in dropped:
            self._finish_unrun(item, CancelledRequestError("client went away"), now)
        return [*finished, *dropped]

    def next_wakeup(self, now: float) -> float | None:
        """The earliest time at which :meth:`schedule` or :meth:`hung` could change its answer
        without an arrival or a completion, seconds, or None: the leading request's queue
        delay (or the regather window), the earliest request deadline, and the earliest
        watchdog deadline. ``now`` when retry halves wait and an instance has room."""
        instance = self._free_instance()
        free = instance is not None
        if free and self._retry:
            return now
        self.batcher.bulk_may_lead = instance is not None and instance.in_flight == 0
        wake = self.batcher.next_wakeup(free)
        if self.execution_timeout_s is None:
            return wake
        deadline = self._in_flight.next_deadline()
        if deadline is not None and (wake is None or deadline < wake):
            return deadline
        return wake

    def _free_instance(self) -> W | None:
        """The least-busy instance with room for another batch, or None."""
        best: W | None = None
        for instance in self.instances:
            if instance.in_flight < instance.capacity and (
                best is None or instance.in_flight < best.in_flight
            ):
                best = instance
        return best

    # -- instances -> requests ---------------------------------------------------------------

    def complete(self, result: BatchResult, now: float) -> Completion:
        """Account for an instance's ``result`` at ``now``: record the batch's statistics,
        answer its requests (each its outputs or its own error), or queue retry halves.

        A result for a batch whose instance was declared hung is ignored (``late``).
        """
        batch = result.batch
        if self._in_flight.pop(batch) is None:
            return Completion(_NONE, late=True)
        self.batcher.ran(result, now)  # first: a sequence batcher settles its sequences
        self._outcomes.batch_ran(result)
        service_s = result.finished_s - result.started_s
        error = result.error
        if self.adaptive is not None and error is None:
            self.adaptive.observe(batch, service_s)
        self.batcher.instance_freed(now, service_s, batch.rows)
        if self.streams:  # each request finishes when its stream ends (stream_ended)
            return Completion(_NONE)
        items = batch.items
        if error is not None:
            if result.retryable and len(items) > 1:
                return self._retry_halves(batch, error, result.started_s, now)
            for item in items:
                self._finish(item, error, result.started_s - item.arrival_s, 0.0, now)
            return Completion(items)
        if self.reshape is not None:  # outputs back in the clients' shapes
            result.results = self.reshape.results(result.results)
        self._outcomes.answered(result, now)
        self.in_flight_requests -= len(items)
        return Completion(items)

    def stream_ended(self, item: Pending, error: GpuserveError | None, now: float) -> bool:
        """The stream of ``item`` (dispatched, a decoupled model's request) ended at ``now``:
        its final response was taken (``error``: the one it ended with, None on success) or
        it was cancelled (``error`` a :class:`CancelledRequestError`, its reason the one the
        request is counted with). Finishes and counts it; False when it was finished already
        (by the watchdog, a queue timeout, a drain)."""
        if item.outcome is not None:
            return False
        self.in_flight_requests -= 1
        self._outcomes.streamed(item, error, now)
        return True

    def _retry_halves(
        self, batch: Batch, error: GpuserveError, started_s: float, now: float
    ) -> Completion:
        """Queue the halves of a failed batch to run again; its cancelled requests are not
        retried but finished (their callers are gone)."""
        logger.warning(
            "model %s version %s: batch of %d requests (%d rows) failed (%s); "
            "retrying it in halves",
            self.name,
            self.version,
            len(batch.items),
            batch.rows,
            error.message,
        )
        items = batch.items
        gone: Sequence[Pending] = _NONE
        if any(item.cancelled for item in items):
            gone = [item for item in items if item.cancelled]
            items = [item for item in items if not item.cancelled]
            for item in gone:
                self._finish(item, error, started_s - item.arrival_s, 0.0, now)
        middle = len(items) // 2
        halves = [Batch.of(part, now) for part in (items[:middle], items[middle:]) if part]
        self._retry.extend(halves)
        return Completion(gone, halves)

    def hung(self, now: float, respawn: bool) -> list[Hung[W]]:
        """Declare hung every instance holding a batch past its watchdog deadline at ``now``.

        Each one's in-flight batches fail with a BackendError naming ``execution_timeout_s``
        and it leaves ``instances``; its late results will be ignored.

        Args:
            now: Seconds.
            respawn: Whether the driver will load a replacement. Without one, once no instance
                is left, every queued request fails with UnavailableError too.
        """
        return [self._declare_hung(w, now, respawn) for w in self._in_flight.overdue(now)]

    def _declare_hung(self, instance: W, now: float, respawn: bool) -> Hung[W]:
        timeout_s = self.execution_timeout_s
        batches = self._in_flight.take(instance)
        logger.error(
            "model %s version %s: instance %s did not finish a batch of %d rows within %.1f s; "
            "replacing it",
            self.name,
            self.version,
            instance.name,
            batches[0].batch.rows,
            timeout_s,
        )
        if instance in self.instances:
            self.instances.remove(instance)
        error = BackendError(
            f"model '{self.name}' instance {instance.name} did not finish within "
            f"{timeout_s:g} s (execution_timeout_s); it is being restarted"
        )
        finished: list[Pending] = []
        for record in batches:
            self.batcher.ran(BatchResult(record.batch, error=error, retryable=False), now)
            for item in record.batch.items:
                if item.outcome is None:  # a stream may have ended while its call ran on
                    self._finish(item, error, 0.0, now - item.arrival_s, now)
                    finished.append(item)
        if not respawn and not self.instances:
            finished.extend(
                self.drain(UnavailableError(f"model '{self.name}' has no working instance"), now)
            )
        return Hung(instance, batches, finished)

    def replacement_failed(self, reason: str, now: float) -> list[Pending]:
        """Loading a replacement for a hung instance failed with ``reason``: if no instance is
        left, fail every waiting request with UnavailableError and return them."""
        if self.instances:
            return []
        return self.drain(
            UnavailableError(f"model '{self.name}' has no working instance: {reason}"), now
        )

    def drain(self, error: GpuserveError, now: float) -> list[Pending]:
        """Fail every request that waits to run (queued, or in a retry half) with ``error`` and
        return them; running batches are left to finish."""
        items = self.batcher.drain()
        while self._retry:
            items.extend(self._retry.popleft().items)
        for item in items:
            self._finish_unrun(item, error, now)
        return items

    # -- finishing ---------------------------------------------------------------------------

    def _finish_unrun(self, item: Pending, error: GpuserveError, now: float) -> None:
        """Finish a request that never ran (its queue time is all its time)."""
        tracing.queue_exit((item,))
        total_s = now - item.arrival_s
        self._finish(item, error, total_s, 0.0, now)

    def _finish(
        self, item: Pending, error: GpuserveError, queue_s: float, compute_s: float, now: float
    ) -> None:
        self.in_flight_requests -= 1
        self._outcomes.failed(item, error, queue_s, compute_s, now)
