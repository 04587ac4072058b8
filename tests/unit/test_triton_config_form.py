"""Triton's form of a configuration (``gpuserve.config.triton``) is what protobuf's JSON printer
writes for the ``inference.ModelConfig`` message it describes (field names, enums by name,
zero values, message fields only when set, 32-bit floats at their shortest), with 64-bit
integers as numbers: written in plain Python, checked here against the printer itself. The gRPC
front end parses the same mapping into its message."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from google.protobuf import json_format

from gpuserve.config import ModelConfig, parse_model_config
from gpuserve.config.triton import triton_model_config_dict
from gpuserve.protocol.protos import model_config_pb2 as mc

#: 64-bit fields written as numbers (protobuf's printer writes them as strings); the
#: ensemble step's ``model_version`` and ``max_sequence_idle_microseconds`` stay strings, as
#: gpuserve has always answered them.
INT64_AS_NUMBERS = {
    "dims",
    "shape",
    "max_queue_delay_microseconds",
    "default_timeout_microseconds",
    "versions",
    "priority_levels",
    "default_priority_level",
}

BASE: dict[str, Any] = {
    "name": "m",
    "backend": "python",
    "max_batch_size": 4,
    "inputs": [
        {"name": "X", "datatype": "FP32", "shape": [4], "format": "FORMAT_NCHW"},
        {"name": "B", "datatype": "BYTES", "shape": [-1], "optional": True},
    ],
    "outputs": [
        {"name": "Y", "datatype": "FP32", "shape": [4], "label_filename": "labels.txt"},
        {"name": "Z", "datatype": "INT64", "shape": [1]},
    ],
}

SEQUENCE = {
    "max_sequence_idle_us": 123,
    "control_inputs": [
        {"name": "S", "kind": "start", "datatype": "FP32", "false_true": [0.1, 0.3333333333]},
        {"name": "E", "kind": "end", "datatype": "BOOL"},
        {"name": "R", "kind": "ready"},
        {"name": "C", "kind": "corrid", "datatype": "INT64"},
    ],
    "states": [
        {"input_name": "si", "output_name": "so", "datatype": "FP32", "shape": [-1]},
        {"input_name": "s2", "output_name": "o2", "datatype": "INT32", "shape": [3]},
    ],
}

WARMUP = {
    "name": "w",
    "batch_size": 2,
    "count": 3,
    "inputs": {
        "X": {"data_type": "TYPE_FP32", "dims": [4], "zero_data": True},
        "B": {"data_type": "TYPE_STRING", "dims": [1], "random_data": True},
    },
}

CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "reshape": {
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [4], "reshape": [2, 2]}],
        "outputs": [{"name": "Y", "datatype": "FP32", "shape": [1], "reshape": []}],
    },
    "all_versions": {"version_policy": {"all": {}}},
    "specific_versions": {"version_policy": {"specific": {"versions": [1, 3]}}},
    "latest_versions": {"version_policy": {"latest": {"num_versions": 2}}},
    "dynamic_batching": {
        "dynamic_batching": {
            "preferred_batch_sizes": [2, 4],
            "max_queue_delay_us": 100,
            "priority_levels": 3,
            "default_priority_level": 2,
            "default_timeout_us": 5,
            "max_queue_size": 7,
        }
    },
    "decoupled": {"model_transaction_policy": {"decoupled": True}},
    "instances": {
        "instance_group": [{"count": 2, "kind": "cpu"}, {"count": 1, "kind": "gpu", "gpus": [0, 1]}]
    },
    "parameters": {"parameters": {"a": "b", "n": 3}},
    "cuda_graphs": {"optimization": {"cuda_graphs": True}},
    "sequence_oldest": {
        "sequence_batching": {
            **SEQUENCE,
            "oldest": {
                "max_candidate_sequences": 4,
                "preferred_batch_sizes": [2],
                "max_queue_delay_us": 9,
            },
        }
    },
    "sequence_direct": {
        "sequence_batching": {
            **SEQUENCE,
            "direct": {"max_queue_delay_us": 5, "minimum_slot_utilization": 0.7},
        }
    },
    "sequence_default": {"sequence_batching": {}},
    "warmup": {"model_warmup": [WARMUP]},
}

ENSEMBLE: dict[str, Any] = {
    "name": "e",
    "backend": "ensemble",
    "max_batch_size": 4,
    "inputs": [{"name": "X", "datatype": "FP32", "shape": [4]}],
    "outputs": [{"name": "Y", "datatype": "FP32", "shape": [4]}],
    "ensemble": {
        "steps": [
            {"model_name": "a", "input_map": {"IN": "X"}, "output_map": {"OUT": "mid"}},
            {
                "model_name": "b",
                "model_version": 2,
                "input_map": {"IN": "mid"},
                "output_map": {"OUT": "Y"},
            },
        ]
    },
}


def config(data: dict[str, Any]) -> ModelConfig:
    name = data["name"]
    return parse_model_config(data, Path(f"/repo/{name}/config.yaml"), name)


def printed(message: mc.ModelConfig) -> dict[str, Any]:
    """What protobuf's JSON printer writes for ``message``, 64-bit integers as numbers."""
    data = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )

    def numbers(value: Any, key: str = "") -> Any:
        if isinstance(value, dict):
            return {k: numbers(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [numbers(v, key) for v in value]
        if key in INT64_AS_NUMBERS and isinstance(value, str):
            return int(value)
        return value

    result: dict[str, Any] = numbers(data)
    return result


def exact(data: dict[str, Any]) -> bytes:
    """JSON text with sorted keys: tells ``1`` from ``1.0`` and ``True`` (``==`` does not)."""
    return orjson.dumps(data, option=orjson.OPT_SORT_KEYS)


@pytest.mark.parametrize(
    "data",
    [{**BASE, **extra} for extra in CASES.values()] + [ENSEMBLE],
    ids=[*CASES, "ensemble"],
)
def test_the_form_is_what_protobufs_printer_writes_for_its_message(data):
    form = triton_model_config_dict(data["name"], "python", config(data))
    message = json_format.ParseDict(form, mc.ModelConfig())
    assert exact(printed(message)) == exact(form)


def test_the_form_carries_the_fields_triton_clients_read():
    sequence = triton_model_config_dict("m", "python", config({**BASE, **CASES["sequence_direct"]}))
    assert "dynamic_batching" not in sequence
    controls = sequence["sequence_batching"]["control_input"]
    assert controls[0]["control"][0]["fp32_false_true"] == [0.1, 0.33333334]  # float32
    assert controls[3]["control"][0]["data_type"] == "TYPE_INT64"
    assert sequence["sequence_batching"]["direct"]["minimum_slot_utilization"] == 0.7
    decoupled = triton_model_config_dict("m", "python", config({**BASE, **CASES["decoupled"]}))
    assert decoupled["model_transaction_policy"] == {"decoupled": True}
    plain = triton_model_config_dict("m", "onnx", config(BASE))
    assert "model_transaction_policy" not in plain and "reshape" not in plain["input"][0]
    assert plain["input"][1]["data_type"] == "TYPE_STRING" and plain["input"][1]["optional"]
    assert plain["dynamic_batching"]["default_queue_policy"]["max_queue_size"] == 1024
