"""``sequence_batching`` in config.yaml and in Triton's config.pbtxt: mapped, validated, and
refused with the file, the field and the value named."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuserve.config import parse_model_config
from gpuserve.errors import ConfigError
from gpuserve.repository.triton.pbtxt import parse_text
from gpuserve.repository.triton.config import load_triton_config, triton_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "sequence" / "model_repository"

BASE = {
    "backend": "python",
    "inputs": [{"name": "X", "datatype": "FP32", "shape": [1]}],
    "outputs": [{"name": "Y", "datatype": "FP32", "shape": [1]}],
}


def yaml_config(**sequence):
    return parse_model_config({**BASE, "sequence_batching": sequence}, Path("m/config.yaml"), "m")


def test_the_example_configs_map_as_triton_means_them() -> None:
    simple = load_triton_config(EXAMPLES / "simple_sequence" / "config.pbtxt")
    seq = simple.sequence_batching
    assert seq is not None and seq.strategy == "direct" and seq.max_sequence_idle_us == 5_000_000
    assert [(c.name, c.kind, c.dtype_name, c.values) for c in seq.control_inputs] == [
        ("START", "start", "INT32", (0, 1)),
        ("READY", "ready", "INT32", (0, 1)),
    ]
    dyna = load_triton_config(EXAMPLES / "simple_dyna_sequence" / "config.pbtxt").sequence_batching
    assert dyna is not None and dyna.oldest is not None
    assert (dyna.oldest.max_candidate_sequences, dyna.oldest.preferred_batch_sizes) == (16, [4])
    assert dyna.oldest.max_queue_delay_us == 500
    assert [(c.kind, c.dtype_name) for c in dyna.control_inputs] == [
        ("start", "FP32"),
        ("end", "FP32"),
        ("ready", "FP32"),
        ("corrid", "UINT64"),
    ]
    strings = load_triton_config(EXAMPLES / "simple_string_dyna_sequence" / "config.pbtxt")
    assert strings.sequence_batching is not None
    assert strings.sequence_batching.control_inputs[-1].dtype_name == "BYTES"


def test_pbtxt_state_and_bool_controls() -> None:
    text = (
        'backend: "python" max_batch_size: 4 '
        'input { name: "x" data_type: TYPE_FP32 dims: [1] } '
        'output { name: "y" data_type: TYPE_FP32 dims: [1] } '
        "sequence_batching { direct { max_queue_delay_microseconds: 100 "
        "minimum_slot_utilization: 0.5 } "
        'control_input { name: "S" control { kind: CONTROL_SEQUENCE_START '
        "bool_false_true: [false, true] } } "
        'state { input_name: "h_in" output_name: "h_out" data_type: TYPE_FP32 dims: [-1] '
        "initial_state { data_type: TYPE_FP32 dims: [3] zero_data: true } } }"
    )
    config = triton_config(parse_text(text, Path("c.pbtxt")), Path("c.pbtxt"), "m")
    seq = config.sequence_batching
    assert seq is not None and seq.direct is not None
    assert (seq.direct.max_queue_delay_us, seq.direct.minimum_slot_utilization) == (100, 0.5)
    assert seq.control_inputs[0].dtype_name == "BOOL"
    assert seq.states[0].shape == [-1] and seq.states[0].start_shape == (3,)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            "sequence_batching { iterative_sequence: true }",
            "field 'sequence_batching.iterative_sequence': not supported by gpuserve",
        ),
        (
            "sequence_batching { direct { } oldest { max_candidate_sequences: 1 } }",
            "field 'sequence_batching.oldest': set one strategy",
        ),
        (
            "sequence_batching { oldest { } }",
            "field 'sequence_batching.oldest.max_candidate_sequences': must be a positive",
        ),
        (
            'sequence_batching { control_input { name: "S" control { kind: CONTROL_X } } }',
            "field 'sequence_batching.control_input[0].control[0].kind': expected one of",
        ),
        (
            'sequence_batching { control_input { name: "S" control { '
            "kind: CONTROL_SEQUENCE_START int32_false_true: [0] } } }",
            "field 'sequence_batching.control_input[0].control[0].int32_false_true': expected "
            "two values",
        ),
        (
            'sequence_batching { state { input_name: "a" output_name: "b" data_type: TYPE_FP32 '
            'dims: [1] initial_state { data_file: "f" } } }',
            "field 'sequence_batching.state[0].initial_state.data_file': not supported",
        ),
        (
            'sequence_batching { control_input { name: "x" control { '
            "kind: CONTROL_SEQUENCE_READY fp32_false_true: [0, 1] } } }",
            "'x' is also a declared input",
        ),
    ],
)
def test_pbtxt_refusals_name_the_file_and_field(extra: str, message: str) -> None:
    text = (
        'backend: "python" max_batch_size: 4 input { name: "x" data_type: TYPE_FP32 dims: [1] } '
        'output { name: "y" data_type: TYPE_FP32 dims: [1] } ' + extra
    )
    path = Path("repo/m/config.pbtxt")
    with pytest.raises(ConfigError) as caught:
        triton_config(parse_text(text, path), path, "m")
    assert str(caught.value).startswith(str(path)), caught.value
    assert message in str(caught.value), caught.value


@pytest.mark.parametrize(
    ("sequence", "message"),
    [
        ({"direct": {}, "oldest": {}}, "set one strategy, direct or oldest, not both"),
        (
            {"control_inputs": [{"name": "S", "kind": "begin"}]},
            "field 'sequence_batching.control_inputs.0.kind'",
        ),
        (
            {"control_inputs": [{"name": "S", "kind": "start", "datatype": "INT64"}]},
            "datatype must be one of INT32, FP32, BOOL",
        ),
        (
            {"control_inputs": [{"name": "C", "kind": "corrid", "datatype": "FP32"}]},
            "UINT64, INT64, UINT32, INT32, BYTES",
        ),
        (
            {"control_inputs": [{"name": "S", "kind": "start"}, {"name": "T", "kind": "start"}]},
            "one control input per kind",
        ),
        ({"control_inputs": [{"name": "X", "kind": "ready"}]}, "'X' is also a declared input"),
        (
            {"states": [{"input_name": "s", "output_name": "Y", "datatype": "FP32", "shape": [1]}]},
            "output 'Y' is also a declared output",
        ),
        (
            {
                "states": [
                    {"input_name": "s", "output_name": "t", "datatype": "BYTES", "shape": [1]}
                ]
            },
            "BYTES states are not supported",
        ),
        (
            {"oldest": {"preferred_batch_sizes": [16]}},
            "preferred_batch_sizes entry 16 exceeds max_batch_size=8",
        ),
        ({"max_sequence_idle_us": 0}, "field 'sequence_batching.max_sequence_idle_us'"),
        ({"max_idle_us": 5}, "did you mean 'max_sequence_idle_us'?"),
    ],
)
def test_yaml_refusals_name_the_file_field_and_value(sequence: dict, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        yaml_config(**sequence)
    assert str(caught.value).startswith("m/config.yaml: invalid model configuration")
    assert message in str(caught.value), caught.value


def test_dynamic_and_sequence_batching_together_are_refused() -> None:
    data = {**BASE, "dynamic_batching": {"max_queue_delay_us": 5}, "sequence_batching": {}}
    with pytest.raises(ConfigError, match="dynamic_batching or sequence_batching, not both"):
        parse_model_config(data, Path("m/config.yaml"), "m")


def test_yaml_defaults() -> None:
    seq = yaml_config().sequence_batching
    assert seq is not None and seq.strategy == "direct" and seq.max_sequence_idle_us == 1_000_000
