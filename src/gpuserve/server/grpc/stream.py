"""``ModelStreamInfer``: a bidirectional stream of requests and responses, decoupled models
included.

The requests of one stream run concurrently: each is handed to the service as it arrives (so
plain requests batch with each other and with other traffic) and its responses are written
as they are ready, carrying the request's id.

* A model that is not decoupled answers each request with one response.
* A decoupled model (``model_transaction_policy.decoupled``) answers with each response as
  the model produces it, in order. As in Triton, every response carries the parameter
  ``triton_final_response`` (bool): True on the request's last. When the model ends the
  stream without a last response (an empty final), a response with no outputs and
  ``triton_final_response: true`` is sent only if the request asked for it with
  ``triton_enable_empty_final_response: true``.
* A failed request (or a failed response of a decoupled model) gets a response whose
  ``error_message`` says why; the stream goes on.
* Back-pressure: responses wait in a bounded queue for the client to read them; when it is
  full the requests' streams stop pulling from their models, whose own bounded buffers then
  make the model's ``yield``/``send`` wait. When the client cancels or goes away, grpc.aio
  cancels the handler and every request's stream is cancelled: requests still queued leave
  the queue at once and never run, a decoupled model stops at its next response, and each is
  counted cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from gpuserve.errors import GpuserveError, InvalidInputError
from gpuserve.protocol.grpc_codec import GrpcInferMessage
from gpuserve.protocol.protos import grpc_service_pb2 as pb
from gpuserve.server.grpc.access import grpc_traceparent, log_call
from gpuserve.server.status import grpc_code

if TYPE_CHECKING:
    from gpuserve.server.grpc.service import InferenceServicer, MalformedRequest
    from gpuserve.service.inference import Admission

logger = logging.getLogger(__name__)

#: Responses of one call waiting for the client to read them.
RESPONSE_QUEUE = 16

#: Request parameter: send an empty final response when a decoupled model ends without one.
EMPTY_FINAL = "triton_enable_empty_final_response"
#: Response parameter: the request's last response.
FINAL = "triton_final_response"


def empty_final_wanted(request: pb.ModelInferRequest) -> bool:
    """Whether ``request`` asks for an empty final response.

    Raises:
        InvalidInputError: the parameter is not a ``bool_param``.
    """
    if EMPTY_FINAL not in request.parameters:
        return False
    value = request.parameters[EMPTY_FINAL]
    if value.WhichOneof("parameter_choice") != "bool_param":
        raise InvalidInputError(
            f"invalid value type for '{EMPTY_FINAL}' parameter, expected bool_param"
        )
    return bool(value.bool_param)


def _marked(message: pb.ModelInferResponse, final: bool) -> pb.ModelStreamInferResponse:
    message.parameters[FINAL].bool_param = final
    return pb.ModelStreamInferResponse(infer_response=message)


def stream_error(
    request: pb.ModelInferRequest, message: str, final: bool | None = None
) -> pb.ModelStreamInferResponse:
    """The stream response of a failed request (``final``: mark it, None: no mark)."""
    response = pb.ModelInferResponse(
        model_name=request.model_name, model_version=request.model_version, id=request.id
    )
    if final is not None:
        response.parameters[FINAL].bool_param = final
    return pb.ModelStreamInferResponse(error_message=message, infer_response=response)


async def stream_infer(
    servicer: InferenceServicer,
    request_iterator: AsyncIterator[pb.ModelInferRequest | MalformedRequest],
    context: grpc.aio.ServicerContext,
) -> AsyncIterator[pb.ModelStreamInferResponse]:
    """The ``ModelStreamInfer`` handler of ``servicer`` (see the module docstring)."""
    from gpuserve.server.grpc.service import MalformedRequest

    results: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue(RESPONSE_QUEUE)
    running: set[asyncio.Task[None]] = set()
    service = servicer.service

    async def run(request: pb.ModelInferRequest | MalformedRequest) -> None:
        started = time.monotonic()
        code = "OK"
        last: pb.ModelInferResponse | None = None
        if isinstance(request, MalformedRequest):
            if servicer.access_log:
                log_call(context.peer(), "ModelStreamInfer", "INVALID_ARGUMENT", None, None, 0)
            await results.put(stream_error(pb.ModelInferRequest(), request.error.message))
            return
        try:
            wire = GrpcInferMessage(request, servicer.limits, service.extensions.shared_memory)
            traceparent = grpc_traceparent(context) if service.tracing else None
            admission = await service.admit_loaded(
                request.model_name,
                request.model_version or None,
                wire,
                context.cancelled,
                traceparent,
            )
            code, last = await _streamed(request, wire, admission, code)
        except GpuserveError as err:
            code = grpc_code(err)
            await results.put(stream_error(request, servicer.redactor.text(err.message)))
        except Exception:  # a bug: log it, never leak it
            code = "INTERNAL"
            logger.exception("unhandled error serving a ModelStreamInfer request")
            await results.put(stream_error(request, "internal server error"))
        if servicer.access_log:
            total_s = time.monotonic() - started
            log_call(context.peer(), "ModelStreamInfer", code, request, last, total_s)

    async def _streamed(
        request: pb.ModelInferRequest, wire: GrpcInferMessage, admission: Admission, code: str
    ) -> tuple[str, pb.ModelInferResponse | None]:
        # One way for every model: a model that is not decoupled streams its one response
        # (final); its error goes back unmarked, as Triton sends it.
        decoupled = admission.runner.decoupled
        empty_final = decoupled and empty_final_wanted(request)
        stream = service.stream(admission)
        last: pb.ModelInferResponse | None = None
        try:
            async for item in stream:
                if item.error is not None:
                    code = grpc_code(item.error)
                    text = servicer.redactor.text(item.error.message)
                    final = item.final if decoupled else None
                    await results.put(stream_error(request, text, final))
                elif item.response is not None:
                    last = servicer.encode(wire, admission, item.response)
                    await results.put(_marked(last, item.final))
                elif empty_final:
                    empty = pb.ModelInferResponse(
                        model_name=request.model_name,
                        model_version=request.model_version,
                        id=request.id,
                    )
                    await results.put(_marked(empty, True))
        finally:
            stream.cancel()  # the client went away (a no-op after the final response)
        return code, last

    async def read() -> None:
        try:
            async for request in request_iterator:
                task = asyncio.create_task(run(request))
                running.add(task)
                task.add_done_callback(running.discard)
            if running:
                await asyncio.wait(set(running))
        finally:
            await results.put(None)

    reader = asyncio.create_task(read())
    try:
        while (item := await results.get()) is not None:
            yield item
        await reader  # re-raises a failure of the request stream itself
    finally:
        for task in (reader, *running):
            task.cancel()
