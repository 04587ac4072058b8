"""Streams of responses from decoupled models, for every front end.

A request the service admitted for a model with ``model_transaction_policy: {decoupled:
true}`` is run by that version's :class:`~gpuserve.engine.decoupled.DecoupledExecutor` (one
per version, made on first use) and read as a :class:`ResponseStream`: an async iterator of
:class:`StreamedResponse`, the last one marked ``final``. Front ends write each out as it
comes (gRPC ``ModelStreamInfer``, HTTP ``/generate_stream``) and call
:meth:`ResponseStream.cancel` when their client goes away; the model then stops (its
generator is closed, its sender's ``is_cancelled()`` turns True).

Unary front ends (``ModelInfer``, ``/infer``, ``/generate``) get :func:`single_response`: the
one response of a decoupled model that sent exactly one, else a 400 naming the policy.
"""

from __future__ import annotations

import abc
import asyncio
import weakref
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuserve.engine.decoupled import DecoupledExecutor, StreamJob
from gpuserve.engine.request import InferenceResponse, RequestTiming
from gpuserve.engine.scheduler import ModelScheduler
from gpuserve.engine.stream_buffer import StreamItem
from gpuserve.errors import GpuserveError, InvalidInputError

if TYPE_CHECKING:
    from gpuserve.service.inference import Admission

_EXECUTORS: weakref.WeakKeyDictionary[ModelScheduler, DecoupledExecutor] = (
    weakref.WeakKeyDictionary()
)


@dataclass(slots=True)
class StreamedResponse:
    """One item of a decoupled request's stream.

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


def is_decoupled(admission: Admission) -> bool:
    """Whether the admitted request's version answers with a stream."""
    return admission.config.model_transaction_policy.decoupled


def executor_of(scheduler: ModelScheduler) -> DecoupledExecutor | None:
    """The decoupled executor of ``scheduler``'s version, None before its first request."""
    return _EXECUTORS.get(scheduler)


def executor_for(scheduler: ModelScheduler) -> DecoupledExecutor:
    """The decoupled executor of ``scheduler``'s version (made on first use, on the running
    loop)."""
    executor = _EXECUTORS.get(scheduler)
    if executor is None:
        executor = DecoupledExecutor(scheduler, asyncio.get_running_loop())
        _EXECUTORS[scheduler] = executor
    return executor


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


class DecoupledStream(ResponseStream):
    """The responses of one decoupled request, as its model sends them.

    Args:
        admission: The admitted request.
        job: Its executor job.
    """

    def __init__(self, admission: Admission, job: StreamJob) -> None:
        self.admission = admission
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
        admission = self.admission
        job = self.job
        response = InferenceResponse(
            model_name=admission.model,
            model_version=admission.version,
            id=admission.request.id,
            outputs=item.outputs,
            timing=RequestTiming(queue_s=max(0.0, job.started_s - job.admitted_s)),
            rows=job.rows,
        )
        return StreamedResponse(response, item.final, item.error, item.index)

    def cancel(self, reason: str = "cancelled") -> None:
        self._done = True
        self.job.channel.cancel(reason)


class SingleResponseStream(ResponseStream):
    """The one response of a request to a model that is not decoupled, as a stream of one
    final item (an error item when it failed).

    Args:
        future: The scheduler's future of the response.
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
    """A decoupled request whose model has an admission step: the step runs (on the
    admission pool) when the stream is first read, then the request opens as any other.
    A refusal at either point is raised from the first read.

    Args:
        admission: The admitted request (its step still set).
        step: Awaitable that runs the step and applies its answer.
    """

    def __init__(self, admission: Admission, step: Coroutine[Any, Any, None]) -> None:
        self.admission = admission
        self._step: Coroutine[Any, Any, None] | None = step
        self._inner: DecoupledStream | None = None
        self._done = False

    async def __anext__(self) -> StreamedResponse:
        if self._done:
            raise StopAsyncIteration
        if self._inner is None:
            step, self._step = self._step, None
            assert step is not None
            await step
            self._inner = open_stream(self.admission)
        return await self._inner.__anext__()

    def cancel(self, reason: str = "cancelled") -> None:
        self._done = True
        if self._step is not None:
            self._step.close()  # never started: nothing to count
            self._step = None
        if self._inner is not None:
            self._inner.cancel(reason)


def single_stream(
    admission: Admission, future: asyncio.Future[InferenceResponse]
) -> ResponseStream:
    """The stream of a request to a model that is not decoupled (its one response)."""
    return SingleResponseStream(future)


def open_stream(admission: Admission) -> DecoupledStream:
    """Run an admitted decoupled request; its responses come from the returned stream.

    Raises:
        GpuserveError: refused at the queue (full: 429; unloading: 503). Counted.
    """
    executor = executor_for(admission.scheduler)
    job = executor.open(admission.request, admission.rows)
    return DecoupledStream(admission, job)


def decoupled_refusal(admission: Admission, count: str) -> InvalidInputError:
    """The 400 of a unary call to a decoupled model that did not send exactly one response."""
    return InvalidInputError(
        f"model '{admission.model}' uses the decoupled transaction policy "
        f"(model_transaction_policy.decoupled) and sent {count} to this request; "
        "a unary call takes exactly one: read its responses as a stream (gRPC "
        f"ModelStreamInfer, or POST /v2/models/{admission.model}/generate_stream)"
    )


async def single_response(admission: Admission) -> InferenceResponse:
    """The one response of a decoupled request (unary front ends).

    Raises:
        GpuserveError: refused at the queue; the model's error; 400 when it sent no
            response or more than one.
    """
    return await collect_single(admission, open_stream(admission))


async def collect_single(admission: Admission, stream: ResponseStream) -> InferenceResponse:
    """The one response of an opened decoupled ``stream`` (see :func:`single_response`)."""
    first: InferenceResponse | None = None
    try:
        async for item in stream:
            if item.error is not None:
                raise item.error
            if item.response is None:
                continue
            if first is not None:
                stream.cancel("invalid")
                raise decoupled_refusal(admission, "more than one response")
            first = item.response
    finally:
        stream.cancel()  # a no-op after the final item
    if first is None:
        raise decoupled_refusal(admission, "no response")
    return first
