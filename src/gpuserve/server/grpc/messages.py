"""Protobuf encodings of the service's read views: metadata, configuration, statistics, index.

The HTTP front end encodes the same views (:mod:`gpuserve.service.views`) as JSON, so both
carry the same content. The model configuration is returned as Triton's
``inference.ModelConfig`` (the fields gpuserve has an equivalent for: name, platform/backend,
max_batch_size, inputs and outputs with ``TYPE_*`` datatypes and dims, dynamic batching and
its queue policy, instance groups, version policy, CUDA graphs, parameters).
"""

from __future__ import annotations

from typing import Any

import orjson

from gpuserve.engine.stats import Duration, ModelStats
from gpuserve.protocol.protos import grpc_service_pb2 as pb
from gpuserve.protocol.protos import model_config_pb2 as mc
from gpuserve.server.security import Redactor
from gpuserve.service.views import IndexRow, ModelConfigView, ModelMetadata, ServerMetadata

#: V2 datatype -> Triton's model-configuration ``DataType`` (BYTES is ``TYPE_STRING``).
CONFIG_DATATYPE: dict[str, mc.DataType] = {
    "BOOL": mc.TYPE_BOOL,
    "UINT8": mc.TYPE_UINT8,
    "UINT16": mc.TYPE_UINT16,
    "UINT32": mc.TYPE_UINT32,
    "UINT64": mc.TYPE_UINT64,
    "INT8": mc.TYPE_INT8,
    "INT16": mc.TYPE_INT16,
    "INT32": mc.TYPE_INT32,
    "INT64": mc.TYPE_INT64,
    "FP16": mc.TYPE_FP16,
    "FP32": mc.TYPE_FP32,
    "FP64": mc.TYPE_FP64,
    "BYTES": mc.TYPE_STRING,
}
_KIND = {
    "auto": mc.ModelInstanceGroup.KIND_AUTO,
    "gpu": mc.ModelInstanceGroup.KIND_GPU,
    "cpu": mc.ModelInstanceGroup.KIND_CPU,
}


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


def _parameter_text(value: Any) -> str:
    return value if isinstance(value, str) else orjson.dumps(value).decode()


def model_config(view: ModelConfigView) -> mc.ModelConfig:
    """Triton's ``ModelConfig`` message for the configuration a model is served with."""
    name, config = view.name, view.config
    db = config.dynamic_batching
    policy = config.version_policy
    if policy.all is not None:
        version_policy = mc.ModelVersionPolicy(all=mc.ModelVersionPolicy.All())
    elif policy.specific is not None:
        version_policy = mc.ModelVersionPolicy(
            specific=mc.ModelVersionPolicy.Specific(versions=policy.specific.versions)
        )
    else:
        latest = policy.latest.num_versions if policy.latest is not None else 1
        version_policy = mc.ModelVersionPolicy(
            latest=mc.ModelVersionPolicy.Latest(num_versions=latest)
        )
    return mc.ModelConfig(
        name=name,
        platform=view.platform,
        backend=config.backend,
        version_policy=version_policy,
        max_batch_size=config.max_batch_size,
        input=[
            mc.ModelInput(
                name=t.name,
                data_type=CONFIG_DATATYPE[t.datatype],
                dims=t.shape,
                optional=t.optional,
            )
            for t in config.inputs
        ],
        output=[
            mc.ModelOutput(name=t.name, data_type=CONFIG_DATATYPE[t.datatype], dims=t.shape)
            for t in config.outputs
        ],
        optimization=mc.ModelOptimizationPolicy(
            cuda=mc.ModelOptimizationPolicy.Cuda(graphs=config.optimization.cuda_graphs)
        ),
        dynamic_batching=mc.ModelDynamicBatching(
            preferred_batch_size=db.preferred_batch_sizes,
            max_queue_delay_microseconds=db.max_queue_delay_us,
            priority_levels=db.priority_levels,
            default_priority_level=db.default_priority_level,
            default_queue_policy=mc.ModelQueuePolicy(
                timeout_action=mc.ModelQueuePolicy.REJECT,
                default_timeout_microseconds=db.default_timeout_us,
                allow_timeout_override=True,
                max_queue_size=db.max_queue_size,
            ),
        ),
        instance_group=[
            mc.ModelInstanceGroup(
                name=f"{name}_{index}", kind=_KIND[group.kind], count=group.count, gpus=group.gpus
            )
            for index, group in enumerate(config.instance_group)
        ],
        parameters={
            key: mc.ModelParameter(string_value=_parameter_text(value))
            for key, value in config.parameters.items()
        },
    )


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
