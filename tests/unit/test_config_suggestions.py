"""Unknown configuration keys name the nearest valid key (issue 19): in every section, when a
``config.yaml`` is read at load, and in ``gpuserve models validate``."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuserve.cli.main import main
from gpuserve.config import ModelConfig, load_model_config, parse_model_config
from gpuserve.config.keys import nearest, section_fields, unknown_key_hint
from gpuserve.errors import ConfigError
from tests.fixtures.lifecycle_support import make_repository

BASE = {"backend": "onnx"}


def problem(data: dict) -> str:
    with pytest.raises(ConfigError) as err:
        parse_model_config({**BASE, **data}, Path("m/config.yaml"), "m")
    return err.value.message


@pytest.mark.parametrize(
    ("data", "field", "suggestion"),
    [
        ({"max_batch_sise": 8}, "max_batch_sise", "max_batch_size"),
        (
            {"dynamic_batching": {"max_queue_delay_uss": 5}},
            "dynamic_batching",
            "max_queue_delay_us",
        ),
        (
            {"dynamic_batching": {"default_timeout_ms": 5}},
            "default_timeout_ms",
            "default_timeout_us",
        ),
        ({"inputs": [{"nam": "x", "datatype": "FP32", "shape": [1]}]}, "inputs.0.nam", "name"),
        ({"version_policy": {"latest": {"num_version": 2}}}, "num_version", "num_versions"),
        ({"canary": {"version": 2, "wieght": 0.1}}, "canary.wieght", "weight"),
        ({"dynamic_batching": {"adaptive": {"target_p99": 5}}}, "target_p99", "target_p99_ms"),
        ({"instance_group": [{"cout": 2}]}, "instance_group.0.cout", "count"),
        ({"huggingface": {"taks": "feature-extraction"}}, "huggingface.taks", "task"),
        ({"Backend": "onnx"}, "Backend", "backend"),
    ],
)
def test_a_typo_names_the_nearest_valid_key_of_its_section(data, field, suggestion):
    message = problem(data)
    assert field in message
    assert f"did you mean '{suggestion}'?" in message


def test_no_near_key_lists_the_section_and_free_form_mappings_stay_free():
    message = problem({"optimization": {"zzzzz": 1}})
    assert "the fields here are: channels_last, compile," in message
    parse_model_config({**BASE, "parameters": {"anything_at_all": 1}}, Path("c"), "m")
    assert unknown_key_hint(ModelConfig, ("parameters", "x")) == ""
    assert section_fields(ModelConfig, ("nope",)) is None


def test_nearest_is_case_insensitive_and_keeps_the_valid_spelling():
    assert nearest("MAX_BATCH_SIZE", ["max_batch_size", "backend"]) == "max_batch_size"
    assert nearest("qqq", ["max_batch_size"]) is None


def test_at_load_and_in_models_validate(tmp_path, capsys):
    repo = make_repository(tmp_path / "repo", "double4_fp32")
    config = repo / "double4_fp32" / "config.yaml"
    config.write_text(config.read_text().replace("max_batch_size:", "max_batch_sise:"))
    with pytest.raises(ConfigError, match="did you mean 'max_batch_size'"):
        load_model_config(config)
    assert main(["models", "validate", "--model-repository", str(repo)]) == 1
    assert "did you mean 'max_batch_size'?" in capsys.readouterr().out
