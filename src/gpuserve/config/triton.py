"""gpuserve's model configuration in Triton's form (``inference.ModelConfig`` as Triton writes
it in JSON): one mapping, answered over HTTP (``GET /v2/models/{m}/config``), sent as the
protobuf message over gRPC (the gRPC front end parses this mapping into it) and handed to
Triton Python models as ``args["model_config"]`` and to their ``auto_complete_config``.

The fields carried are those gpuserve has an equivalent for: name, platform/backend,
max_batch_size, inputs and outputs with ``TYPE_*`` datatypes, dims and reshape, dynamic batching
and its queue policy, sequence batching (controls, states, strategy), ensemble steps, the
decoupled transaction policy, instance groups, version policy, CUDA graphs, parameters (with
the settings of the backend's own section, :func:`model_parameters`) and the ``model_warmup``
samples.

The mapping is what protobuf's JSON printer writes for that message (proto field names,
enums by name, every field without presence even at its zero value, a message field only
when set, a ``float`` field as the shortest decimal that reads back as the same 32-bit
float) with 64-bit integers as numbers, as Triton writes them. Written here in plain Python,
below every layer that uses it, so that none of them (the Python backend least of all)
depends on the wire format's generated classes; ``tests/unit/test_triton_config_form.py``
checks it against that printer.
"""

from __future__ import annotations

import struct
from typing import Any

import orjson

from gpuserve.config.model import ModelConfig, TensorSpec, VersionPolicy
from gpuserve.config.sequence import SequenceBatchingConfig, StateSpec
from gpuserve.config.warmup import WarmupSample
from gpuserve.datatypes import CONFIG_DATATYPES

_KIND = {"auto": "KIND_AUTO", "gpu": "KIND_GPU", "cpu": "KIND_CPU"}
_CONTROL_KIND = {
    "start": "CONTROL_SEQUENCE_START",
    "ready": "CONTROL_SEQUENCE_READY",
    "end": "CONTROL_SEQUENCE_END",
    "corrid": "CONTROL_SEQUENCE_CORRID",
}
#: The backend whose own section of the config is shown in Triton's ``parameters`` map.
_BACKEND_SECTIONS = {"onnx": "onnx", "huggingface": "huggingface"}


def _parameter_text(value: Any) -> str:
    return value if isinstance(value, str) else orjson.dumps(value).decode()


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


def _float32(value: float) -> float:
    """``value`` as a protobuf ``float`` field holds it, written as the shortest decimal
    that reads back as the same 32-bit float (protobuf's JSON printer does so: 0.1, not
    0.10000000149011612)."""
    stored: float = struct.unpack("<f", struct.pack("<f", value))[0]
    for digits in range(6, 10):  # every 32-bit float has 6 to 9 significant digits
        shortest = float(f"{stored:.{digits}g}")
        if struct.unpack("<f", struct.pack("<f", shortest))[0] == stored:
            return shortest
    return stored


def _version_policy(policy: VersionPolicy) -> dict[str, Any]:
    if policy.all is not None:
        return {"all": {}}
    if policy.specific is not None:
        return {"specific": {"versions": list(policy.specific.versions)}}
    latest = policy.latest.num_versions if policy.latest is not None else 1
    return {"latest": {"num_versions": latest}}


def _reshape(spec: TensorSpec) -> dict[str, Any]:
    """``reshape`` of an input or output; nothing when the spec has none (the field is then
    absent, as in Triton)."""
    if spec.reshape is None:
        return {}
    return {"reshape": {"shape": list(spec.reshape)}}


def _input(spec: TensorSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "data_type": CONFIG_DATATYPES[spec.datatype],
        "format": spec.format or "FORMAT_NONE",
        "dims": list(spec.shape),
        **_reshape(spec),
        "optional": spec.optional,
    }


def _output(spec: TensorSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "data_type": CONFIG_DATATYPES[spec.datatype],
        "dims": list(spec.shape),
        **_reshape(spec),
        "label_filename": spec.label_filename or "",
    }


def _warmup(sample: WarmupSample) -> dict[str, Any]:
    inputs: dict[str, Any] = {}
    for key, given in sample.inputs.items():
        entry: dict[str, Any] = {
            "data_type": CONFIG_DATATYPES[given.data_type],
            "dims": list(given.dims),
        }
        if given.input_data_file is not None:  # the one source set (WarmupInput checks it)
            entry["input_data_file"] = given.input_data_file
        elif given.random_data is not None:
            entry["random_data"] = True
        else:
            entry["zero_data"] = True
        inputs[key] = entry
    return {
        "name": sample.name,
        "batch_size": sample.batch_size,
        "inputs": inputs,
        "count": sample.count,
    }


