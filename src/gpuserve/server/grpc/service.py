"""KServe V2 ``inference.GRPCInferenceService`` on grpc.aio: the gRPC twin of the HTTP app.

Every call answers what the matching HTTP endpoint of :mod:`gpuserve.server.http.app`
answers, with the same error messages; errors map to gRPC status codes through the one table
in :mod:`gpuserve.server.status`. No stack trace ever reaches a client.

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
  gets a response whose ``error_message`` says why; the stream goes on.
* ``RepositoryModelLoad`` / ``RepositoryModelUnload`` go through the HTTP front end's
  repository API (:mod:`gpuserve.server.http.repository`): the same checks and behaviour, the
  management token read from the ``authorization`` metadata (UNAUTHENTICATED without it,
  PERMISSION_DENIED when management is disabled).
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
import orjson
from google.protobuf.message import DecodeError

import gpuserve
from gpuserve.config import ServerConfig
from gpuserve.engine.request import RequestTiming
from gpuserve.engine.stats import RequestStats
from gpuserve.errors import (
    GpuserveError,
    InvalidInputError,
    ModelNotFoundError,
    ModelNotReadyError,
    OverloadedError,
    UnavailableError,
)
from gpuserve.metrics import ServerMetrics
from gpuserve.protocol.grpc_codec import decode_infer_request, encode_infer_response
from gpuserve.protocol.limits import RequestLimits
from gpuserve.protocol.protos import grpc_service_pb2 as pb
from gpuserve.protocol.protos import grpc_service_pb2_grpc as pb_grpc
from gpuserve.repository.manager import Model, ModelManager, ModelVersion
from gpuserve.server.grpc import messages
from gpuserve.server.grpc.access import log_call
from gpuserve.server.http.repository import ManagementDenied, RepositoryApi
from gpuserve.server.security import Redactor, check_model_name, check_version_label
from gpuserve.server.status import grpc_code
from gpuserve.server.timing import timing_metadata

logger = logging.getLogger(__name__)

SERVICE_NAME = "inference.GRPCInferenceService"
EXTENSIONS = ["binary_tensor_data", "statistics", "model_configuration", "model_repository"]

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


class RpcAbort(Exception):
    """End the call with a status that no GpuserveError maps to (UNAUTHENTICATED, ...)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def status_code(error: GpuserveError) -> grpc.StatusCode:
    """The gRPC status code of ``error`` (from the table in :mod:`gpuserve.server.status`)."""
    return grpc.StatusCode[grpc_code(error)]


async def abort(
    context: grpc.aio.ServicerContext, error: GpuserveError, redactor: Redactor | None = None
) -> NoReturn:
    """End the call with ``error``'s status code and message (without file paths when a
    ``redactor`` is given)."""
    trailing: tuple[tuple[str, str], ...] = ()
    if isinstance(error, OverloadedError):
        trailing = (("retry-after", str(max(1, round(error.retry_after_s)))),)
    message = redactor.text(error.message) if redactor is not None else error.message
    await context.abort(status_code(error), message, trailing_metadata=trailing)
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover


