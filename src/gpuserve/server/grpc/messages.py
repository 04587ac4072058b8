"""Protobuf encodings of the service's read views: metadata, configuration, statistics, index.

The HTTP front end encodes the same views (:mod:`gpuserve.service.views`) as JSON, so both
carry the same content. The model configuration is returned as Triton's
``inference.ModelConfig``: the mapping HTTP answers as JSON (:mod:`gpuserve.config.triton`),
parsed into the message.
"""

from __future__ import annotations

from google.protobuf import json_format

from gpuserve.config.triton import triton_model_config_dict
from gpuserve.engine.stats import Duration, ModelStats
from gpuserve.protocol.protos import grpc_service_pb2 as pb
from gpuserve.protocol.protos import model_config_pb2 as mc
from gpuserve.server.security import Redactor
from gpuserve.service.views import IndexRow, ModelConfigView, ModelMetadata, ServerMetadata

__all__ = [
    "model_config",
    "model_metadata",
    "model_statistics",
    "repository_index",
    "server_metadata",
]


def server_metadata(view: ServerMetadata) -> pb.ServerMetadataResponse:
    """``ServerMetadataResponse``: name, release and extensions."""
    return pb.ServerMetadataResponse(
        name=view.name, version=view.version, extensions=view.extensions
    )


def model_metadata(view: ModelMetadata) -> pb.ModelMetadataResponse:
    """``ModelMetadataResponse``: shapes with ``-1`` for the batch dimension when batching."""
    Tensor = pb.ModelMetadataResponse.TensorMetadata
    return pb.ModelMetadataResponse(
        name=view.name,
        versions=view.versions,
        platform=view.platform,
        inputs=[Tensor(name=t.name, datatype=t.datatype, shape=t.shape) for t in view.inputs],
        outputs=[Tensor(name=t.name, datatype=t.datatype, shape=t.shape) for t in view.outputs],
    )


def model_config(view: ModelConfigView) -> mc.ModelConfig:
    """Triton's ``ModelConfig`` message for the configuration a model is served with (the
    mapping HTTP's ``GET /v2/models/{m}/config`` answers as JSON, parsed into it)."""
    data = triton_model_config_dict(view.name, view.platform, view.config)
    return json_format.ParseDict(data, mc.ModelConfig())


def _duration(value: Duration) -> pb.StatisticDuration:
    return pb.StatisticDuration(count=value.count, ns=max(0, value.ns))


def model_statistics(stats: ModelStats) -> pb.ModelStatistics:
    """Triton's ``ModelStatistics`` for one version (the statistics extension)."""
    return pb.ModelStatistics(
        name=stats.name,
        version=stats.version,
        last_inference=stats.last_inference_ms,
        inference_count=stats.inference_count,
        execution_count=stats.execution_count,
        inference_stats=pb.InferStatistics(
            success=_duration(stats.success),
            fail=_duration(stats.fail),
            queue=_duration(stats.queue),
            compute_input=_duration(stats.compute_input),
            compute_infer=_duration(stats.compute_infer),
            compute_output=_duration(stats.compute_output),
        ),
        batch_stats=[
            pb.InferBatchStatistics(
                batch_size=size,
                compute_input=_duration(s.compute_input),
                compute_infer=_duration(s.compute_infer),
                compute_output=_duration(s.compute_output),
            )
            for size, s in sorted(stats.batch_sizes.items())
        ],
        response_stats={
            str(index): pb.InferResponseStatistics(
                compute_infer=_duration(r.compute_infer),
                compute_output=_duration(r.compute_output),
                success=_duration(r.success),
                fail=_duration(r.fail),
                empty_response=_duration(r.empty_response),
                cancel=_duration(r.cancel),
            )
            for index, r in sorted(stats.responses.by_index.items())
        },
    )


def repository_index(rows: list[IndexRow], redactor: Redactor) -> pb.RepositoryIndexResponse:
    """``RepositoryIndexResponse`` from the index view (reasons without file paths)."""
    Index = pb.RepositoryIndexResponse.ModelIndex
    return pb.RepositoryIndexResponse(
        models=[
            Index(
                name=row.name,
                version=row.version,
                state=row.state,
                reason=redactor.text(row.reason),
            )
            for row in rows
        ]
    )
