"""Decoupled execution: one request, a stream of responses, on the instances of one version.

A model with ``model_transaction_policy: {decoupled: true}`` runs each request alone on a free
instance's backend (``backend.stream(inputs, sink)``, see :mod:`gpuserve.backends.streaming`)
on a thread of its own, which holds that instance until ``stream`` returns (a generator's
whole run; a Triton ``execute`` that hands its response sender to a thread of its own frees
the instance sooner). Requests beyond the free instances wait in a FIFO bounded by
``dynamic_batching.max_queue_size`` (429 beyond it); a request whose queue timeout passes
fails at its deadline with a queue timeout (503); one whose client went away is dropped
before it runs.

**Batches of streams**: with ``dynamic_batching`` and ``max_batch_size > 0``, and backends that
run several requests in one call (``streams_batches``: Triton's ``execute(requests)``), the
queue is a :class:`~gpuserve.engine.streaming.batching.StreamBatcher` (the dynamic batcher's
rules: rows up to ``max_batch_size``, ``max_queue_delay_us``, preferred sizes, queue timeouts,
a timer for the delay) and a free instance gets a batch: ``backend.stream_batch([StreamCall(
inputs, channel), ...])``, one channel per request. Each request keeps its own stream: its
id, its bounded buffer, its cancel (only its sender's ``is_cancelled()`` turns True), its
response statistics. An exception from the call fails every request of it that had not
ended. The execution is counted once for the batch (its rows and requests, the call's time);
each request is counted when its own stream ends. Back-pressure stays per request: a send to
a full buffer waits on that request's reader alone (so a model that sends every request's
responses from one thread waits for the slowest reader; a thread per request does not).

Each stream's responses pass through its :class:`~gpuserve.engine.streaming.buffer.ResponseChannel`
(bounded: the model blocks while the client reads slowly). When the stream ends (final
response taken, error, or cancel) the request is counted once in the version's statistics
(one execution, its rows on success, its reason on failure) and its responses in
:attr:`DecoupledExecutor.responses_total`. Each response is also counted as it leaves its
buffer in the version's per-index response statistics (``ModelStats.responses``, Triton's
``response_stats``, see :mod:`gpuserve.engine.response_stats`): success, fail or empty with
its times; a stream cancelled while its model ran counts one cancel at the index it stopped
at, timed until the model's call returned.

Everything here runs on the event loop thread except :meth:`DecoupledExecutor._run` (the
worker thread) and the channel's producer side.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from gpuserve.backends.python import to_numpy_dict
from gpuserve.backends.streaming import StreamCall
from gpuserve.config import ModelConfig
from gpuserve.engine.assembly import OutputSpec, check_sent
from gpuserve.engine.request import InferenceRequest
from gpuserve.engine.response_stats import ResponseOutcome
from gpuserve.engine.stats import BatchStats, ModelStats, RequestStats
from gpuserve.engine.streaming.batching import StreamBatcher, batches_streams
from gpuserve.engine.streaming.buffer import ResponseChannel, StreamItem
from gpuserve.errors import (
    BackendError,
    GpuserveError,
    OverloadedError,
    RequestTimeoutError,
    UnavailableError,
)

if TYPE_CHECKING:
    from gpuserve.engine.instance import Instance

logger = logging.getLogger(__name__)

_SUCCESS, _FAIL, _EMPTY = ResponseOutcome.SUCCESS, ResponseOutcome.FAIL, ResponseOutcome.EMPTY


@dataclass(slots=True, eq=False)
class StreamJob:
    """One admitted decoupled request, from admission until its stream ends.

    Attributes:
        request: The validated request.
        rows: Its batch-dimension size (1 without batching).
        channel: Its response buffer.
        admitted_s / started_s / ended_s: Monotonic seconds (0.0 until it happens).
        deadline_s: Queue deadline, or None.
        running: Its backend call holds an instance now.
        cancelled_s: When it was cancelled while running (its cancel is counted when the
            call returns), or None.
        batched: It ran in a batch of streams (its execution is counted with the batch's).
    """

    request: InferenceRequest
    rows: int
    channel: ResponseChannel = field(repr=False)
    admitted_s: float = 0.0
    started_s: float = 0.0
    ended_s: float = 0.0
    deadline_s: float | None = None
    running: bool = False
    cancelled_s: float | None = None
    batched: bool = False


class StreamHost(Protocol):
    """What the executor needs of the version it runs for (its streaming runner)."""

    @property
    def instances(self) -> list[Instance]:
        """The version's started instances."""
        ...

    @property
    def accepting(self) -> bool:
        """Whether new requests are taken (False once the version unloads)."""
        ...

    @property
    def stats(self) -> ModelStats:
        """The version's statistics."""
        ...

    def hold(self) -> None:
        """A stream started on an instance: the version's drain waits for it."""
        ...

    def release(self) -> None:
        """A stream of :meth:`hold` ended."""
        ...


class DecoupledExecutor:
    """Runs the decoupled requests of one model version on its instances.

    Args:
        host: The version's streaming runner (its instances, statistics and drain), held
            weakly: an unloaded version's late callbacks find nothing.
        config: The version's configuration.
        version: Its version number as a string.
        streams_batches: Its backends run several streams in one call
            (``Capabilities.streams_batches``).
        loop: The event loop consumers run on.
        clock: Monotonic clock, seconds.

    Attributes:
        responses_total: Responses the consumers took, all streams together.
        peak_buffered: Most responses any ended stream held at once between its model and
            its client (at most ``max_buffered_responses``).
        active: Streams whose backend call holds an instance now.
        streaming: Streams started and not yet ended (a Triton model's may outlive its
            ``execute``); the version's drain waits for them.
        batcher: The batching queue when requests run in batches of streams (module
            docstring), else None (one request per call).
    """

    def __init__(
        self,
        host: StreamHost,
        config: ModelConfig,
        version: str,
        streams_batches: bool,
        loop: asyncio.AbstractEventLoop,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._host = weakref.ref(host)
        self.name = config.name or ""
        self.version = version
        self.config = config
        self.loop = loop
        self.clock = clock
        self._busy: set[int] = set()  # indices into host.instances
        self._waiting: deque[StreamJob] = deque()
        self.responses_total = 0
        self.peak_buffered = 0
        self.active = 0
        self.streaming = 0
        self._declared = {t.name for t in self.config.outputs}
        self._spec = OutputSpec.of(config)
        # Held directly (it references nothing): counting a response is on the hot path.
        self._responses = host.stats.responses
        self.batcher: StreamBatcher[StreamJob] | None = None
        if batches_streams(self.config) and streams_batches:
            self.batcher = StreamBatcher(self.config)
        self._timer: asyncio.TimerHandle | None = None

    @property
    def host(self) -> StreamHost:
        """The version's runner.

        Raises:
            UnavailableError: the version was unloaded.
        """
        host = self._host()
        if host is None:
            raise UnavailableError(f"model '{self.name}' version {self.version} was unloaded")
        return host

    @property
    def queued(self) -> int:
        """Requests waiting for an instance."""
        return len(self._waiting) if self.batcher is None else len(self.batcher)

    def open(self, request: InferenceRequest, rows: int) -> StreamJob:
        """Admit ``request``: run it now on a free instance, or queue it.

        Raises:
            UnavailableError: the version is unloading.
            OverloadedError: ``max_queue_size`` requests already wait.
        """
        policy = self.config.dynamic_batching
        if not self.host.accepting:
            raise UnavailableError(f"model '{self.name}' is unloading")
        if self.queued >= policy.max_queue_size:
            raise OverloadedError(
                f"model '{self.name}': {self.queued} streams wait for an "
                f"instance (max_queue_size {policy.max_queue_size})",
                retry_after_s=1.0,
            )
        now = self.clock()
        timeout_us = request.timeout_us or policy.default_timeout_us
        job = StreamJob(request, rows, channel=None, admitted_s=now)  # type: ignore[arg-type]
        job.deadline_s = now + timeout_us / 1e6 if timeout_us else None
        job.channel = ResponseChannel(
            self.config.model_transaction_policy.max_buffered_responses,
            self.loop,
            request_id=request.id or "",
            parameters=request.parameters,
            convert=lambda outputs: self._convert(request, outputs),
            to_error=self._to_error,
            probe=request.is_cancelled,
            on_done=lambda outcome: self._finished(job, outcome),
            on_response=lambda item: self._counted(job, item),
            clock=self.clock,
        )
        if self.batcher is not None:
            self.batcher.add(job, request, rows, now, job.deadline_s)
        else:
            self._waiting.append(job)
        self._dispatch()
        return job

    # -- dispatch (loop thread) ------------------------------------------------------------

    def _free_instance(self, instances: list[Instance]) -> int | None:
        return next((i for i in range(len(instances)) if i not in self._busy), None)

    def _timed_out(self, job: StreamJob) -> None:
        job.channel.send(
            None,
            final=True,
            error=RequestTimeoutError(
                f"model '{self.name}': the queue timeout passed before an instance was free"
            ),
        )

    def _dispatch(self) -> None:
        if self.batcher is not None:
            self._dispatch_batches(self.batcher)
            return
        instances = self.host.instances
        now = self.clock()
        if any(j.deadline_s is not None and now > j.deadline_s for j in self._waiting):
            # answered at its deadline, not when an instance frees (a stream may run long)
            late = [j for j in self._waiting if j.deadline_s is not None and now > j.deadline_s]
            self._waiting = deque(j for j in self._waiting if j not in late)
            for job in late:
                if not job.channel.is_cancelled():
                    self._timed_out(job)
        while self._waiting:
            index = self._free_instance(instances)
            if index is None:
                break
            job = self._waiting.popleft()
            if job.channel.is_cancelled():
                continue  # counted by the channel's on_done
            self._start([job], instances[index], index, now)
        self._arm_deadline(now)

    def _arm_deadline(self, now: float) -> None:
        """One timer at the earliest queue deadline of the waiting streams (none without)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        deadlines = [j.deadline_s for j in self._waiting if j.deadline_s is not None]
        if deadlines and not self.loop.is_closed():
            wake = min(deadlines)
            self._timer = self.loop.call_later(max(0.0, wake - now) + 1e-4, self._on_timer)

    def _dispatch_batches(self, batcher: StreamBatcher[StreamJob]) -> None:
        """Start the due batches on the free instances; then arm the timer for the next
        deadline or queue delay."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        now = self.clock()
        for job in batcher.expired(now):
            self._timed_out(job)
        instances = self.host.instances
        while (index := self._free_instance(instances)) is not None:
            batch = batcher.next_batch(now)
            for job in batcher.gone():
                job.channel.is_cancelled()  # its probe says so: the channel reports it
            if batch is None:
                break
            jobs = [job for job in batch.jobs if not job.channel.is_cancelled()]
            if jobs:
                self._start(jobs, instances[index], index, now)
        wake = batcher.next_wakeup(self._free_instance(instances) is not None)
        if wake is not None and not self.loop.is_closed():
            self._timer = self.loop.call_later(max(0.0, wake - now), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self._host() is not None:
            self._dispatch()

    def _start(self, jobs: list[StreamJob], instance: Instance, index: int, now: float) -> None:
        """Run ``jobs`` on instance ``index`` (held until the call returns), on a thread."""
        self._busy.add(index)
        batched = self.batcher is not None
        for job in jobs:
            job.started_s = now
            job.running = True
            job.batched = batched
            job.channel.mark_started(now)
            self.active += 1
            self._hold(+1)
        thread = threading.Thread(
            target=self._run_batch if batched else self._run,
            args=(jobs, instance, index),
            name=f"gpuserve-{instance.name}-stream",
            daemon=True,
        )
        thread.start()

    def _run(self, jobs: list[StreamJob], instance: Instance, index: int) -> None:
        """Worker thread: the backend's ``stream`` for one request."""
        (job,) = jobs
        channel = job.channel
        started_s = self.clock()
        try:
            instance.backend.stream(job.request.inputs, channel)
        except BaseException as err:  # the model's failure ends its stream only
            channel.send(None, final=True, error=err)
        finally:
            self._returned(jobs, index, self.clock() - started_s, True)

    def _run_batch(self, jobs: list[StreamJob], instance: Instance, index: int) -> None:
        """Worker thread: the backend's ``stream_batch`` for a batch of requests; its
        exception fails every request of the batch that has not ended."""
        started_s = self.clock()
        ok = True
        try:
            instance.backend.stream_batch(
                [StreamCall(job.request.inputs, job.channel) for job in jobs]
            )
        except BaseException as err:
            ok = False
            error = self._to_error(err)  # logged once, sent to each
            for job in jobs:
                job.channel.send(None, final=True, error=error)
        finally:
            self._returned(jobs, index, self.clock() - started_s, ok)

    def _returned(self, jobs: list[StreamJob], index: int, call_s: float, ok: bool) -> None:
        """Worker thread: the backend call returned after ``call_s`` seconds."""
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._release, jobs, index, call_s, ok)

    def _release(self, jobs: list[StreamJob], index: int, call_s: float, ok: bool) -> None:
        self.active -= len(jobs)
        self._busy.discard(index)
        now = self.clock()
        for job in jobs:
            job.running = False
            if job.cancelled_s is not None:  # cancelled while it ran: its clean-up ends now
                self._count_cancel(job, now - job.cancelled_s)
        host = self._host()
        if host is None:
            return
        if self.batcher is not None:  # one execution for the batch (module docstring)
            rows = sum(job.rows for job in jobs)
            host.stats.record_batch(
                BatchStats(self.name, self.version, rows, len(jobs), 0.0, call_s, 0.0, ok)
            )
            self.batcher.instance_freed(now, call_s, rows)
        self._dispatch()

    def _hold(self, change: int) -> None:
        """Count a stream that runs or ran on an instance until it ends, and keep the
        version's drain (unload, shutdown) waiting for it (``StreamHost.hold``)."""
        self.streaming += change
        host = self._host()
        if host is not None:
            if change > 0:
                host.hold()
            else:
                host.release()

    # -- conversions (producer thread) -----------------------------------------------------

    def _convert(self, request: InferenceRequest, outputs: dict[str, Any]) -> dict[str, np.ndarray]:
        arrays = to_numpy_dict(outputs)
        unknown = sorted(set(arrays) - self._declared)
        if unknown:
            raise BackendError(
                f"model '{self.name}' sent output(s) {unknown} it does not declare "
                f"(outputs: {sorted(self._declared)})"
            )
        check_sent(self._spec, arrays)  # declared shape and datatype, as every path
        wanted = request.requested_outputs
        if wanted is not None:
            arrays = {name: array for name, array in arrays.items() if name in wanted}
        return arrays

    def _to_error(self, error: BaseException) -> GpuserveError:
        if isinstance(error, GpuserveError):
            return error
        logger.error(
            "model %s: decoupled request failed: %s: %s",
            self.name,
            type(error).__name__,
            error,
            exc_info=(type(error), error, error.__traceback__),
        )
        text = str(error)
        described = f"{type(error).__name__}: {text}" if text else type(error).__name__
        return BackendError(f"model '{self.name}' failed: {described}")

    # -- statistics (loop thread) ----------------------------------------------------------

    def _counted(self, job: StreamJob, item: StreamItem) -> None:
        """A response left its stream's buffer: count it at its index (not the error of a
        request that never ran: its model produced nothing)."""
        if job.started_s == 0.0:
            return  # it never ran
        if item.error is not None:
            outcome = _FAIL
        elif item.outputs is None:
            outcome = _EMPTY
        else:
            outcome = _SUCCESS
        self._responses.record_response(item.index, outcome, item.infer_s, item.output_s)

    def _count_cancel(self, job: StreamJob, cleanup_s: float) -> None:
        job.cancelled_s = None
        self._responses.record_cancel(job.channel.core.produced, cleanup_s)

    def _finished(self, job: StreamJob, outcome: GpuserveError | str | None) -> None:
        now = self.clock()
        if job.started_s == 0.0:  # ended while queued (cancelled): free its place now
            if self.batcher is not None:
                self.batcher.remove(job)
            elif job in self._waiting:
                self._waiting.remove(job)
        if job.started_s > 0.0:
            self._hold(-1)
            if isinstance(outcome, str):  # cancelled (by its client, or by the server)
                if job.running:
                    job.cancelled_s = now  # counted when its call returns
                else:
                    self._count_cancel(job, 0.0)
        job.ended_s = now
        core = job.channel.core
        self.responses_total += core.taken
        self.peak_buffered = max(self.peak_buffered, core.high_water)
        ran = job.started_s > 0.0
        queue_s = (job.started_s if ran else now) - job.admitted_s
        compute_s = now - job.started_s if ran else 0.0
        if isinstance(outcome, GpuserveError):
            reason: str | None = outcome.reason
        else:
            reason = outcome  # None (success) or "cancelled"
        host = self._host()
        if host is None:
            return  # unloaded: its statistics went with it
        stats = host.stats
        name, version = self.name, self.version
        if ran and not job.batched:
            stats.record_batch(
                BatchStats(name, version, job.rows, 1, 0.0, compute_s, 0.0, reason is None)
            )
        stats.record_request(
            RequestStats(name, version, job.rows, queue_s, compute_s, now - job.admitted_s, reason)
        )
