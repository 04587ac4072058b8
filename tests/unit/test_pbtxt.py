"""Triton's ``config.pbtxt`` (and its JSON form in a load request) read onto gpuserve's
configuration: what is served, and a load error naming file and field for what is not."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuserve.errors import ConfigError
from gpuserve.repository.triton.pbtxt import parse_text
from gpuserve.repository.scan import read_model, scan_repository
from gpuserve.repository.triton.config import (
    is_triton_config,
    load_triton_config,
    triton_config_from_json,
)

SIMPLE = """
name: "simple"   # Triton's example model
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "INPUT1", data_type: TYPE_INT32, dims: [ 16 ], optional: true }
]
output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ -1 ] reshape { shape: [ -1 ] } } ]
dynamic_batching {
  preferred_batch_size: [ 2, 4 ]
  max_queue_delay_microseconds: 100
  priority_levels: 3
  default_priority_level: 2
  default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 5000
                         max_queue_size: 16 }
}
instance_group [ { count: 2 kind: KIND_CPU }, { kind: KIND_GPU gpus: [ 0, 1 ] } ]
version_policy: { specific { versions: [ 1, 3 ] } }
parameters { key: "alpha" value { string_value: "0.5" } }
parameters: { key: "mode" value: { string_value: "fast" } }
optimization { cuda { graphs: true } input_pinned_memory { enable: true } }
default_model_filename: "model.onnx"
model_warmup [ { name: "w" batch_size: 1 inputs { key: "INPUT0"
  value { data_type: TYPE_INT32 dims: [ 16 ] zero_data: true } } } ]
