"""Business logic scripting for Triton Python models: ``InferenceRequest.exec()`` and
``await InferenceRequest.async_exec()``.

A ``TritonPythonModel`` builds ``pb_utils.InferenceRequest(model_name=..., inputs=[...],
requested_output_names=[...])`` in its ``execute`` and runs it on another model of the
repository; the answer is a ``pb_utils.InferenceResponse`` whose ``has_error()``/``error()``
report a failure (the call never raises for the callee's errors, as in Triton), and whose
``output_tensors()`` hold the outputs. The call goes through the model's in-process caller
(:class:`~gpuserve.engine.calls.InProcessCaller`, ``LoadContext.caller``), which the runner
sets in its thread's call scope while ``execute`` runs
(:func:`gpuserve.backends.call_scope.with_caller`); it is submitted to the
callee's own scheduler and waits at most the request's ``timeout`` (microseconds, Triton's
unit; default 30 s), so a cycle of models calling each other fails instead of hanging.

Sequences: ``InferenceRequest(..., correlation_id=id, flags=...)`` calls a sequence model as a
client's ``sequence_id`` would: the id (a non-zero ``int`` or a non-empty ``str``) becomes the
call's ``sequence_id`` parameter, ``TRITONSERVER_REQUEST_FLAG_SEQUENCE_START`` / ``_END`` in
``flags`` its ``sequence_start`` / ``sequence_end``, so the callee's sequence batcher routes it
to the sequence's slot (its state carries across calls of one id) and the callee's
``request.correlation_id()`` and ``request.flags()`` are those. The request's ``parameters``
(a dict or a JSON object string) go with the call too.

Decoupled calls: ``exec(decoupled=True)`` and ``await async_exec(decoupled=True)`` return a
:class:`ResponseIterator` at once, and the callee's responses come from it as it produces them
(a decoupled model's every response, then an empty one when it sends the final flag alone;
any other model's one response). Each response is awaited up to the request's ``timeout``
(default 30 s). The callee's stream runs on its own runner as a client's V2 stream does, so a
generative model called with the ``stream`` input true answers once per step.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from gpuserve.backends import call_scope
from gpuserve.backends.triton_python import utils as pb_utils
from gpuserve.errors import (
    CancelledRequestError,
    GpuserveError,
    InvalidInputError,
    ModelNotFoundError,
    ModelNotReadyError,
    OverloadedError,
    RequestTimeoutError,
    UnavailableError,
)

_CODES: dict[type[GpuserveError], int] = {
    InvalidInputError: pb_utils.TritonError.INVALID_ARG,
    ModelNotFoundError: pb_utils.TritonError.NOT_FOUND,
    ModelNotReadyError: pb_utils.TritonError.UNAVAILABLE,
    OverloadedError: pb_utils.TritonError.UNAVAILABLE,
    RequestTimeoutError: pb_utils.TritonError.UNAVAILABLE,
    UnavailableError: pb_utils.TritonError.UNAVAILABLE,
    CancelledRequestError: pb_utils.TritonError.CANCELLED,
}


def _error(message: str, code: int) -> pb_utils.InferenceResponse:
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def call_parameters(request: pb_utils.InferenceRequest) -> dict[str, Any]:
    """The parameters a BLS call carries: the request's own, plus ``sequence_id`` from its
    correlation id and ``sequence_start`` / ``sequence_end`` from its flags (module
    docstring).

    Raises:
        InvalidInputError: ``parameters`` is not a JSON object, or ``correlation_id`` is
            neither an ``int`` nor a ``str``.
    """
    raw = request.parameters()
    try:
        parameters = json.loads(raw) if raw else {}
    except ValueError:
        parameters = None
    if not isinstance(parameters, dict):
        raise InvalidInputError(
            f"InferenceRequest parameters: expected a dict or a JSON object, got {raw!r}"
        )
    correlation_id = request.correlation_id()
    if isinstance(correlation_id, bool) or not isinstance(correlation_id, (int, str)):
        raise InvalidInputError(
            "InferenceRequest correlation_id: expected an int or a str, got "
            f"{type(correlation_id).__name__}"
        )
    if correlation_id:  # 0 and "" name no sequence
        parameters["sequence_id"] = correlation_id
    flags = request.flags()
    if flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
        parameters["sequence_start"] = True
    if flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END:
        parameters["sequence_end"] = True
    return parameters


def _call_arguments(request: pb_utils.InferenceRequest) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The caller's arguments for ``request`` (model, inputs; version, outputs, timeout,
    id, parameters).

    Raises:
        InvalidInputError: as :func:`call_parameters`.
    """
    options = getattr(request, "_options", {})
    version = int(options.get("model_version", -1))
    timeout_us = int(options.get("timeout", 0) or 0)
    parameters = call_parameters(request)
    keywords: dict[str, Any] = {
        "version": None if version < 0 else str(version),
        "outputs": request.requested_output_names() or None,
        "timeout_s": timeout_us / 1e6 if timeout_us > 0 else None,
        "request_id": request.request_id() or None,
    }
    if parameters:
        keywords["parameters"] = parameters
    return (request.model_name(), {t.name(): t.as_numpy() for t in request.inputs()}), keywords