def unary(method: Handler[Request, Response]) -> Handler[Request, Response]:
    """Wrap a unary handler: GpuserveError -> its status, RpcAbort -> its code, anything else
    -> INTERNAL (logged); one access-log line per call."""

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
        except RpcAbort as err:
            log(err.code.name)
            await context.abort(err.code, err.message)
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


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """The V2 inference service over a :class:`ModelManager`.

    Args:
        manager: The model manager requests are routed to.
        config: Server settings.
        metrics: Counts requests refused before they reach a model version (unknown model
            or version, model not ready); the rest are counted from the engine's statistics.
    """

    def __init__(
        self, manager: ModelManager, config: ServerConfig, metrics: ServerMetrics | None = None
    ) -> None:
        self.manager = manager
        self.config = config
        self.metrics = metrics
        self.repository = RepositoryApi(manager, config)
        self.access_log = config.access_log
        self.redactor = Redactor(config.model_repository)
        self.limits = RequestLimits(config.max_tensor_elements, config.max_bytes_element_bytes)

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
        return pb.ServerReadyResponse(ready=self.manager.is_ready())

    @unary
    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: Any
    ) -> pb.ModelReadyResponse:
        try:
            check_version_label(request.name, request.version or None)
            self.manager.version(request.name, request.version or None)
        except ModelNotFoundError:
            raise
        except GpuserveError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    @unary
    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: Any
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(
            name="gpuserve", version=gpuserve.__version__, extensions=EXTENSIONS
        )

    @unary
    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: Any
    ) -> pb.ModelMetadataResponse:
        model, versions = self._lookup(request.name, request.version or None)
        config = self._config_of(model)
        return messages.model_metadata(model.name, [str(mv.version) for mv in versions], config)

    @unary
    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: Any
    ) -> pb.ModelConfigResponse:
        model, _ = self._lookup(request.name, request.version or None)
        return pb.ModelConfigResponse(
            config=messages.model_config(model.name, self._config_of(model))
        )

    @unary
    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: Any
    ) -> pb.ModelStatisticsResponse:
        if request.name:
            _, versions = self._lookup(request.name, request.version or None)
        else:
            versions = [mv for m in self.manager.models.values() for mv in m.versions.values()]
        return pb.ModelStatisticsResponse(
            model_stats=[
                messages.model_statistics(mv.scheduler.stats)
                for mv in versions
                if mv.scheduler is not None
            ]
        )

    @unary
    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: Any
    ) -> pb.RepositoryIndexResponse:
        rows = [
            {**row, "reason": self.redactor.text(row["reason"])}
            for row in self.manager.index(request.ready)
        ]
        return messages.repository_index(rows)

    @unary
    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryModelLoadResponse:
        body: dict[str, Any] = {}
        for key, value in request.parameters.items():
            if key == "config":
                if value.WhichOneof("parameter_choice") != "string_param":
                    raise InvalidInputError(
                        "parameter 'config' must be a string_param holding the model "
                        "configuration as JSON"
                    )
                body = {"parameters": {"config": value.string_param}}
            elif key.startswith("file:"):
                raise InvalidInputError(
                    f"parameter {key!r}: model files in a load request are not supported; "
                    "put them in the model repository"
                )
        await self._manage("load", request.model_name, body, context)
        return pb.RepositoryModelLoadResponse()

    @unary
    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryModelUnloadResponse:
        await self._manage("unload", request.model_name, {}, context)
        return pb.RepositoryModelUnloadResponse()

    async def _manage(
        self, action: str, name: str, body: dict[str, Any], context: grpc.aio.ServicerContext
    ) -> None:
        """Run a repository action through the HTTP front end's repository API, so both
        protocols share its checks (management disabled, bearer token in the ``authorization``
        metadata) and behaviour."""
        check_model_name(name)
        headers = [
            (key.encode(), value if isinstance(value, bytes) else value.encode())
            for key, value in context.invocation_metadata() or ()
        ]
        try:
            await self.repository.handle(
                f"/v2/repository/models/{name}/{action}", headers, orjson.dumps(body)
            )
        except ManagementDenied as err:
            code = (
                grpc.StatusCode.UNAUTHENTICATED
                if err.status == 401
                else grpc.StatusCode.PERMISSION_DENIED
            )
            raise RpcAbort(code, err.message) from None

    def _lookup(self, name: str, version: str | None) -> tuple[Model, list[ModelVersion]]:
        check_version_label(name, version)
        model = self.manager.model(name)
        if version is None:
            return model, list(model.versions.values())
        if not version.isdigit() or int(version) not in model.versions:
            raise ModelNotFoundError(
                f"model '{name}' has no version '{version}' (versions: {sorted(model.versions)})"
            )
        return model, [model.versions[int(version)]]

    def _config_of(self, model: Model) -> Any:
        if model.config is None:
            raise ModelNotReadyError(f"model '{model.name}' is not ready: {model.error}")
        return model.config

    # -- inference -------------------------------------------------------------------------

    async def _infer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> tuple[pb.ModelInferResponse, RequestTiming]:
        """Decode, queue, run and encode one request (errors propagate as GpuserveError)."""
        name = request.model_name
        version = request.model_version or None
        try:
            check_version_label(name, version)
            mv = self.manager.version(name, version)
        except GpuserveError as err:
            if self.metrics is not None:
                self.metrics.record_unrouted(name, version, err.reason)
            raise
        scheduler = mv.scheduler
        assert scheduler is not None
        try:
            decoded = decode_infer_request(request, mv.config, name, version, self.limits)
            if self.manager.shutting_down:
                raise UnavailableError("server is shutting down; retry on another replica")
        except GpuserveError as err:  # counted here: it never reaches the scheduler
            scheduler.stats.record_request(
                RequestStats(name, scheduler.version, 0, 0.0, 0.0, 0.0, err.reason)
            )
            raise
        if version is None:  # a canary may take this request (by a hash of its id)
            routed = self.manager.split(mv, decoded.id)
            if routed is not mv and routed.scheduler is not None:
                mv, scheduler = routed, routed.scheduler
        # The handler task is cancelled when the client goes away (the scheduler then drops the
        # queued request); the probe also catches a client gone just before its batch forms.
        decoded.is_cancelled = context.cancelled
        response = await scheduler.infer(decoded)
        return encode_infer_response(response, mv.config), response.timing

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
        results: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
        running: set[asyncio.Task[None]] = set()

        async def run(request: pb.ModelInferRequest | MalformedRequest) -> None:
            started = time.monotonic()
            code = "OK"
            message = None
            if isinstance(request, MalformedRequest):
                if self.access_log:
                    log_call(context.peer(), "ModelStreamInfer", "INVALID_ARGUMENT", None, None, 0)
                results.put_nowait(_stream_error(pb.ModelInferRequest(), request.error.message))
                return
            try:
                message, _ = await self._infer(request, context)
                results.put_nowait(pb.ModelStreamInferResponse(infer_response=message))
            except GpuserveError as err:
                code = grpc_code(err)
                results.put_nowait(_stream_error(request, self.redactor.text(err.message)))
            except Exception:  # a bug: log it, never leak it
                code = "INTERNAL"
                logger.exception("unhandled error serving a ModelStreamInfer request")
                results.put_nowait(_stream_error(request, "internal server error"))
            if self.access_log:
                peer = context.peer()
                total_s = time.monotonic() - started
                log_call(peer, "ModelStreamInfer", code, request, message, total_s)

        async def read() -> None:
            try:
                async for request in request_iterator:
                    task = asyncio.create_task(run(request))
                    running.add(task)
                    task.add_done_callback(running.discard)
                if running:
                    await asyncio.wait(set(running))
            finally:
                results.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (item := await results.get()) is not None:
                yield item
            await reader  # re-raises a failure of the request stream itself
        finally:
            for task in (reader, *running):
                task.cancel()


def _stream_error(request: pb.ModelInferRequest, message: str) -> pb.ModelStreamInferResponse:
    return pb.ModelStreamInferResponse(
        error_message=message,
        infer_response=pb.ModelInferResponse(
            model_name=request.model_name, model_version=request.model_version, id=request.id
        ),
    )