def _scheduling(config: ModelConfig) -> dict[str, Any]:
    """The model's scheduling choice (Triton's ``scheduling_choice``: exactly one of
    ``dynamic_batching``, ``sequence_batching`` and ``ensemble_scheduling``), which Triton
    clients and tools read to tell a sequence model (they must send sequence ids) and an
    ensemble from a plain one."""
    if config.ensemble is not None:
        return {
            "ensemble_scheduling": {
                "step": [
                    {
                        "model_name": step.model_name,
                        # int64 as protobuf's printer writes it (a string), as before
                        "model_version": str(step.model_version),
                        "input_map": dict(step.input_map),
                        "output_map": dict(step.output_map),
                    }
                    for step in config.ensemble.steps
                ]
            }
        }
    if config.sequence_batching is not None:
        return {"sequence_batching": _sequence(config.sequence_batching)}
    db = config.dynamic_batching
    return {
        "dynamic_batching": {
            "preferred_batch_size": list(db.preferred_batch_sizes),
            "max_queue_delay_microseconds": db.max_queue_delay_us,
            "preserve_ordering": False,
            "priority_levels": db.priority_levels,
            "default_priority_level": db.default_priority_level,
            "default_queue_policy": {
                "timeout_action": "REJECT",
                "default_timeout_microseconds": db.default_timeout_us,
                "allow_timeout_override": True,
                "max_queue_size": db.max_queue_size,
            },
        }
    }


def _control(kind: str, dtype: str, values: list[Any]) -> dict[str, Any]:
    """One ``Control`` message: a corrid control names its datatype, a flag control its
    false/true values in the field of its datatype."""
    int32s: list[int] = []
    fp32s: list[float] = []
    bools: list[bool] = []
    data_type = "TYPE_INVALID"
    if kind == "corrid":
        data_type = CONFIG_DATATYPES[dtype]
    elif dtype == "FP32":
        fp32s = [_float32(float(v)) for v in values]
    elif dtype == "BOOL":
        bools = [bool(v) for v in values]
    else:
        int32s = [int(v) for v in values]
    return {
        "kind": _CONTROL_KIND[kind],
        "int32_false_true": int32s,
        "fp32_false_true": fp32s,
        "bool_false_true": bools,
        "data_type": data_type,
    }


def _state(state: StateSpec) -> dict[str, Any]:
    data_type = CONFIG_DATATYPES[state.datatype]
    initial = state.initial_shape if state.initial_shape is not None else state.shape
    return {
        "input_name": state.input_name,
        "output_name": state.output_name,
        "data_type": data_type,
        "dims": list(state.shape),
        "initial_state": [
            {
                "data_type": data_type,
                "dims": list(initial),
                "zero_data": True,
                "name": f"{state.input_name}_initial",
            }
        ],
    }


def _sequence(sb: SequenceBatchingConfig) -> dict[str, Any]:
    strategy: dict[str, Any]
    if sb.oldest is not None:
        strategy = {
            "oldest": {
                "max_candidate_sequences": sb.oldest.max_candidate_sequences,
                "preferred_batch_size": list(sb.oldest.preferred_batch_sizes),
                "max_queue_delay_microseconds": sb.oldest.max_queue_delay_us,
            }
        }
    else:
        direct = sb.direct
        strategy = {
            "direct": {
                "max_queue_delay_microseconds": direct.max_queue_delay_us if direct else 0,
                "minimum_slot_utilization": _float32(
                    direct.minimum_slot_utilization if direct else 0.0
                ),
            }
        }
    return {
        **strategy,
        # uint64 as protobuf's printer writes it (a string), as before
        "max_sequence_idle_microseconds": str(sb.max_sequence_idle_us),
        "control_input": [
            {
                "name": control.name,
                "control": [_control(control.kind, control.dtype_name, list(control.values))],
            }
            for control in sb.control_inputs
        ],
        "state": [_state(state) for state in sb.states],
    }


def triton_model_config_dict(name: str, platform: str, config: ModelConfig) -> dict[str, Any]:
    """Triton's ``ModelConfig`` for ``config`` as Triton writes it in JSON: proto field names
    (``max_batch_size``, ``data_type``), enums by name (``TYPE_FP32``, ``KIND_CPU``), every
    field including zero values, 64-bit integers as numbers.

    Args:
        name: The model name.
        platform: The platform Triton clients know (``pytorch_libtorch``, ``onnx``, ...).
        config: The configuration the model is served with.
    """
    data: dict[str, Any] = {
        "name": name,
        "platform": platform,
        "backend": config.backend,
        "version_policy": _version_policy(config.version_policy),
        "max_batch_size": config.max_batch_size,
        "input": [_input(t) for t in config.inputs],
        "output": [_output(t) for t in config.outputs],
        "optimization": {"cuda": {"graphs": config.optimization.cuda_graphs}},
        **_scheduling(config),
        "instance_group": [
            {
                "name": f"{name}_{index}",
                "kind": _KIND[group.kind],
                "count": group.count,
                "gpus": list(group.gpus),
            }
            for index, group in enumerate(config.instance_group)
        ],
        "parameters": {
            key: {"string_value": text} for key, text in model_parameters(config).items()
        },
        "model_warmup": [_warmup(sample) for sample in config.model_warmup],
    }
    if config.model_transaction_policy.decoupled:
        data["model_transaction_policy"] = {"decoupled": True}
    return data


__all__ = ["model_parameters", "triton_model_config_dict"]
