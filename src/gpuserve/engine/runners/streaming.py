"""The streaming runner: decoupled models, each request answered by a stream of responses.

The runner of a version with ``model_transaction_policy: {decoupled: true}``. It is the
batching runner's driver (:class:`~gpuserve.engine.runners.batching.BatchingRunner`) on the
same scheduling core (:class:`~gpuserve.engine.scheduling.SchedulerCore`, with its
``streams`` set) and the same instance threads; only how a request is answered differs:

* each admitted request carries its :class:`~gpuserve.engine.streaming.buffer.ResponseChannel`
  (``Pending.sink``, bounded: the model blocks while its client reads slowly), and its
  instance's forward stage calls the backend's ``stream`` (one request) or ``stream_batch``
  (a batch of them: backends that declare ``streams_batches``, models with
  ``dynamic_batching`` and ``max_batch_size > 0``) with the channels;
* so queueing (``max_queue_size``: 429; queue timeouts: 503 at the deadline; priorities),
  batch formation (rows, ``max_queue_delay_us``, preferred sizes, the token budget, adaptive
  batching), dispatch to the least-busy instance, the execution timeout watchdog (the stuck
  call's streams fail with a 500, its instance is replaced) and the version's statistics of
  executions are the core's, as for every other model;
* the batch's result reports the call (its time, whether it raised): the instance is free
  again when the call returns, even while a stream goes on (a Triton model that hands its
  response sender to a thread of its own); each request finishes when its stream ends (final
  response taken, error, or cancel: :meth:`SchedulerCore.stream_ended`), and the version's
  drain (unload, shutdown) waits for that.

Cancelling a stream (its client went away) takes a queued request out of the queue at once
(counted cancelled, never run); a running one is counted cancelled at once and its model
learns of it at its next response (its generator is closed, its sender's ``is_cancelled()``
turns True). Each response is counted as it leaves its buffer in the version's per-index
response statistics (``ModelStats.responses``, Triton's ``response_stats``, see
:mod:`gpuserve.engine.response_stats`): success, fail or empty with its times; a stream
cancelled while its model ran counts one cancel at the index it stopped at, timed until the
model's call returned.

* :meth:`~StreamingRunner.stream` gives the responses as the model sends them (gRPC
  ``ModelStreamInfer``, HTTP ``/generate_stream``);
* :meth:`~StreamingRunner.submit` gives the one response of a request that sent exactly one,
  else a 400 naming the policy (unary front ends: ``ModelInfer``, ``/infer``, ``/generate``).

Everything here runs on the event loop thread except the channels' producer side (the
conversions, on the model's thread).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuserve.backends.base import Capabilities
from gpuserve.backends.python import to_numpy_dict
from gpuserve.config import ModelConfig
from gpuserve.engine.admission import AdmissionPool
from gpuserve.engine.assembly import OutputSpec, check_sent
from gpuserve.engine.batch import Batch, BatchResult, Pending
from gpuserve.engine.request import InferenceRequest, InferenceResponse, RequestTiming
from gpuserve.engine.response_stats import ResponseOutcome
from gpuserve.engine.runners.base import ResponseStream, StreamedResponse
from gpuserve.engine.runners.batching import BatchingRunner
from gpuserve.engine.streaming.buffer import ResponseChannel, StreamItem
from gpuserve.errors import (
    BackendError,
    CancelledRequestError,
    GpuserveError,
    InvalidInputError,
    UnavailableError,
)

logger = logging.getLogger(__name__)

_SUCCESS, _FAIL, _EMPTY = ResponseOutcome.SUCCESS, ResponseOutcome.FAIL, ResponseOutcome.EMPTY


@dataclass(slots=True, eq=False)
class StreamJob:
    """One admitted decoupled request, from admission until its stream ended and its model's
    call returned (the loop thread's bookkeeping).

    Attributes:
        channel: Its response buffer (also its request's ``Pending.sink``).
        item: Its handle in the scheduling core (set once admitted).
        running: Its batch was dispatched and its call has not returned yet.
        cancelled_s: When it was cancelled while running (its response statistics' cancel
            is counted when the call returns), seconds, or None.
    """

    channel: ResponseChannel = field(repr=False)
    item: Pending | None = None
    running: bool = False
    cancelled_s: float | None = None

    @property
    def pending(self) -> Pending:
        """Its handle in the scheduling core."""
        assert self.item is not None, "the job was not admitted"
        return self.item


class DecoupledStream(ResponseStream):
    """The responses of one decoupled request, as its model sends them.

    Args:
        runner: The version's runner (names the responses).
        request: The request.
        job: Its job.
    """

    def __init__(self, runner: StreamingRunner, request: InferenceRequest, job: StreamJob) -> None:
        self.runner = runner
        self.request = request
        self.job = job
        self._done = False

    async def __anext__(self) -> StreamedResponse:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self.job.channel.get()
        except BaseException:  # the reader was cancelled (client gone): stop the model
            self.cancel()
            raise
        if item is None:  # cancelled
            self._done = True
            raise StopAsyncIteration
        if item.final:
            self._done = True
        return self._wrap(item)

    def _wrap(self, item: StreamItem) -> StreamedResponse:
        if item.outputs is None:
            return StreamedResponse(None, item.final, item.error, item.index)
        pending = self.job.pending
        response = InferenceResponse(
            model_name=self.runner.name,
            model_version=self.runner.version,
            id=self.request.id,
            outputs=item.outputs,
            timing=RequestTiming(queue_s=max(0.0, pending.started_s - pending.arrival_s)),
            rows=pending.rows,
        )
        return StreamedResponse(response, item.final, item.error, item.index)

    def cancel(self, reason: str = "cancelled") -> None:
        self._done = True
        self.job.channel.cancel(reason)


class StreamingRunner(BatchingRunner):
    """Runs the requests of one decoupled model version (module docstring).

    Args:
        config: The version's configuration (decoupled).
        version: Its version number as a string.
        capabilities: What its instances declared (``streams`` must be set).
        admission_pool: Threads for the admission steps of large requests.
        clock: Monotonic clock, seconds.
        on_gpu: Whether an instance runs on a GPU (the default token budget).

    Attributes:
        responses_total: Responses the clients took, all streams together.
        peak_buffered: Most responses any ended stream held at once between its model and
            its client (at most ``max_buffered_responses``).
    """

    kind = "streaming"

    def __init__(
        self,
        config: ModelConfig,
        version: str,
        capabilities: Capabilities | None = None,
        admission_pool: AdmissionPool | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        on_gpu: bool = False,
    ) -> None:
        super().__init__(config, version, capabilities, admission_pool, clock, on_gpu=on_gpu)
        self.responses_total = 0
        self.peak_buffered = 0
        self._jobs: dict[Pending, StreamJob] = {}
        self._capacity = config.model_transaction_policy.max_buffered_responses
        self._declared = {t.name for t in config.outputs}
        self._spec = OutputSpec.of(config)
        # Held directly (it references nothing): counting a response is on the hot path.
        self._responses = self.stats.responses

    # -- admission -------------------------------------------------------------------------

    def _open(self, request: InferenceRequest) -> ResponseStream:
        """Open the stream of a request (its admission step done) and queue it.

        Raises:
            GpuserveError: refused at the queue (full: 429; unloading: 503). Counted.
        """
        loop = self._loop
        if loop is None:
            raise UnavailableError(f"model '{self.name}' version {self.version} is not loaded")
        job = StreamJob(channel=None)  # type: ignore[arg-type]  # the channel names the job
        job.channel = ResponseChannel(
            self._capacity,
            loop,
            request_id=request.id or "",
            parameters=request.parameters,
            convert=lambda outputs: self._convert(request, outputs),
            to_error=self._to_error,
            probe=request.is_cancelled,
            on_done=lambda outcome: self._ended(job, outcome),
            on_response=lambda item: self._counted(job, item),
            clock=self.clock,
        )
        now = self.clock()
        item = job.item = self.core.admit(request, now, job.channel)
        self._jobs[item] = job
        self._idle.clear()
        self._pump(now)  # may already finish it (client gone): its channel says so then
        return DecoupledStream(self, request, job)

    def _queue(self, request: InferenceRequest) -> asyncio.Future[InferenceResponse]:
        """The one response of a request (unary callers): a task that reads its stream.
        Cancelling it cancels the stream, even before the task first ran."""
        stream = self._open(request)
        task = asyncio.ensure_future(self._collect_single(stream))
        task.add_done_callback(lambda done: stream.cancel() if done.cancelled() else None)
        return task

    async def _collect_single(self, stream: ResponseStream) -> InferenceResponse:
        first: InferenceResponse | None = None
        try:
            async for item in stream:
                if item.error is not None:
                    raise item.error
                if item.response is None:
                    continue
                if first is not None:
                    stream.cancel("invalid")
                    raise self._refusal("more than one response")
                first = item.response
        finally:
            stream.cancel()  # a no-op after the final item
        if first is None:
            raise self._refusal("no response")
        return first

    def _refusal(self, count: str) -> InvalidInputError:
        """The 400 of a unary call to a decoupled model that did not send exactly one
        response."""
        return InvalidInputError(
            f"model '{self.name}' uses the decoupled transaction policy "
            f"(model_transaction_policy.decoupled) and sent {count} to this request; "
            "a unary call takes exactly one: read its responses as a stream (gRPC "
            f"ModelStreamInfer, or POST /v2/models/{self.name}/generate_stream)"
        )

    # -- the driver's hooks (loop thread) ----------------------------------------------------

    def _dispatched(self, batch: Batch, now: float) -> None:
        """Its streams run from ``now``: the first response's time counts from here."""
        jobs = self._jobs
        for item in batch.items:
            job = jobs.get(item)
            if job is not None:
                job.running = True
                job.channel.mark_started(now)

    def _complete(self, result: BatchResult) -> None:
        """The call of a batch of streams returned: the core frees the instance and counts
        the execution; a stream cancelled while it ran counts its cancel now."""
        now = self.clock()
        self.core.complete(result, now)  # finishes none of them: their streams do
        jobs = self._jobs
        for item in result.batch.items:
            job = jobs.get(item)
            if job is None:
                continue
            job.running = False
            if job.cancelled_s is not None:
                self._count_cancel(job, now - job.cancelled_s)
            if item.outcome is not None:
                del jobs[item]
        self._pump(now)

    def _deliver(self, items: Iterable[Pending]) -> None:
        """Requests the core finished without their stream ending (queue timeout, client
        gone while queued, the watchdog, a drain): end each stream with its outcome."""
        jobs = self._jobs
        for item in items:
            job = jobs.get(item)
            if job is None:
                continue
            outcome = item.outcome
            if isinstance(outcome, CancelledRequestError) and not item.started_s:
                job.channel.cancel()  # its client went away while it waited: nobody reads
            elif isinstance(outcome, GpuserveError):
                job.channel.fail(outcome)
            if not job.running:
                del jobs[item]
        self._check_idle()

    def _check_idle(self) -> None:
        if not self.core.in_flight_requests:
            self._idle.set()

    # -- the stream's end (loop thread) ------------------------------------------------------

    def _ended(self, job: StreamJob, outcome: GpuserveError | str | None) -> None:
        """The channel's ``on_done``: its final response was taken (``outcome`` its error or
        None) or it was cancelled (``outcome`` the reason it is counted with)."""
        now = self.clock()
        core = job.channel.core
        self.responses_total += core.taken
        self.peak_buffered = max(self.peak_buffered, core.high_water)
        item = job.pending
        error: GpuserveError | None
        if isinstance(outcome, str):
            if not item.started_s:  # still queued: it leaves the queue now and never runs
                if self.core.cancel(item, now):
                    self._deliver((item,))
                return
            if job.running:
                job.cancelled_s = now  # its cancel is counted when its call returns
            else:
                self._count_cancel(job, 0.0)
            error = CancelledRequestError(f"model '{self.name}': the stream was {outcome}")
            error.reason = outcome  # "cancelled", or why the server ended it ("invalid")
        else:
            error = outcome
        self.core.stream_ended(item, error, now)
        if not job.running:
            self._jobs.pop(item, None)
        self._check_idle()

    # -- statistics (loop thread) ----------------------------------------------------------

    def _counted(self, job: StreamJob, item: StreamItem) -> None:
        """A response left its stream's buffer: count it at its index (not the error of a
        request that never ran: its model produced nothing)."""
        pending = job.item
        if pending is None or not pending.started_s:
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

    # -- conversions (the model's thread) --------------------------------------------------

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


__all__ = ["DecoupledStream", "StreamJob", "StreamingRunner"]
