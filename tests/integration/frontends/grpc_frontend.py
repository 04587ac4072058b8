"""The :class:`~tests.integration.frontends.api.Frontend` interface over gRPC: grpcio stubs of
Triton's own protos (``tritonclient.grpc.service_pb2``), so every message is the one a
Triton client puts on the wire.

Inputs go as typed ``contents`` (the field of their datatype, as the JSON ``data`` of the HTTP
twin) or, with ``raw=True`` and for FP16 (which has no typed field), as
``raw_input_contents``; outputs come back in ``raw_output_contents``. Errors are the call's
status code and details; ``retry-after`` is read from the trailing metadata.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from tests.integration.frontends.api import (
    FrontendError,
    IndexRow,
    InferResult,
    ModelConfigView,
    ModelMetadata,
    ModelStats,
    ServerMetadata,
    Status,
    Tensor,
    TensorMetadata,
    array_from_raw,
    raw_bytes,
)

TIMING_KEYS = ("x-queue-time-us", "x-compute-time-us", "x-total-time-us")

#: V2 datatype -> the ``InferTensorContents`` field of its typed values (FP16 has none).
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def _datatype(data_type: int) -> str:
    name = mc.DataType.Name(data_type).removeprefix("TYPE_")
    return "BYTES" if name == "STRING" else name


def _tensors(items: Any, config: bool = False) -> tuple[TensorMetadata, ...]:
    if config:
        return tuple(TensorMetadata(t.name, _datatype(t.data_type), tuple(t.dims)) for t in items)
    return tuple(TensorMetadata(t.name, t.datatype, tuple(t.shape)) for t in items)


def _error(err: grpc.RpcError) -> FrontendError:
    code = err.code()
    retry = None
    for key, value in err.trailing_metadata() or ():
        if key == "retry-after":
            retry = int(value)
    status = Status.__members__.get(code.name, Status.UNKNOWN)
    return FrontendError(status, err.details() or "", code.name, retry)


class GrpcFrontend:
    """A client of ``target`` (``host:port``) over gRPC.

    Args:
        target: The server's gRPC address.
        token: Sent as ``authorization: Bearer <token>`` metadata; None for none.
        raw: Send every input in ``raw_input_contents`` instead of typed ``contents``.
        timeout_s: Default deadline per call, seconds.
    """

    kind = "grpc"

    def __init__(
        self, target: str, token: str | None = None, raw: bool = False, timeout_s: float = 30.0
    ) -> None:
        self.target = target
        self.token = token
        self.raw = raw
        self.encoding = "raw" if raw else "contents"
        self.timeout_s = timeout_s
        self.metadata = () if token is None else (("authorization", f"Bearer {token}"),)
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self._twin: GrpcFrontend | None = None

    def with_token(self, token: str | None) -> GrpcFrontend:
        return GrpcFrontend(self.target, token, self.raw, self.timeout_s)

    def variants(self) -> list[GrpcFrontend]:
        """This client and its twin in the other encoding (typed contents, raw); closed
        with it."""
        if self._twin is None:
            self._twin = GrpcFrontend(self.target, self.token, not self.raw, self.timeout_s)
        return [self, self._twin]

    def close(self) -> None:
        self.channel.close()
        if self._twin is not None:
            self._twin.close()

    def _call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        return self._call_with(method, request, timeout_s)[0]

    def _call_with(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        """(response, call) of a unary call."""
        rpc = getattr(self.stub, method)
        try:
            return rpc.with_call(
                request, timeout=timeout_s or self.timeout_s, metadata=self.metadata
            )
        except grpc.RpcError as err:
            raise _error(err) from None

    # -- health and metadata ---------------------------------------------------------------

    def server_live(self) -> bool:
        return self._call("ServerLive", pb.ServerLiveRequest()).live

    def server_ready(self) -> bool:
        return self._call("ServerReady", pb.ServerReadyRequest()).ready

    def server_metadata(self) -> ServerMetadata:
        reply = self._call("ServerMetadata", pb.ServerMetadataRequest())
        return ServerMetadata(reply.name, reply.version, tuple(reply.extensions))

    def model_metadata(self, model: str, version: str | None = None) -> ModelMetadata:
        reply = self._call("ModelMetadata", pb.ModelMetadataRequest(name=model, version=version))
        return ModelMetadata(
            reply.name,
            tuple(reply.versions),
            reply.platform,
            _tensors(reply.inputs),
            _tensors(reply.outputs),
        )

    def model_ready(self, model: str, version: str | None = None) -> bool:
        return self._call("ModelReady", pb.ModelReadyRequest(name=model, version=version)).ready

    def config(self, model: str, version: str | None = None) -> ModelConfigView:
        reply = self._call("ModelConfig", pb.ModelConfigRequest(name=model, version=version))
        config = reply.config
        batching = config.dynamic_batching
        policy = batching.default_queue_policy
        return ModelConfigView(
            name=config.name,
            platform=config.platform,
            backend=config.backend,
            max_batch_size=config.max_batch_size,
            inputs=_tensors(config.input, config=True),
            outputs=_tensors(config.output, config=True),
            max_queue_delay_us=batching.max_queue_delay_microseconds,
            max_queue_size=policy.max_queue_size,
            default_timeout_us=policy.default_timeout_microseconds,
            priority_levels=batching.priority_levels,
        )

    def stats(self, model: str | None = None, version: str | None = None) -> list[ModelStats]:
        request = pb.ModelStatisticsRequest(name=model or "", version=version or "")
        return [
            ModelStats(
                name=row.name,
                version=row.version,
                inference_count=row.inference_count,
                execution_count=row.execution_count,
                success_count=row.inference_stats.success.count,
                fail_count=row.inference_stats.fail.count,
                queue_count=row.inference_stats.queue.count,
            )
            for row in self._call("ModelStatistics", request).model_stats
        ]

    # -- repository ------------------------------------------------------------------------

    def index(self, ready_only: bool = False) -> list[IndexRow]:
        reply = self._call("RepositoryIndex", pb.RepositoryIndexRequest(ready=ready_only))
        return [IndexRow(m.name, m.version, m.state, m.reason) for m in reply.models]

    def load(self, model: str, config: Mapping[str, Any] | None = None) -> None:
        request = pb.RepositoryModelLoadRequest(model_name=model)
        if config is not None:
            request.parameters["config"].string_param = json.dumps(config)
        self._call("RepositoryModelLoad", request)

    def unload(self, model: str) -> None:
        self._call("RepositoryModelUnload", pb.RepositoryModelUnloadRequest(model_name=model))

    # -- inference -------------------------------------------------------------------------

    def request(
        self,
        model: str,
        inputs: Sequence[Tensor],
        *,
        version: str | None = None,
        id: str | None = None,
        outputs: Sequence[str] | None = None,
        parameters: Mapping[str, int | str | bool] | None = None,
    ) -> pb.ModelInferRequest:
        """The ``ModelInferRequest`` :meth:`infer` sends."""
        message = pb.ModelInferRequest(model_name=model, model_version=version or "", id=id or "")
        raw = self.raw or any(item.datatype not in CONTENTS_FIELD for item in inputs)
        for item in inputs:
            added = message.inputs.add(name=item.name, datatype=item.datatype, shape=item.shape)
            if raw:
                message.raw_input_contents.append(raw_bytes(item))
            else:
                getattr(added.contents, CONTENTS_FIELD[item.datatype]).extend(
                    item.values.ravel().tolist()
                )
        for name in outputs or ():
            message.outputs.add(name=name)
        for key, value in (parameters or {}).items():
            if isinstance(value, bool):
                message.parameters[key].bool_param = value
            elif isinstance(value, int):
                message.parameters[key].int64_param = value
            else:
                message.parameters[key].string_param = value
        return message

    def infer(
        self,
        model: str,
        inputs: Sequence[Tensor],
        *,
        version: str | None = None,
        id: str | None = None,
        outputs: Sequence[str] | None = None,
        parameters: Mapping[str, int | str | bool] | None = None,
        client_timeout_s: float | None = None,
    ) -> InferResult:
        message = self.request(
            model, inputs, version=version, id=id, outputs=outputs, parameters=parameters
        )
        reply, call = self._call_with("ModelInfer", message, client_timeout_s)
        arrays: dict[str, np.ndarray] = {}
        for out, data in zip(reply.outputs, reply.raw_output_contents, strict=True):
            arrays[out.name] = array_from_raw(data, out.datatype, out.shape)
        trailing = dict(call.trailing_metadata() or ())
        return InferResult(
            model_name=reply.model_name,
            model_version=reply.model_version,
            id=reply.id,
            outputs=arrays,
            datatypes={out.name: out.datatype for out in reply.outputs},
            timing_us={key: int(trailing[key]) for key in TIMING_KEYS},
        )
