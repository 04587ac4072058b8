"""gpuserve's model configuration as Triton's ``inference.ModelConfig``: one mapping, sent as a
protobuf message over gRPC (``ModelConfig``), as JSON over HTTP (``GET /v2/models/{m}/config``)
and handed to Triton Python models as ``args["model_config"]``.

The fields carried are those gpuserve has an equivalent for: name, platform/backend,
max_batch_size, inputs and outputs with ``TYPE_*`` datatypes, dims and reshape, dynamic batching
and its queue policy, instance groups, version policy, CUDA graphs, parameters (with the
settings of the backend's own section, :func:`model_parameters`) and the ``model_warmup``
samples.

The writer lives beside its reader (:mod:`gpuserve.repository.triton_config`, config.pbtxt ->
gpuserve's config) rather than in :mod:`gpuserve.protocol`, so the Python backend (which hands
it to Triton Python models) uses it without importing the wire-format layer; it imports only
:mod:`gpuserve.config` and the generated ``model_config_pb2`` message.
"""

from __future__ import annotations

from typing import Any

import orjson
from google.protobuf import json_format

from gpuserve.config import ModelConfig, TensorSpec
from gpuserve.config.warmup import WarmupSample
from gpuserve.protocol.protos import model_config_pb2 as mc
from gpuserve.repository.triton_scheduling import scheduling_fields

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
#: 64-bit fields, which protobuf's JSON mapping writes as strings; Triton writes numbers.
_INT64_FIELDS = {
    "dims",
    "shape",
    "max_queue_delay_microseconds",
    "default_timeout_microseconds",
    "versions",
    "priority_levels",
    "default_priority_level",
}


def _parameter_text(value: Any) -> str:
    return value if isinstance(value, str) else orjson.dumps(value).decode()


#: The backend whose own section of the config is shown in Triton's ``parameters`` map.
_BACKEND_SECTIONS = {"onnx": "onnx", "huggingface": "huggingface"}


def model_parameters(config: ModelConfig) -> dict[str, str]:
    """Triton's ``parameters`` of ``config`` as key -> text: the settings of the backend's own
    section that the config sets (``model_dir``, ``max_length``, ``task`` of
    ``huggingface``; ``intra_op_threads``, ... of ``onnx``), then ``parameters`` (which win
    on a shared key). Values that are not text are written as JSON (``8``, ``["cpu"]``)."""
    out: dict[str, str] = {}
    section = _BACKEND_SECTIONS.get(config.backend)
    if section is not None:
        values = getattr(config, section).model_dump(mode="json", exclude_unset=True)
        out.update((key, _parameter_text(value)) for key, value in values.items())
    out.update((key, _parameter_text(value)) for key, value in config.parameters.items())
    return out


def _version_policy(config: ModelConfig) -> mc.ModelVersionPolicy:
    policy = config.version_policy
    if policy.all is not None:
        return mc.ModelVersionPolicy(all=mc.ModelVersionPolicy.All())
    if policy.specific is not None:
        return mc.ModelVersionPolicy(
            specific=mc.ModelVersionPolicy.Specific(versions=policy.specific.versions)
        )
    latest = policy.latest.num_versions if policy.latest is not None else 1
    return mc.ModelVersionPolicy(latest=mc.ModelVersionPolicy.Latest(num_versions=latest))


def _reshape(spec: TensorSpec) -> dict[str, mc.ModelTensorReshape]:
    """``reshape`` as a keyword of ModelInput/ModelOutput; nothing when the spec has none
    (the field is then absent from the message, as in Triton)."""
    if spec.reshape is None:
        return {}
    return {"reshape": mc.ModelTensorReshape(shape=spec.reshape)}


def _warmup(sample: WarmupSample) -> mc.ModelWarmup:
    inputs = {}
    for key, given in sample.inputs.items():
        entry = mc.ModelWarmup.Input(data_type=CONFIG_DATATYPE[given.data_type], dims=given.dims)
        if given.input_data_file is not None:  # the one source set (WarmupInput checks it)
            entry.input_data_file = given.input_data_file
        elif given.random_data is not None:
            entry.random_data = True
        else:
            entry.zero_data = True
        inputs[key] = entry
    return mc.ModelWarmup(
        name=sample.name, batch_size=sample.batch_size, inputs=inputs, count=sample.count
    )


def triton_model_config(name: str, platform: str, config: ModelConfig) -> mc.ModelConfig:
    """Triton's ``ModelConfig`` message for ``config``.

    Args:
        name: The model name.
        platform: The platform Triton clients know (``pytorch_libtorch``, ``onnx``, ...).
        config: The configuration the model is served with.
    """
    return mc.ModelConfig(
        name=name,
        platform=platform,
        backend=config.backend,
        version_policy=_version_policy(config),
        max_batch_size=config.max_batch_size,
        input=[
            mc.ModelInput(
                name=t.name,
                data_type=CONFIG_DATATYPE[t.datatype],
                dims=t.shape,
                optional=t.optional,
                format=t.format or "FORMAT_NONE",
                **_reshape(t),
            )
            for t in config.inputs
        ],
        output=[
            mc.ModelOutput(
                name=t.name,
                data_type=CONFIG_DATATYPE[t.datatype],
                dims=t.shape,
                label_filename=t.label_filename or "",
                **_reshape(t),
            )
            for t in config.outputs
        ],
        optimization=mc.ModelOptimizationPolicy(
            cuda=mc.ModelOptimizationPolicy.Cuda(graphs=config.optimization.cuda_graphs)
        ),
        **scheduling_fields(config, CONFIG_DATATYPE),
        instance_group=[
            mc.ModelInstanceGroup(
                name=f"{name}_{index}", kind=_KIND[group.kind], count=group.count, gpus=group.gpus
            )
            for index, group in enumerate(config.instance_group)
        ],
        parameters={
            key: mc.ModelParameter(string_value=text)
            for key, text in model_parameters(config).items()
        },
        model_warmup=[_warmup(sample) for sample in config.model_warmup],
    )


def _numbers(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _numbers(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers(v, key) for v in value]
    if key in _INT64_FIELDS and isinstance(value, str):
        return int(value)
    return value


def triton_model_config_dict(name: str, platform: str, config: ModelConfig) -> dict[str, Any]:
    """:func:`triton_model_config` as Triton writes it in JSON: proto field names
    (``max_batch_size``, ``data_type``), enums by name (``TYPE_FP32``, ``KIND_CPU``), every
    field including zero values, 64-bit integers as numbers."""
    message = triton_model_config(name, platform, config)
    data = json_format.MessageToDict(
        message,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
    )
    result: dict[str, Any] = _numbers(data)
    return result
