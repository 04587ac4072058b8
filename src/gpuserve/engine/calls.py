"""Business-logic scripting: a model calls another model of the repository in-process.

A Python model runs on its instance's thread; the model it calls is served by a scheduler on
the server's event loop. :class:`InProcessCaller` (injected into the model's
:class:`~gpuserve.backends.base.LoadContext` as ``context.caller``, used through
``context.infer(...)`` and Triton's ``pb_utils.InferenceRequest(...).exec()``) hops onto the
loop with ``run_coroutine_threadsafe``, submits the request to the callee's own runner, the
way a client's request enters it (its admission step first; it batches with the callee's
other traffic) and waits for its answer, never forever:

* a call from the event-loop thread itself is refused at once (waiting would block the loop
  that must answer it);
* a model calling itself from its own instance is refused at once (its instance is the one
  busy waiting);
* every other wait is bounded by a timeout (``timeout_s``, default :data:`DEFAULT_TIMEOUT_S`):
  a cycle of models calling each other, or a callee that is overloaded, fails the call with a
  503 naming both models instead of hanging the instance; the late request is taken out of the
  callee's queue;
* a call made while serving a request that is itself a call passes that request's deadline
  on (its callee's request is awaited no longer), and is refused at once once the deadline
  has passed (:mod:`~gpuserve.backends.call_scope`): a timed-out hop of a cycle does not
  leave the next hop running, calling on, after its caller has given up.

:meth:`InProcessCaller.stream` reads a call's responses as the callee produces them (every
response of a decoupled model, the one response of any other: a :class:`CallStream`), for
Triton's ``exec(decoupled=True)``; each response is awaited up to the timeout.

Inputs are checked against the callee's configuration before queuing (names, datatypes), as the
protocol layer checks a client's; shapes, requested outputs and the rest by the callee's runner,
as for every request (:mod:`gpuserve.engine.checks`: a call gets a client's answer).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gpuserve.backends import call_scope
from gpuserve.config import ModelConfig
from gpuserve.datatypes import numpy_dtype
from gpuserve.engine import tracing
from gpuserve.engine.request import InferenceRequest, InferenceResponse, end_trace_with
from gpuserve.engine.runners.base import StreamedResponse, VersionRunner
from gpuserve.engine.runners.ensemble import StepRouter
from gpuserve.errors import InvalidInputError, RequestTimeoutError

#: Longest a call waits for its answer by default, seconds.
DEFAULT_TIMEOUT_S = 30.0


def check_call_inputs(config: ModelConfig, inputs: Mapping[str, np.ndarray]) -> None:
    """Check a call's inputs against the callee's declared inputs.

    The shapes are the runner's to check, as for every request
    (:func:`gpuserve.engine.checks.check_request`: one message whatever the caller).

    Raises:
        InvalidInputError: an unknown input, a required one missing, not a numpy array or
            another datatype; the message names the input and what is expected.
    """
    name = config.name
    declared = {t.name: t for t in config.inputs}
    unknown = sorted(set(inputs) - set(declared))
    if unknown:
        raise InvalidInputError(
            f"model '{name}' has no input(s) {unknown} (inputs: {sorted(declared)})"
        )
    missing = [n for n, t in declared.items() if not t.optional and n not in inputs]
    if missing:
        raise InvalidInputError(f"model '{name}': required input(s) {missing} not given")
    for key, array in inputs.items():
        spec = declared[key]
        if not isinstance(array, np.ndarray):
            raise InvalidInputError(
                f"model '{name}' input '{key}': expected a numpy array, got {type(array).__name__}"
            )
        expected = numpy_dtype(spec.datatype)
        if array.dtype != expected and not (spec.datatype == "BYTES" and array.dtype.kind in "OSU"):
            raise InvalidInputError(
                f"model '{name}' input '{key}': dtype {array.dtype}, expected {spec.datatype} "
                f"({expected})"
            )


class InProcessCaller:
    """Calls models of the repository from a model's instance thread (module docstring).

    Args:
        router: Reaches the callee's scheduler (the model manager).
        loop: The server's event loop.
        caller: The calling model's name (a call to itself is refused).
    """

    def __init__(self, router: StepRouter, loop: asyncio.AbstractEventLoop, caller: str) -> None:
        self.router = router
        self.loop = loop
        self.caller = caller

    def submit(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        version: str | None = None,
        outputs: Sequence[str] | None = None,
        request_id: str | None = None,
        parameters: Mapping[str, Any] | None = None,
        awaited_until: float | None = None,
    ) -> concurrent.futures.Future[InferenceResponse]:
        """Queue a call and return its (thread-safe) future at once.

        ``awaited_until``: monotonic time (s) after which the caller stops waiting (the
        request's own calls wait no longer), None for no bound.

        Raises:
            InvalidInputError: called from the event loop's thread, or the model calls itself.
        """
        request = self._request(
            model, inputs, version, outputs, request_id, parameters, awaited_until
        )
        future = asyncio.run_coroutine_threadsafe(self._run(request), self.loop)
        if request.trace is not None:
            end_trace_with(request.trace, future)
        return future

    def _request(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        version: str | None,
        outputs: Sequence[str] | None,
        request_id: str | None,
        parameters: Mapping[str, Any] | None,
        awaited_until: float | None,
    ) -> InferenceRequest:
        """The request of one call, refused at once where waiting for it would deadlock.

        Raises:
            InvalidInputError: called from the event loop's thread, or the model calls itself.
        """
        if model == self.caller:
            raise InvalidInputError(
                f"model '{model}' calls itself: its instance would wait on itself (deadlock)"
            )
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            raise InvalidInputError(
                f"model '{self.caller}' called model '{model}' on the server's event loop "
                "thread; call from the model's execute/forward (an instance thread)"
            )
        request = InferenceRequest(
            model_name=model,
            model_version=version,
            inputs=dict(inputs),
            requested_outputs=list(outputs) if outputs is not None else None,
            id=request_id,
            parameters=dict(parameters or {}),
            awaited_until=awaited_until,
        )
        parent = tracing.current_request_trace()  # a traced request's batch is running here
        if parent is not None:
            request.trace = parent.child(model, version, "bls")
        return request

    async def _runner(self, request: InferenceRequest) -> VersionRunner:
        name = request.model_name
        if self.router.cold(name):
            await self.router.ensure_loaded(name)
        runner = self.router.runner(name, request.model_version)
        check_call_inputs(runner.config, request.inputs)
        return runner

    async def _run(self, request: InferenceRequest) -> InferenceResponse:
        runner = await self._runner(request)
        # the callee's runner, as a client's request: the checks every path gets (requested
        # outputs, shapes: engine/checks.py), its admission step (token counts, the UTF-8
        # check, truncation), its queue, its output checks
        return await runner.infer(request)

    async def _run_stream(self, request: InferenceRequest, items: queue.SimpleQueue[Any]) -> None:
        """Hand each response of ``request``'s stream to the calling thread as it comes;
        cancelled (the caller stopped reading), the stream is cancelled: the model sees it."""
        runner = await self._runner(request)
        stream = runner.stream(request)
        try:
            async for item in stream:
                items.put(item)
                if item.final:
                    return
        finally:
            stream.cancel()  # a no-op after the final item

    def timeout_error(self, model: str, timeout_s: float) -> RequestTimeoutError:
        """The error of a call to ``model`` that got no answer in ``timeout_s`` seconds."""
        return RequestTimeoutError(
            f"model '{self.caller}' calling model '{model}': no answer within {timeout_s} s "
            "(a cycle of models calling each other deadlocks their instances; or the callee "
            "is overloaded)"
        )

    def _awaited_until(self, model: str) -> float | None:
        """Until when the request being served is awaited, when it is itself a call (None:
        it is not).

        Raises:
            RequestTimeoutError: that time has passed.
        """
        until = call_scope.awaited_until()
        if until is not None and until <= time.monotonic():
            raise RequestTimeoutError(
                f"model '{self.caller}' calling model '{model}': the request being "
                "served is no longer awaited (its own caller's timeout has passed)"
            )
        return until

    def __call__(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        version: str | None = None,
        outputs: Sequence[str] | None = None,
        timeout_s: float | None = None,
        request_id: str | None = None,
        parameters: Mapping[str, Any] | None = None,
    ) -> InferenceResponse:
        """Call ``model`` and wait (blocking this thread) for its response.

        Args:
            model: The callee's name.
            inputs: Input name -> numpy array (batch dimension first when it batches).
            version: The callee's version, None for its default one.
            outputs: Outputs to return, None for all.
            timeout_s: Longest wait, seconds (default :data:`DEFAULT_TIMEOUT_S`).
            request_id: An id for its logs and response.
            parameters: Request parameters (``sequence_id``, ``sequence_start``,
                ``sequence_end`` route a call to a sequence model), None for none.

        Raises:
            GpuserveError: what the callee's request failed with (InvalidInputError,
                ModelNotFoundError, ModelNotReadyError, OverloadedError, BackendError...), or
                RequestTimeoutError after ``timeout_s``.
        """
        limit = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        awaited = time.monotonic() + limit
        until = self._awaited_until(model)
        if until is not None:
            # the callee's request is awaited no longer than the one it serves, so a chain
            # of calls never outlives its first caller's patience
            awaited = min(awaited, until)
        future = self.submit(
            model,
            inputs,
            version=version,
            outputs=outputs,
            request_id=request_id,
            parameters=parameters,
            awaited_until=awaited,
        )
        try:
            return future.result(limit)
        except concurrent.futures.TimeoutError:
            future.cancel()  # cancels the task: the request leaves the callee's queue
            raise self.timeout_error(model, limit) from None

    def stream(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        version: str | None = None,
        outputs: Sequence[str] | None = None,
        timeout_s: float | None = None,
        request_id: str | None = None,
        parameters: Mapping[str, Any] | None = None,
    ) -> CallStream:
        """Call ``model`` and read its responses as it produces them: every response of a
        decoupled model (the last one ``final``; an empty final when the model ends its
        stream without a response), the one response of any other model. Returns at once.

        Args:
            model, inputs, version, outputs, request_id, parameters: As for a call
                (:meth:`__call__`).
            timeout_s: Longest wait for each response, seconds (default
                :data:`DEFAULT_TIMEOUT_S`): a stream that keeps producing may run longer in
                all. The deadline of the request being served, when it is itself a call,
                bounds the whole stream.

        Raises:
            InvalidInputError: called from the event loop's thread, or the model calls itself.
            RequestTimeoutError: the request being served is no longer awaited.
        """
        limit = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        until = self._awaited_until(model)
        request = self._request(model, inputs, version, outputs, request_id, parameters, until)
        items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        future = asyncio.run_coroutine_threadsafe(self._run_stream(request, items), self.loop)
        future.add_done_callback(lambda _: items.put(_END))
        if request.trace is not None:
            end_trace_with(request.trace, future)
        return CallStream(self, model, items, future, limit, until)


#: Put after a stream's last item, once the call is over (its error, if any, is the future's).
_END = object()


class CallStream:
    """The responses of one call, read by the calling thread as they come
    (``for item in stream``): :class:`~gpuserve.engine.runners.base.StreamedResponse` items,
    the last one ``final``; an item with ``error`` set is yielded, not raised.

    Iteration raises what refused the call (an unknown model, bad inputs, ...) and
    :class:`~gpuserve.errors.RequestTimeoutError` when a response does not come within the
    timeout (the stream is cancelled then). :meth:`cancel` (or leaving the loop and dropping
    the stream: see :meth:`close`) stops it: the model sees the cancellation.
    """

    def __init__(
        self,
        caller: InProcessCaller,
        model: str,
        items: queue.SimpleQueue[Any],
        future: concurrent.futures.Future[None],
        timeout_s: float,
        until: float | None,
    ) -> None:
        self._caller = caller
        self._model = model
        self._items = items
        self._future = future
        self._timeout_s = timeout_s
        self._until = until
        self._done = False

    @property
    def awaited_until(self) -> float | None:
        """Monotonic time (s) after which nobody awaits the stream (None: no bound)."""
        return self._until

    def __iter__(self) -> CallStream:
        return self

    def __next__(self) -> StreamedResponse:
        if self._done:
            raise StopIteration
        wait_s = self._timeout_s
        if self._until is not None:
            wait_s = min(wait_s, self._until - time.monotonic())
        try:
            item = self._items.get(timeout=max(0.0, wait_s))
        except queue.Empty:
            self.cancel()
            raise self._caller.timeout_error(self._model, self._timeout_s) from None
        if item is _END:
            self._done = True
            error = None if self._future.cancelled() else self._future.exception()
            if error is not None:
                raise error
            raise StopIteration
        assert isinstance(item, StreamedResponse)
        if item.final:
            self._done = True
        return item

    def cancel(self) -> None:
        """Stop reading: the call's stream is cancelled (its model sees it at its next
        response); iteration ends."""
        self._done = True
        self._future.cancel()

    def close(self) -> None:
        """As :meth:`cancel` while the call runs (nothing once it is over)."""
        self._done = True
        if not self._future.done():
            self._future.cancel()

    def __del__(self) -> None:
        # a caller that leaves its loop early and drops the stream stops the model's stream
        if not self._done and not self._future.done():
            self._future.cancel()


__all__ = ["DEFAULT_TIMEOUT_S", "CallStream", "InProcessCaller", "check_call_inputs"]
