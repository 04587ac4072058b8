"""A decoupled model's config is refused at load when it sets what the decoupled path does not
honour (an execution timeout, a token budget, adaptive batching), naming the setting; every
other setting it may carry loads as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpuserve.config.model import ModelConfig, parse_model_config
from gpuserve.errors import ConfigError

PATH = Path("models/stream/config.yaml")


def decoupled(**extra: Any) -> dict[str, Any]:
    return {
        "backend": "python",
        "max_batch_size": 4,
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [2]}],
        "outputs": [{"name": "Y", "datatype": "FP32", "shape": [2]}],
        "model_transaction_policy": {"decoupled": True},
        **extra,
    }


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"execution_timeout_s": 5}, "execution_timeout_s=5"),
        ({"dynamic_batching": {"max_batch_tokens": 256}}, "dynamic_batching.max_batch_tokens=256"),
        ({"dynamic_batching": {"adaptive": {"target_p99_ms": 50}}}, "dynamic_batching.adaptive"),
    ],
)
def test_a_setting_the_decoupled_path_does_not_honour_is_refused_naming_it(extra, named):
    with pytest.raises(ConfigError) as refused:
        parse_model_config(decoupled(**extra), PATH, "stream")
    message = str(refused.value)
    assert str(PATH) in message and named in message, message
    assert "model_transaction_policy.decoupled" in message, message


def test_every_unhonoured_setting_is_named_at_once():
    config = decoupled(
        execution_timeout_s=1.5,
        dynamic_batching={"max_batch_tokens": 64, "adaptive": {"target_p99_ms": 20}},
    )
    with pytest.raises(ConfigError) as refused:
        parse_model_config(config, PATH, "stream")
    message = str(refused.value)
    for named in ("execution_timeout_s=1.5", "max_batch_tokens=64", "dynamic_batching.adaptive"):
        assert named in message, message


def test_a_decoupled_model_with_the_settings_it_honours_loads():
    config = decoupled(
        execution_timeout_s=0,  # the default: off
        dynamic_batching={
            "max_queue_delay_us": 500,
            "preferred_batch_sizes": [2, 4],
            "max_queue_size": 8,
            "default_timeout_us": 1000,
        },
        parameters={"anything": "else"},
    )
    loaded = parse_model_config(config, PATH, "stream")
    assert loaded.model_transaction_policy.decoupled


def test_a_model_that_is_not_decoupled_keeps_all_three():
    config = decoupled(
        execution_timeout_s=5,
        dynamic_batching={"max_batch_tokens": 256, "adaptive": {"target_p99_ms": 50}},
        model_transaction_policy={"decoupled": False},
    )
    loaded = ModelConfig.model_validate(config)
    assert loaded.execution_timeout_s == 5 and loaded.dynamic_batching.max_batch_tokens == 256