"""


def write(tmp_path: Path, text: str, name: str = "simple") -> Path:
    folder = tmp_path / name
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.onnx").write_bytes(b"x")
    (folder / "config.pbtxt").write_text(text)
    return folder / "config.pbtxt"


def test_parse_text_reads_lists_repeats_nesting_and_scalars():
    tree = parse_text('a: 1 a: -2 b [3, 4] c { d: "x" "y" e: TYPE_FP32 f: true g: 1.5 }', Path("t"))
    assert tree["a"] == [1, -2] and tree["b"] == [3, 4]
    (c,) = tree["c"]
    assert c == {"d": ["xy"], "e": ["TYPE_FP32"], "f": [True], "g": [1.5]}


def test_parse_errors_name_the_file_and_position():
    with pytest.raises(ConfigError, match=r"^cfg\.pbtxt: not valid protobuf text format: .*1:"):
        parse_text("input { name: ", Path("cfg.pbtxt"))


def test_every_supported_field_maps_onto_gpuserve(tmp_path):
    config = load_triton_config(write(tmp_path, SIMPLE))
    assert (config.name, config.backend, config.max_batch_size) == ("simple", "onnx", 8)
    assert [(t.name, t.datatype, t.shape, t.optional) for t in config.inputs] == [
        ("INPUT0", "INT32", [16], False),
        ("INPUT1", "INT32", [16], True),
    ]
    assert [(t.name, t.datatype, t.shape) for t in config.outputs] == [("OUTPUT0", "BYTES", [-1])]
    db = config.dynamic_batching
    assert (db.preferred_batch_sizes, db.max_queue_delay_us) == ([2, 4], 100)
    assert (db.priority_levels, db.default_priority_level) == (3, 2)
    assert (db.default_timeout_us, db.max_queue_size) == (5000, 16)
    groups = [(g.count, g.kind, g.gpus) for g in config.instance_group]
    assert groups == [(2, "cpu", []), (1, "gpu", [0, 1])]
    assert config.version_policy.specific is not None
    assert config.version_policy.specific.versions == [1, 3]
    assert config.parameters == {"alpha": "0.5", "mode": "fast"}
    assert config.optimization.cuda_graphs is True


@pytest.mark.parametrize(
    ("platform", "backend"),
    [
        ('platform: "onnxruntime_onnx"', "onnx"),
        ('backend: "onnxruntime"', "onnx"),
        ('platform: "pytorch_libtorch"', "torch"),
        ('backend: "pytorch"', "torch"),
        ('backend: "python"', "python"),
    ],
)
def test_platforms_and_backends(tmp_path, platform, backend):
    text = f'{platform}\ninput {{ name: "x" data_type: TYPE_FP32 dims: [1] }}\n'
    text += 'output { name: "y" data_type: TYPE_FP32 dims: [1] }\n'
    config = load_triton_config(write(tmp_path, text))
    assert config.backend == backend
    assert config.max_batch_size == 0  # Triton's default: no batching


TENSORS = (
    'backend: "python" input { name: "x" data_type: TYPE_FP32 dims: [1] } '
    'output { name: "y" data_type: TYPE_FP32 dims: [1] } '
)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            "sequence_batching { iterative_sequence: true }",
            "field 'sequence_batching.iterative_sequence': not supported by gpuserve",
        ),
        ("ensemble_scheduling { }", "field 'ensemble_scheduling': needs platform \"ensemble\""),
        ("response_cache { enable: true }", "field 'response_cache': not supported by gpuserve"),
        (
            "dynamic_batching { priority_queue_policy { key: 1 value { } } }",
            "field 'dynamic_batching.priority_queue_policy': not supported by gpuserve",
        ),
        (
            "dynamic_batching { default_queue_policy { timeout_action: DELAY } }",
            "field 'dynamic_batching.default_queue_policy.timeout_action': only REJECT",
        ),
        (
            "instance_group { kind: KIND_MODEL }",
            "field 'instance_group[0].kind': expected one of KIND_AUTO, KIND_GPU, KIND_CPU "
            "(given: 'KIND_MODEL')",
        ),
        (
            "instance_group { rate_limiter { } }",
            "field 'instance_group[0].rate_limiter': not supported by gpuserve",
        ),
        (
            'default_model_filename: "weights.bin"',
            "field 'default_model_filename': gpuserve's backend 'python' loads model.py",
        ),
        (
            "optimization { execution_accelerators { } }",
            "field 'optimization.execution_accelerators': not supported by gpuserve",
        ),
        ("no_such_field: 1", "field 'no_such_field': not a ModelConfig field gpuserve knows"),
    ],
)
def test_unsupported_fields_are_refused_naming_file_and_field(tmp_path, extra, message):
    path = write(tmp_path, TENSORS + extra)
    with pytest.raises(ConfigError) as err:
        load_triton_config(path)
    assert err.value.message.startswith(f"{path}: {message}")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            'platform: "tensorrt_plan"',
            "field 'platform': not served by gpuserve (supported: ensemble, onnxruntime, "
            "onnxruntime_onnx, python, pytorch, pytorch_libtorch) (given: 'tensorrt_plan')",
        ),
        (
            'backend: "python" input { name: "x" data_type: TYPE_BF16 dims: [1] }',
            "field 'input[0].data_type': expected one of TYPE_BOOL",
        ),
        (
            'backend: "python" input { name: "x" data_type: TYPE_FP32 dims: [0] }',
            "field 'input[0].dims': each dim must be a positive integer or -1 (given: [0])",
        ),
        (
            'backend: "python" input { name: "x" data_type: TYPE_FP32 dims: [4] '
            "reshape { shape: [2, 3] } }",
            "field 'input[0].reshape': reshape [2, 3] holds 6 elements, but dims [4] hold 4: "
            "they must hold the same number (given: [2, 3])",
        ),
        (
            'backend: "python" input { name: "x" data_type: TYPE_FP32 dims: [3] } '
            'output { name: "y" data_type: TYPE_FP32 dims: [3] label_filename: "../labels.txt" }',
            "invalid model configuration",
        ),
        ('backend: "python" max_batch_size: "x"', "field 'max_batch_size': expected an integer"),
    ],
)
def test_bad_values_name_file_field_and_value(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_triton_config(path)
    assert err.value.message.startswith(f"{path}: {message}")


def test_values_gpuserve_refuses_go_through_its_validation(tmp_path):
    path = write(
        tmp_path, TENSORS + "max_batch_size: 2 dynamic_batching { preferred_batch_size: 4 }"
    )
    with pytest.raises(ConfigError, match="preferred_batch_sizes entry 4 exceeds max_batch_size=2"):
        load_triton_config(path)
    path = write(tmp_path, TENSORS + 'name: "other"', name="mine")
    with pytest.raises(ConfigError, match="must equal the model folder name 'mine'"):
        load_triton_config(path)


def test_the_repository_finds_config_pbtxt_and_prefers_config_yaml(tmp_path):
    write(tmp_path, SIMPLE)
    both = write(tmp_path, TENSORS, name="both").parent
    (both / "config.yaml").write_text("backend: onnx\nmax_batch_size: 4\ninputs: []\noutputs: []\n")
    entries = {e.name: e for e in scan_repository(tmp_path)}
    assert entries["simple"].error is None and entries["simple"].versions == [1]
    assert entries["simple"].config is not None and entries["simple"].config.backend == "onnx"
    assert entries["both"].config is not None and entries["both"].config.max_batch_size == 4
    assert read_model(tmp_path / "simple").config == entries["simple"].config


def test_a_load_override_in_tritons_json_schema(tmp_path):
    write(tmp_path, SIMPLE)
    override = {
        "name": "simple",
        "platform": "onnxruntime_onnx",
        "maxBatchSize": 4,
        "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": ["16"]}],
        "output": [{"name": "OUTPUT0", "dataType": "TYPE_FP32", "dims": [16]}],
        "instance_group": [{"kind": "KIND_CPU", "count": 1}],
        "parameters": {"k": {"string_value": "v"}},
    }
    assert is_triton_config(override)
    assert not is_triton_config({"backend": "onnx", "inputs": [], "max_batch_size": 4})
    entry = read_model(tmp_path / "simple", override)
    assert entry.config is not None
    assert (entry.config.max_batch_size, entry.config.inputs[0].shape) == (4, [16])
    assert entry.config.instance_group[0].kind == "cpu"
    assert entry.config.parameters == {"k": "v"}
    with pytest.raises(ConfigError, match=r"^<load>: field 'sequence_batching.iterative_sequence'"):
        sequence = {"backend": "python", "sequence_batching": {"iterativeSequence": True}}
        triton_config_from_json(sequence, Path("<load>"), "m")
