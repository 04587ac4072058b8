"""The contract between the inference service and one loaded model version: its runner.

Every loaded version has exactly one :class:`VersionRunner`, picked once at load from the
version's configuration and its backend's :class:`~gpuserve.backends.base.Capabilities`
(:func:`gpuserve.engine.runners.factory.build_runner`):

* :class:`~gpuserve.engine.runners.batching.BatchingRunner`: dynamic or sequence batching on the
  version's instances (a scheduling core and its batcher);
* :class:`~gpuserve.engine.runners.streaming.StreamingRunner`: decoupled models, each request
  answered by a stream of responses;
* :class:`~gpuserve.engine.runners.ensemble.EnsembleRunner`: a DAG of steps, each step entering
  its model's own runner.

Whoever calls (an HTTP or gRPC handler through the service, an ensemble step, a BLS call from a
model) enters the same way, :meth:`VersionRunner.submit` / :meth:`~VersionRunner.infer` /
:meth:`~VersionRunner.stream`, with a request already decoded against the version's config. Each
entry first checks the request against the config (its priority, requested outputs and input
shapes: :mod:`gpuserve.engine.checks`, so every runner and every caller gets one answer for one
mistake), then runs the model's admission step when it declares one (token counts, the UTF-8
check, truncation: :mod:`gpuserve.engine.admission`), then hands the request to the runner's own
queue. ``submit`` gives one response (a decoupled model's only one, or a 400 when it sent none
or several); ``stream`` gives every response, the last one ``final`` (a non-decoupled model's
stream has its one response).

Runners run on the server's event loop; nothing here blocks.
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from gpuserve.backends.base import AdmissionStep, Admitted, Capabilities
from gpuserve.config import ModelConfig
from gpuserve.engine.admission import AdmissionPool, apply, input_bytes, run_checked
from gpuserve.engine.checks import RequestChecks
from gpuserve.engine.padding import PaddingSpec
from gpuserve.engine.request import InferenceRequest, InferenceResponse
from gpuserve.engine.stats import ModelStats, RequestStats
from gpuserve.errors import GpuserveError


@dataclass(slots=True)
class StreamedResponse:
    """One item of a request's stream of responses.

    Attributes:
        response: The response (outputs, id, model version), or None for an empty final
            (the model marked the end without a response) and for an error.
        final: Nothing follows.
        error: This response failed (the model's error, already a GpuserveError).
        index: 0-based position in the stream.
    """

    response: InferenceResponse | None
    final: bool
    error: GpuserveError | None = None
    index: int = 0


class ResponseStream(abc.ABC):
    """The responses of one request, in order (``async for item in stream``).

    Iteration ends after the final item; an item with ``error`` set is yielded, not raised.
    Call :meth:`cancel` (or ``aclose``) when the client goes away before the end.
    """

    def __aiter__(self) -> ResponseStream:
        return self

    @abc.abstractmethod
    async def __anext__(self) -> StreamedResponse:
        """The next item; StopAsyncIteration after the final one or a cancel."""

    @abc.abstractmethod
    def cancel(self, reason: str = "cancelled") -> None:
        """Stop the stream: the model sees the cancellation at its next response; the
        request is counted as failed with ``reason`` unless it had ended."""

    async def aclose(self) -> None:
        """As :meth:`cancel` (for ``contextlib.aclosing``)."""
        self.cancel()


class SingleResponseStream(ResponseStream):
    """The one response of a request to a model that is not decoupled, as a stream of one
    final item (an error item when it failed).

    Args:
        future: The runner's future of the response.
    """

    def __init__(self, future: asyncio.Future[InferenceResponse]) -> None:
        self.future = future
        self._done = False

    async def __anext__(self) -> StreamedResponse:
        if self._done:
            raise StopAsyncIteration
        self._done = True
        try:
            response = await self.future
        except GpuserveError as err:
            return StreamedResponse(None, True, err)
        return StreamedResponse(response, True)

    def cancel(self, reason: str = "cancelled") -> None:
        self._done = True
        self.future.cancel()


class SteppedStream(ResponseStream):
    """A stream whose model has an admission step still to run on the admission threads:
    the step runs when the stream is first read, then the request opens as any other. A
    refusal at either point is raised from the first read.

    Args:
        step: Runs the step and applies its answer.
        open_: Opens the request's stream once the step is done.
    """

    def __init__(
        self, step: Coroutine[Any, Any, None], open_: Callable[[], ResponseStream]
    ) -> None:
        self._step: Coroutine[Any, Any, None] | None = step
        self._open = open_
        self._inner: ResponseStream | None = None
        self._done = False

    async def __anext__(self) -> StreamedResponse:
        if self._done:
            raise StopAsyncIteration
        if self._inner is None:
            step, self._step = self._step, None
            assert step is not None
            await step
            self._inner = self._open()
        return await self._inner.__anext__()

    def cancel(self, reason: str = "cancelled") -> None:
        self._done = True
        step, self._step = self._step, None
        if step is not None:
            step.close()  # never started: nothing to count
        if self._inner is not None:
            self._inner.cancel(reason)


class VersionRunner(abc.ABC):
    """Runs the requests of one loaded model version (module docstring).

    Args:
        config: The version's configuration (completed by its backend at load).
        version: Its version number as a string.
        capabilities: What its instances declared at load (all of them).
        admission_pool: Threads for admission steps of large requests; None runs every
            step where it is called.
        clock: Monotonic clock, seconds.

    Attributes:
        kind: ``"batching"``, ``"streaming"`` or ``"ensemble"``.
        decoupled: Whether a request may get any number of responses (the config's
            ``model_transaction_policy.decoupled``, read once here); front ends mark each
            streamed response ``final`` only then.
        stats: The version's statistics (requests, batches, responses).
    """

    kind: ClassVar[str] = ""

    def __init__(
        self,
        config: ModelConfig,
        version: str,
        capabilities: Capabilities,
        admission_pool: AdmissionPool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.name = config.name or ""
        self.version = version
        self.capabilities = capabilities
        self.decoupled = config.model_transaction_policy.decoupled
        self.clock = clock
        self.stats: ModelStats = ModelStats(self.name, version)
        self._step: AdmissionStep | None = capabilities.admission
        self._pool = admission_pool
        self._inline_bytes = -1 if admission_pool is None else admission_pool.inline_bytes
        self._batched = config.max_batch_size > 0
        self._label = f"model '{self.name}' version {version}"
        self._checks = RequestChecks(config, self.name)
        #: Whether variable-length inputs are padded into batches (then no tensor hand-off).
        self.pads = PaddingSpec.of(config) is not None

    # -- the contract ----------------------------------------------------------------------

    def submit(self, request: InferenceRequest) -> asyncio.Future[InferenceResponse]:
        """Run ``request`` (admission step, then the runner's queue); the future resolves
        with its one response or fails with why (queue timeout, the model's error, unloaded).

        Raises:
            GpuserveError: refused before queueing (a request the config does not allow: 400;
                queue full: 429; unloading: 503; the admission step's refusal or its pool
                full). Counted on the version.
        """
        self._check(request)
        step = self._step
        if step is not None and not self._step_here(step, request):
            return self._after_step(step, request)
        return self._queue(request)

    async def infer(self, request: InferenceRequest) -> InferenceResponse:
        """Run ``request`` and wait for its one response; cancelling the caller takes it
        out of the queue if it has not run yet.

        Raises:
            GpuserveError: as :meth:`submit`, and what its future fails with.
        """
        self._check(request)
        step = self._step
        if step is not None and not self._step_here(step, request):
            await self._run_step(step, request)
        return await self._wait(request)

    def stream(self, request: InferenceRequest) -> ResponseStream:
        """Run ``request``; its responses come from the returned stream as the model
        produces them (one final item for a model that is not decoupled).

        Raises:
            GpuserveError: refused at once (as :meth:`submit`).
        """
        self._check(request)
        step = self._step
        if step is not None and not self._step_here(step, request):
            return SteppedStream(self._run_step(step, request), lambda: self._open(request))
        return self._open(request)

    @property
    def in_flight_requests(self) -> int:
        """Requests admitted and not yet answered (queued, running, streaming)."""
        return 0

    @property
    def queued(self) -> int:
        """Requests waiting for an instance (the queue depth gauge)."""
        return 0

    def lane_queued(self) -> tuple[int, int]:
        """Rows waiting in each lane: (interactive, bulk)."""
        return self.queued, 0

    @property
    def instances(self) -> list[Any]:
        """The version's engine instances (none for an ensemble)."""
        return []

    @property
    def devices(self) -> frozenset[str]:
        """The devices its instances run on (``"cpu"``, ``"cuda:0"``)."""
        return frozenset(instance.context.device for instance in self.instances)

    @property
    def healthy(self) -> bool:
        """Whether the version can take requests now (else :attr:`unhealthy_reason`)."""
        return True

    @property
    def unhealthy_reason(self) -> str | None:
        """Why :attr:`healthy` is False, or None."""
        return None

    def start_trace(self, batches: int, directory: Path) -> None:  # noqa: B027 - optional
        """Profile the next ``batches`` batches of every instance into ``directory``."""

    @abc.abstractmethod
    async def close(self, drain_timeout_s: float = 30.0) -> None:
        """Refuse new requests, let admitted ones finish (up to ``drain_timeout_s``
        seconds), fail what is left with 503 and stop the instances."""

    # -- what each runner provides ---------------------------------------------------------

    @abc.abstractmethod
    def _queue(self, request: InferenceRequest) -> asyncio.Future[InferenceResponse]:
        """Queue a request whose admission step (if any) ran; its one response's future.

        Cancelling that future is the one way every caller says it went away (a closed
        connection, a cancelled call or stream, a caller's deadline): a runner takes the
        request out of its queue at once, so it never runs, and counts it ``cancelled``;
        one that runs already learns of it at its next response (a decoupled model's
        ``is_cancelled()``) or is counted cancelled when it returns, never a success.
        """

    async def _wait(self, request: InferenceRequest) -> InferenceResponse:
        """Queue and await one request. Cancelling the awaiting task cancels the future,
        which is how a caller says it went away, whatever the runner."""
        return await self._queue(request)

    def _open(self, request: InferenceRequest) -> ResponseStream:
        """The stream of a request whose admission step (if any) ran."""
        return SingleResponseStream(self._queue(request))

    # -- admission -------------------------------------------------------------------------

    def _check(self, request: InferenceRequest) -> None:
        """Refuse (counted) a request the version's config does not allow, with the message
        every runner gives (:class:`~gpuserve.engine.checks.RequestChecks`)."""
        try:
            self._checks.check(request.inputs, request.requested_outputs, request.priority)
        except GpuserveError as err:
            self._refused(err)
            raise

    # -- admission steps -------------------------------------------------------------------

    def _rows(self, request: InferenceRequest) -> int:
        if not self._batched:
            return 1
        first = next(iter(request.inputs.values()), None)
        return int(first.shape[0]) if first is not None and first.ndim else 1

    def _step_here(self, step: AdmissionStep, request: InferenceRequest) -> bool:
        """Run the step now, on this thread, when the request is small (at most the pool's
        ``inline_bytes``, or always without a pool); True when it ran."""
        limit = self._inline_bytes
        if limit >= 0 and (limit == 0 or input_bytes(request.inputs, limit) > limit):
            return False
        try:
            apply(request, run_checked(step, request.inputs, self._rows(request), self._label))
        except GpuserveError as err:
            self._refused(err)
            raise
        return True

    def _start_step(
        self, step: AdmissionStep, request: InferenceRequest
    ) -> asyncio.Future[Admitted]:
        assert self._pool is not None
        try:
            return self._pool.run(step, request, self._rows(request), self._label)
        except GpuserveError as err:
            self._refused(err)
            raise

    async def _run_step(self, step: AdmissionStep, request: InferenceRequest) -> None:
        """Run the step on the pool and apply its answer (awaited: cancelling the caller
        drops a step that has not started)."""
        started = self._start_step(step, request)
        try:
            apply(request, await started)
        except GpuserveError as err:
            self._refused(err)
            raise

    def _after_step(
        self, step: AdmissionStep, request: InferenceRequest
    ) -> asyncio.Future[InferenceResponse]:
        """Run the step on the pool, then queue the request; no task per request."""
        started = self._start_step(step, request)
        outer: asyncio.Future[InferenceResponse] = asyncio.get_running_loop().create_future()

        def admitted(done: asyncio.Future[Admitted]) -> None:
            if outer.done():
                return
            if done.cancelled():
                outer.cancel()
                return
            try:
                apply(request, done.result())
            except GpuserveError as err:  # the step's own error: this request only
                self._refused(err)
                outer.set_exception(err)
                return
            try:
                queued = self._queue(request)
            except GpuserveError as err:  # refused at the queue (counted there)
                outer.set_exception(err)
                return
            queued.add_done_callback(lambda ran: _copy(ran, outer))
            outer.add_done_callback(lambda o: queued.cancel() if o.cancelled() else None)

        started.add_done_callback(admitted)
        return outer

    def _refused(self, err: GpuserveError) -> None:
        """Count a request refused before the runner's queue took it."""
        self.stats.record_request(
            RequestStats(self.name, self.version, 0, 0.0, 0.0, 0.0, err.reason)
        )


def _copy(source: asyncio.Future[InferenceResponse], target: asyncio.Future[Any]) -> None:
    if target.done():
        if not source.cancelled():
            source.exception()
        return
    if source.cancelled():
        target.cancel()
    elif source.exception() is not None:
        target.set_exception(source.exception())  # type: ignore[arg-type]
    else:
        target.set_result(source.result())


__all__ = [
    "ResponseStream",
    "SingleResponseStream",
    "SteppedStream",
    "StreamedResponse",
    "VersionRunner",
]
