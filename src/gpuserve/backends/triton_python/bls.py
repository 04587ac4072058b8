"""Business logic scripting for Triton Python models: ``InferenceRequest.exec()`` and
``await InferenceRequest.async_exec()``.

A ``TritonPythonModel`` builds ``pb_utils.InferenceRequest(model_name=..., inputs=[...],
requested_output_names=[...])`` in its ``execute`` and runs it on another model of the
repository; the answer is a ``pb_utils.InferenceResponse`` whose ``has_error()``/``error()``
report a failure (the call never raises for the callee's errors, as in Triton), and whose
``output_tensors()`` hold the outputs. The call goes through the model's in-process caller
(:class:`~gpuserve.engine.calls.InProcessCaller`, ``LoadContext.caller``), which the runner
installs for its thread while ``execute`` runs (:func:`installed`); it is submitted to the
callee's own scheduler and waits at most the request's ``timeout`` (microseconds, Triton's
unit; default 30 s), so a cycle of models calling each other fails instead of hanging.

Sequences: ``InferenceRequest(..., correlation_id=id, flags=...)`` calls a sequence model as a
client's ``sequence_id`` would: the id (a non-zero ``int`` or a non-empty ``str``) becomes the
call's ``sequence_id`` parameter, ``TRITONSERVER_REQUEST_FLAG_SEQUENCE_START`` / ``_END`` in
``flags`` its ``sequence_start`` / ``sequence_end``, so the callee's sequence batcher routes it
to the sequence's slot (its state carries across calls of one id) and the callee's
``request.correlation_id()`` is that id. The request's ``parameters`` (a dict or a JSON
object string) go with the call too.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
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

_local = threading.local()

_CODES: dict[type[GpuserveError], int] = {
    InvalidInputError: pb_utils.TritonError.INVALID_ARG,
    ModelNotFoundError: pb_utils.TritonError.NOT_FOUND,
    ModelNotReadyError: pb_utils.TritonError.UNAVAILABLE,
    OverloadedError: pb_utils.TritonError.UNAVAILABLE,
    RequestTimeoutError: pb_utils.TritonError.UNAVAILABLE,
    UnavailableError: pb_utils.TritonError.UNAVAILABLE,
    CancelledRequestError: pb_utils.TritonError.CANCELLED,
}


@contextmanager
def installed(caller: Any) -> Iterator[None]:
    """Make ``caller`` the one ``exec`` uses on this thread while the block runs."""
    previous = getattr(_local, "caller", None)
    _local.caller = caller
    try:
        yield
    finally:
        _local.caller = previous


def _current() -> Any:
    return getattr(_local, "caller", None)


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


def run(request: pb_utils.InferenceRequest, caller: Any, decoupled: bool = False) -> Any:
    """Run ``request`` through ``caller`` and wrap the answer as an ``InferenceResponse``."""
    if caller is None:
        return _error(
            "InferenceRequest.exec: no model caller here (call it from execute of a model "
            "served by gpuserve)",
            pb_utils.TritonError.UNAVAILABLE,
        )
    if decoupled:
        return _error(
            "InferenceRequest.exec(decoupled=True) is not supported by gpuserve",
            pb_utils.TritonError.UNSUPPORTED,
        )
    options = getattr(request, "_options", {})
    version = int(options.get("model_version", -1))
    timeout_us = int(options.get("timeout", 0) or 0)
    try:
        parameters = call_parameters(request)
        response = caller(
            request.model_name(),
            {t.name(): t.as_numpy() for t in request.inputs()},
            version=None if version < 0 else str(version),
            outputs=request.requested_output_names() or None,
            timeout_s=timeout_us / 1e6 if timeout_us > 0 else None,
            request_id=request.request_id() or None,
            **({"parameters": parameters} if parameters else {}),
        )
    except GpuserveError as err:
        code = _CODES.get(type(err), pb_utils.TritonError.INTERNAL)
        return _error(err.message, code)
    except Exception as err:  # exec reports failures in the response, never raises
        return _error(f"{type(err).__name__}: {err}", pb_utils.TritonError.INTERNAL)
    return pb_utils.InferenceResponse(
        [pb_utils.Tensor(name, array) for name, array in response.outputs.items()]
    )


def exec_request(request: pb_utils.InferenceRequest, decoupled: bool = False) -> Any:
    """``request.exec()``: blocks this thread until the callee answers (or the timeout)."""
    return run(request, _current(), decoupled)


async def async_exec_request(request: pb_utils.InferenceRequest, decoupled: bool = False) -> Any:
    """``await request.async_exec()``: as :func:`exec_request`, on a worker thread, so that
    several calls of one ``async def execute`` run at once (``asyncio.gather``)."""
    caller = _current()
    loop = asyncio.get_running_loop()
    until = call_scope.awaited_until()  # the worker thread serves the same batch
    return await loop.run_in_executor(
        None, call_scope.within, until, run, request, caller, decoupled
    )
