"""KServe V2 ``inference.GRPCInferenceService`` on grpc.aio: an adapter on the inference service.

Every call answers from the same :class:`~gpuserve.service.inference.InferenceService` call as
the matching HTTP endpoint, so both carry the same content and error messages; errors map to
gRPC status codes through the one table in :mod:`gpuserve.server.status`. No stack trace ever
reaches a client.

* ``ModelInfer`` returns every output in ``raw_output_contents``, and the request's timing in
  trailing metadata (``x-queue-time-us``, ``x-compute-time-us``, ``x-total-time-us``; see
  :mod:`gpuserve.server.timing`). A queue-full refusal (RESOURCE_EXHAUSTED) carries
  ``retry-after`` (seconds) in its trailing metadata.
* When a client cancels a call, or its deadline passes, while the request is queued, grpc.aio
  cancels the handler; the scheduler then takes the request out of its queue, so it never
  runs, and counts it as cancelled.
* ``ModelStreamInfer`` runs the requests of one stream concurrently: each is handed to its
  model's scheduler as it arrives (so they batch with each other and with other traffic) and
  its response is written as soon as it is ready, carrying the request's id. A failed request
  gets a response whose ``error_message`` says why; the stream goes on. Decoupled models
  answer with each response as produced, the last marked ``triton_final_response`` (see
  :mod:`gpuserve.server.grpc.stream`).
* ``RepositoryModelLoad`` / ``RepositoryModelUnload`` call the service's typed repository
  commands, as the HTTP front end does: the same checks and behaviour, the management token
  read from the ``authorization`` metadata (UNAUTHENTICATED without it, PERMISSION_DENIED when
  management is disabled).
* Messages leave without file paths outside the repository-relative part, and model names and
  version labels are checked as over HTTP (:mod:`gpuserve.server.security`); the API token is
  checked by :mod:`gpuserve.server.grpc.auth` before a handler runs.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf.message import DecodeError

from gpuserve.config import ServerConfig
from gpuserve.engine.request import InferenceResponse, RequestTiming
from gpuserve.errors import GpuserveError, InvalidInputError
from gpuserve.protocol.grpc_codec import GrpcInferMessage, encode_infer_response
from gpuserve.protocol.limits import RequestLimits
from gpuserve.protocol.protos import grpc_service_pb2 as pb
from gpuserve.protocol.protos import grpc_service_pb2_grpc as pb_grpc
from gpuserve.server.grpc import messages
from gpuserve.server.grpc.access import grpc_traceparent, log_call
from gpuserve.server.grpc.extensions import ExtensionRpcs
from gpuserve.server.grpc.stream import stream_infer
from gpuserve.server.security import Redactor, bearer_token, check_model_name
from gpuserve.server.status import grpc_code
from gpuserve.server.timing import timing_metadata
from gpuserve.service.constants import retry_after_s
from gpuserve.service.inference import Admission, InferenceService

logger = logging.getLogger(__name__)

SERVICE_NAME = "inference.GRPCInferenceService"

Request = TypeVar("Request")
Response = TypeVar("Response")
Handler = Callable[[Any, Request, grpc.aio.ServicerContext], Awaitable[Response]]


class MalformedRequest:
    """What the lenient deserializer gives for bytes that are not a valid request message, so
    the call is answered INVALID_ARGUMENT with the parse error (gRPC itself would answer
    UNKNOWN).

    Attributes:
        error: The InvalidInputError to answer with.
    """

    __slots__ = ("error",)

    def __init__(self, error: InvalidInputError) -> None:
        self.error = error


def lenient_deserializer(message_class: Any) -> Callable[[bytes], Any]:
    """``message_class.FromString``, except that bad bytes give a :class:`MalformedRequest`."""
    name = message_class.DESCRIPTOR.full_name
    parse = message_class.FromString

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as err:
            return MalformedRequest(
                InvalidInputError(f"the request is not a valid {name} message: {err}")
            )

    return deserialize


def handlers(servicer: InferenceServicer) -> dict[str, grpc.RpcMethodHandler]:
    """The method handlers of ``inference.GRPCInferenceService`` for ``servicer`` (as the
    generated ``add_GRPCInferenceServiceServicer_to_server`` makes them, with
    :func:`lenient_deserializer`)."""
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    result: dict[str, grpc.RpcMethodHandler] = {}
    for method in service.methods:
        request_class = getattr(pb, method.input_type.name)
        response_class = getattr(pb, method.output_type.name)
        make = (
            grpc.stream_stream_rpc_method_handler
            if method.client_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        result[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=lenient_deserializer(request_class),
            response_serializer=response_class.SerializeToString,
        )
    return result


def status_code(error: GpuserveError) -> grpc.StatusCode:
    """The gRPC status code of ``error`` (from the table in :mod:`gpuserve.server.status`)."""
    return grpc.StatusCode[grpc_code(error)]


async def abort(
    context: grpc.aio.ServicerContext, error: GpuserveError, redactor: Redactor | None = None
) -> NoReturn:
    """End the call with ``error``'s status code and message (without file paths when a
    ``redactor`` is given)."""
    trailing: tuple[tuple[str, str], ...] = ()
    retry = retry_after_s(error)
    if retry is not None:
        trailing = (("retry-after", str(retry)),)
    message = redactor.text(error.message) if redactor is not None else error.message
    await context.abort(status_code(error), message, trailing_metadata=trailing)
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover


def unary(method: Handler[Request, Response]) -> Handler[Request, Response]:
    """Wrap a unary handler: GpuserveError -> its status, anything else -> INTERNAL (logged);
    one access-log line per call."""

    @functools.wraps(method)
    async def handler(self: Any, request: Request, context: grpc.aio.ServicerContext) -> Response:
        started = time.monotonic()

        def log(code: str, response: Any = None) -> None:
            # before the answer goes out, so the line is written by the time the client has it
            if self.access_log:
                total_s = time.monotonic() - started
                log_call(context.peer(), method.__name__, code, request, response, total_s)

        try:
            if isinstance(request, MalformedRequest):
                raise request.error
            response = await method(self, request, context)
        except GpuserveError as err:
            log(grpc_code(err))
            await abort(context, err, getattr(self, "redactor", None))
        except asyncio.CancelledError:
            log("CANCELLED")
            raise
        except Exception:  # a bug: log it, never leak it
            logger.exception("unhandled error serving gRPC %s", method.__name__)
            log("INTERNAL")
            await context.abort(grpc.StatusCode.INTERNAL, "internal server error")
            raise AssertionError("unreachable") from None  # pragma: no cover
        log("OK", response)
        return response

    return handler


class InferenceServicer(ExtensionRpcs, pb_grpc.GRPCInferenceServiceServicer):
    """The V2 inference service over an :class:`InferenceService`.

    Args:
        service: The inference service (admission, views, repository commands).
        config: Server settings.
    """

    def __init__(self, service: InferenceService, config: ServerConfig) -> None:
        self.service = service
        self.views = service.views
        self.commands = service.repository
        self.config = config
        self.access_log = config.access_log
        self.redactor = Redactor(config.model_repository)
        self.limits = RequestLimits(
            config.max_tensor_elements,
            config.max_bytes_element_bytes,
            config.max_inputs_per_call,
        )

    # -- health and metadata ---------------------------------------------------------------

    @unary
    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: Any
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    @unary
    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: Any
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.views.server_ready())

    @unary
    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: Any
    ) -> pb.ModelReadyResponse:
        view = self.views.model_ready(request.name, request.version or None)
        return pb.ModelReadyResponse(ready=view.ready)

    @unary
    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: Any
    ) -> pb.ServerMetadataResponse:
        return messages.server_metadata(self.views.server_metadata())

    @unary
    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: Any
    ) -> pb.ModelMetadataResponse:
        return messages.model_metadata(
            self.views.model_metadata(request.name, request.version or None)
        )

    @unary
    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: Any
    ) -> pb.ModelConfigResponse:
        view = self.views.model_config(request.name, request.version or None)
        return pb.ModelConfigResponse(config=messages.model_config(view))

    @unary
    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: Any
    ) -> pb.ModelStatisticsResponse:
        stats = self.views.statistics(request.name or None, request.version or None)
        return pb.ModelStatisticsResponse(model_stats=[messages.model_statistics(s) for s in stats])

    @unary
    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: Any
    ) -> pb.RepositoryIndexResponse:
        rows = self.commands.index(request.ready)
        return messages.repository_index(rows, self.redactor)

    @unary
    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryModelLoadResponse:
        config: str | None = None
        files: dict[str, bytes] = {}
        for key, value in request.parameters.items():
            if key == "config":
                if value.WhichOneof("parameter_choice") != "string_param":
                    raise InvalidInputError(
                        "parameter 'config' must be a string_param holding the model "
                        "configuration as JSON"
                    )
                config = value.string_param  # parsed by the load command
            elif key.startswith("file:"):  # checked and written by the load command
                if value.WhichOneof("parameter_choice") != "bytes_param":
                    raise InvalidInputError(
                        f"parameter {key!r} must be a bytes_param holding the file's content"
                    )
                files[key[len("file:") :]] = value.bytes_param
        check_model_name(request.model_name)
        self.commands.authorize_change(_bearer(context))
        await self.commands.load(request.model_name, config, files)
        return pb.RepositoryModelLoadResponse()

    @unary
    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryModelUnloadResponse:
        check_model_name(request.model_name)
        self.commands.authorize_change(_bearer(context))
        await self.commands.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # -- inference -------------------------------------------------------------------------

    async def _infer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> tuple[pb.ModelInferResponse, RequestTiming]:
        """Admit, queue, run and encode one request (errors propagate as GpuserveError).
        The handler task is cancelled when the client goes away (the scheduler then drops
        the queued request); the probe also catches a client gone just before its batch
        forms. A model that loads on demand is loaded first (then admitted without an
        await in between)."""
        wire = GrpcInferMessage(request, self.limits, self.service.extensions.shared_memory)
        traceparent = grpc_traceparent(context) if self.service.tracing else None
        admission = await self.service.admit_loaded(
            request.model_name, request.model_version or None, wire, context.cancelled, traceparent
        )
        response = await self.service.run(admission)
        return self.encode(wire, admission, response), response.timing

    def encode(
        self, wire: GrpcInferMessage, admission: Admission, response: InferenceResponse
    ) -> pb.ModelInferResponse:
        """``response`` as the request's output options ask: top-k labels (Triton's
        classification extension), outputs written to shared-memory regions, or raw."""
        options = wire.output_options
        if options.classification:
            response = self.service.extensions.classify(
                admission.model, admission.config, response, options.classification
            )
        return encode_infer_response(response, admission.config, options)

    @unary
    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse:
        started = time.monotonic()
        message, timing = await self._infer(request, context)
        context.set_trailing_metadata(
            timing_metadata(timing.queue_s, timing.compute_s, time.monotonic() - started)
        )
        return message

    async def ModelStreamInfer(
        self,
        request_iterator: AsyncIterator[pb.ModelInferRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        # decoupled models, the final-response mark and back-pressure: server/grpc/stream.py
        async for response in stream_infer(self, request_iterator, context):
            yield response


def _bearer(context: grpc.aio.ServicerContext) -> bytes | None:
    """The bearer token of the call's ``authorization`` metadata, or None."""
    return bearer_token(
        (key.encode(), value if isinstance(value, bytes) else value.encode())
        for key, value in context.invocation_metadata() or ()
    )
