"""The scheduling part of Triton's ``ModelConfig`` for a gpuserve config: which of
``dynamic_batching``, ``sequence_batching`` or ``ensemble_scheduling`` (Triton's
``scheduling_choice``) the model has, and its ``model_transaction_policy``.

Field names and numbers are Triton's (``model_config.proto``); Triton clients and tools read
them to tell a sequence model (they must send sequence ids), an ensemble and a decoupled model
(``perf_analyzer``/``genai-perf`` stream its responses) from a plain one.

Part of the ModelConfig writer (:mod:`gpuserve.repository.triton_model_config`), beside the
config.pbtxt reader rather than in :mod:`gpuserve.protocol`, so backends may use it.
"""

from __future__ import annotations

from typing import Any

from gpuserve.config import ModelConfig
from gpuserve.config.sequence import SequenceBatchingConfig
from gpuserve.protocol.protos import model_config_pb2 as mc

_SEQ = mc.ModelSequenceBatching
_CONTROL_KIND = {
    "start": _SEQ.Control.CONTROL_SEQUENCE_START,
    "ready": _SEQ.Control.CONTROL_SEQUENCE_READY,
    "end": _SEQ.Control.CONTROL_SEQUENCE_END,
    "corrid": _SEQ.Control.CONTROL_SEQUENCE_CORRID,
}


def scheduling_fields(config: ModelConfig, datatypes: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of ``mc.ModelConfig`` for the model's scheduling choice and its
    transaction policy.

    Args:
        config: The configuration the model is served with.
        datatypes: V2 datatype name -> Triton's ``DataType`` value.
    """
    fields: dict[str, Any] = {}
    if config.model_transaction_policy.decoupled:
        fields["model_transaction_policy"] = mc.ModelTransactionPolicy(decoupled=True)
    if config.ensemble is not None:
        fields["ensemble_scheduling"] = mc.ModelEnsembling(
            step=[
                mc.ModelEnsembling.Step(
                    model_name=step.model_name,
                    model_version=step.model_version,
                    input_map=step.input_map,
                    output_map=step.output_map,
                )
                for step in config.ensemble.steps
            ]
        )
    elif config.sequence_batching is not None:
        fields["sequence_batching"] = _sequence(config.sequence_batching, datatypes)
    else:
        db = config.dynamic_batching
        fields["dynamic_batching"] = mc.ModelDynamicBatching(
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
        )
    return fields


def _sequence(sb: SequenceBatchingConfig, datatypes: dict[str, Any]) -> mc.ModelSequenceBatching:
    controls = []
    for control in sb.control_inputs:
        kind = _CONTROL_KIND[control.kind]
        dtype = control.dtype_name
        if control.kind == "corrid":
            message = _SEQ.Control(kind=kind, data_type=datatypes[dtype])
        elif dtype == "FP32":
            message = _SEQ.Control(kind=kind, fp32_false_true=list(control.values))
        elif dtype == "BOOL":
            message = _SEQ.Control(kind=kind, bool_false_true=[bool(v) for v in control.values])
        else:
            message = _SEQ.Control(kind=kind, int32_false_true=[int(v) for v in control.values])
        controls.append(_SEQ.ControlInput(name=control.name, control=[message]))
    states = [
        _SEQ.State(
            input_name=state.input_name,
            output_name=state.output_name,
            data_type=datatypes[state.datatype],
            dims=state.shape,
            initial_state=[
                _SEQ.InitialState(
                    data_type=datatypes[state.datatype],
                    dims=state.initial_shape if state.initial_shape is not None else state.shape,
                    zero_data=True,
                    name=f"{state.input_name}_initial",
                )
            ],
        )
        for state in sb.states
    ]
    message = _SEQ(
        max_sequence_idle_microseconds=sb.max_sequence_idle_us,
        control_input=controls,
        state=states,
    )
    if sb.oldest is not None:
        message.oldest.CopyFrom(
            _SEQ.StrategyOldest(
                max_candidate_sequences=sb.oldest.max_candidate_sequences,
                preferred_batch_size=sb.oldest.preferred_batch_sizes,
                max_queue_delay_microseconds=sb.oldest.max_queue_delay_us,
            )
        )
    else:
        direct = sb.direct
        message.direct.CopyFrom(
            _SEQ.StrategyDirect(
                max_queue_delay_microseconds=direct.max_queue_delay_us if direct else 0,
                minimum_slot_utilization=direct.minimum_slot_utilization if direct else 0.0,
            )
        )
    return message