def _failed(err: Exception) -> pb_utils.InferenceResponse:
    """The error response of a call that failed with ``err`` (exec never raises)."""
    if isinstance(err, GpuserveError):
        return _error(err.message, _CODES.get(type(err), pb_utils.TritonError.INTERNAL))
    return _error(f"{type(err).__name__}: {err}", pb_utils.TritonError.INTERNAL)


_NO_CALLER = (
    "InferenceRequest.exec: no model caller here (call it from execute of a model served by "
    "gpuserve)"
)


def run(request: pb_utils.InferenceRequest, caller: Any) -> pb_utils.InferenceResponse:
    """Run ``request`` through ``caller`` and wrap the answer as an ``InferenceResponse``."""
    if caller is None:
        return _error(_NO_CALLER, pb_utils.TritonError.UNAVAILABLE)
    try:
        args, keywords = _call_arguments(request)
        response = caller(*args, **keywords)
    except Exception as err:  # exec reports failures in the response, never raises
        return _failed(err)
    return pb_utils.InferenceResponse(
        [pb_utils.Tensor(name, array) for name, array in response.outputs.items()]
    )


class ResponseIterator:
    """The responses of a call made with ``decoupled=True``, as the callee produces them.

    What ``exec(decoupled=True)`` returns, and ``await async_exec(decoupled=True)``. Read it
    as Triton's Python backend documents, ``for response in responses`` (each ``next`` waits
    for the callee's next response), or ``async for response in responses`` (the wait runs
    on a worker thread, so other coroutines of an ``async def execute`` go on meanwhile).

    * a decoupled callee: one ``InferenceResponse`` per response it sends, in order; when it
      sends the final flag alone, the last one is empty (no output tensors), as in Triton;
    * any other callee: its one response;
    * a failure (an unknown model, bad inputs, the callee's error, no response within the
      timeout) is an error response (``has_error()``), and the last one.

    :meth:`cancel` stops the callee's stream: its sender's ``is_cancelled()`` turns True,
    and the iteration ends.
    """

    def __init__(self, stream: Any = None, failure: pb_utils.InferenceResponse | None = None):
        self._stream = stream  # gpuserve.engine.calls.CallStream
        self._failure = failure
        self._done = False

    def __iter__(self) -> ResponseIterator:
        return self

    def __next__(self) -> pb_utils.InferenceResponse:
        response = self._next()
        if response is None:
            raise StopIteration
        return response

    def __aiter__(self) -> ResponseIterator:
        return self

    async def __anext__(self) -> pb_utils.InferenceResponse:
        loop = asyncio.get_running_loop()
        scope = call_scope.Scope.awaited(getattr(self._stream, "awaited_until", None))
        response = await loop.run_in_executor(None, call_scope.within, scope, self._next)
        if response is None:
            raise StopAsyncIteration
        return response

    def cancel(self) -> None:
        """Stop the callee's stream (it sees the cancellation); the iteration ends."""
        self._done = True
        if self._stream is not None:
            self._stream.cancel()

    def _next(self) -> pb_utils.InferenceResponse | None:
        """The next response, or None after the last."""
        if self._done:
            return None
        if self._failure is not None or self._stream is None:
            self._done = True
            return self._failure
        try:
            item = next(self._stream)
        except StopIteration:
            self._done = True
            return None
        except Exception as err:
            self._done = True
            return _failed(err)
        if item.final:
            self._done = True
        if item.error is not None:
            self._done = True
            self._stream.cancel()
            return _failed(item.error)
        if item.response is None:  # the final flag alone
            return pb_utils.InferenceResponse([])
        return pb_utils.InferenceResponse(
            [pb_utils.Tensor(name, array) for name, array in item.response.outputs.items()]
        )


def run_decoupled(request: pb_utils.InferenceRequest, caller: Any) -> ResponseIterator:
    """Start ``request`` through ``caller`` and return its responses as they come
    (:class:`ResponseIterator`); nothing here waits for the callee."""
    if caller is None:
        return ResponseIterator(failure=_error(_NO_CALLER, pb_utils.TritonError.UNAVAILABLE))
    try:
        args, keywords = _call_arguments(request)
        stream = caller.stream(*args, **keywords)
    except Exception as err:
        return ResponseIterator(failure=_failed(err))
    return ResponseIterator(stream)


def exec_request(
    request: pb_utils.InferenceRequest, decoupled: bool = False
) -> pb_utils.InferenceResponse | ResponseIterator:
    """``request.exec()``: blocks this thread until the callee answers (or the timeout);
    with ``decoupled``, returns at once the iterator of its responses."""
    if decoupled:
        return run_decoupled(request, call_scope.caller())
    return run(request, call_scope.caller())


async def async_exec_request(
    request: pb_utils.InferenceRequest, decoupled: bool = False
) -> pb_utils.InferenceResponse | ResponseIterator:
    """``await request.async_exec()``: as :func:`exec_request`, on a worker thread, so that
    several calls of one ``async def execute`` run at once (``asyncio.gather``); with
    ``decoupled``, the iterator of its responses (starting the call does not wait)."""
    caller = call_scope.caller()
    if decoupled:
        return run_decoupled(request, caller)
    loop = asyncio.get_running_loop()
    scope = call_scope.current()  # the worker thread serves the same batch
    return await loop.run_in_executor(None, call_scope.within, scope, run, request, caller)
