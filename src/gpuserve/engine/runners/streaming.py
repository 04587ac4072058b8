"""The streaming runner: decoupled models, each request answered by a stream of responses.

The runner of a version with ``model_transaction_policy: {decoupled: true}``. It owns the
version's instances and its :class:`~gpuserve.engine.streaming.executor.DecoupledExecutor` (built at
load, with the stream batcher when the backends run batches of streams), and implements the
:class:`~gpuserve.engine.runners.base.VersionRunner` contract:

* :meth:`~StreamingRunner.stream` gives the responses as the model sends them (gRPC
  ``ModelStreamInfer``, HTTP ``/generate_stream``); cancelling the stream stops the model
  (its generator is closed, its sender's ``is_cancelled()`` turns True);
* :meth:`~StreamingRunner.submit` gives the one response of a request that sent exactly one,
  else a 400 naming the policy (unary front ends: ``ModelInfer``, ``/infer``, ``/generate``).

The version's drain (unload, shutdown) waits for every stream that started on an instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path

from gpuserve.backends.base import Capabilities
from gpuserve.config import ModelConfig
from gpuserve.engine.admission import AdmissionPool
from gpuserve.engine.instance import Instance
from gpuserve.engine.request import InferenceRequest, InferenceResponse, RequestTiming
from gpuserve.engine.runners.base import ResponseStream, StreamedResponse, VersionRunner
from gpuserve.engine.streaming.buffer import StreamItem
from gpuserve.engine.streaming.executor import DecoupledExecutor, StreamJob
from gpuserve.errors import InvalidInputError, UnavailableError


class DecoupledStream(ResponseStream):
    """The responses of one decoupled request, as its model sends them.

    Args:
        runner: The version's runner (names the responses).
        request: The request.
        job: Its executor job.
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
        job = self.job
        response = InferenceResponse(
            model_name=self.runner.name,
            model_version=self.runner.version,
            id=self.request.id,
            outputs=item.outputs,
            timing=RequestTiming(queue_s=max(0.0, job.started_s - job.admitted_s)),
            rows=job.rows,
        )
        return StreamedResponse(response, item.final, item.error, item.index)

    def cancel(self, reason: str = "cancelled") -> None:
        self._done = True
        self.job.channel.cancel(reason)


class StreamingRunner(VersionRunner):
    """Runs the requests of one decoupled model version (module docstring).

    Args:
        config: The version's configuration (decoupled).
        version: Its version number as a string.
        capabilities: What its instances declared (``streams`` must be set).
        admission_pool: Threads for the admission steps of large requests.
        clock: Monotonic clock, seconds.

    Attributes:
        executor: Runs the streams on the instances (after :meth:`attach`).
    """

    kind = "streaming"

    def __init__(
        self,
        config: ModelConfig,
        version: str,
        capabilities: Capabilities,
        admission_pool: AdmissionPool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(config, version, capabilities, admission_pool, clock)
        self._instances: list[Instance] = []
        self.executor: DecoupledExecutor | None = None
        self.accepting = False
        self._held = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def attach(self, instances: list[Instance], loop: asyncio.AbstractEventLoop) -> None:
        """Take the started instances and start accepting requests on ``loop``."""
        self._instances = instances
        self.executor = DecoupledExecutor(
            self, self.config, self.version, self.capabilities.streams_batches, loop, self.clock
        )
        self.accepting = True

    # -- what the executor needs (StreamHost) ------------------------------------------------

    @property
    def instances(self) -> list[Instance]:
        """The version's instances."""
        return self._instances

    def hold(self) -> None:
        """A stream started on an instance: :meth:`close` waits for it."""
        self._held += 1
        self._idle.clear()

    def release(self) -> None:
        """A stream of :meth:`hold` ended."""
        self._held = max(0, self._held - 1)
        if not self._held:
            self._idle.set()

    # -- the contract ----------------------------------------------------------------------

    @property
    def in_flight_requests(self) -> int:
        """Streams queued or running."""
        executor = self.executor
        return 0 if executor is None else executor.queued + executor.streaming

    @property
    def queued(self) -> int:
        """Streams waiting for an instance."""
        return 0 if self.executor is None else self.executor.queued

    @property
    def healthy(self) -> bool:
        """Whether an instance can run streams."""
        return bool(self._instances)

    def start_trace(self, batches: int, directory: Path) -> None:
        """Profile the next ``batches`` calls of every instance into ``directory``."""
        for instance in self._instances:
            instance.start_trace(batches, directory)

    def _open(self, request: InferenceRequest) -> ResponseStream:
        """Open the stream of a request (its admission step done).

        Raises:
            GpuserveError: refused at the queue (full: 429; unloading: 503). Counted.
        """
        executor = self.executor
        if executor is None:
            raise UnavailableError(f"model '{self.name}' version {self.version} is not loaded")
        return DecoupledStream(self, request, executor.open(request, self._rows(request)))

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

    async def close(self, drain_timeout_s: float = 30.0) -> None:
        """Refuse new streams, let running ones end (up to the timeout), stop the
        instances."""
        self.accepting = False
        # streams still running past the timeout end when their instances stop
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), drain_timeout_s)
        loop = asyncio.get_running_loop()
        for instance in self._instances:
            await loop.run_in_executor(None, instance.stop)


__all__ = ["DecoupledStream", "StreamingRunner"]
