"""A decoupled model's config takes every setting of the one execution path its requests share
with every other model's (the scheduling core, its batcher and its watchdog): an execution
timeout, a token budget and adaptive batching load, and reach the core the version runs on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpuserve.backends.base import Capabilities
from gpuserve.config.model import ModelConfig, parse_model_config
from gpuserve.engine.batcher import DynamicBatcher
from gpuserve.engine.scheduling import SchedulerCore
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


def test_the_settings_of_the_one_execution_path_load_and_reach_the_core():
    config = parse_model_config(
        decoupled(
            execution_timeout_s=1.5,
            dynamic_batching={"max_batch_tokens": 64, "adaptive": {"target_p99_ms": 20}},
        ),
        PATH,
        "stream",
    )
    core = SchedulerCore(config, "1", Capabilities(streams=True, streams_batches=True))
    assert core.streams and core.execution_timeout_s == 1.5
    assert core.adaptive is not None and core.adaptive.target_p99_s == 0.02
    assert isinstance(core.batcher, DynamicBatcher)
    assert core.batcher.max_batch_tokens == 64 and core.batcher.max_batch_size == 4


def test_a_backend_that_streams_one_request_per_call_gets_batches_of_one():
    config = parse_model_config(decoupled(dynamic_batching={}), PATH, "stream")
    core = SchedulerCore(config, "1", Capabilities(streams=True))  # a generator model
    assert isinstance(core.batcher, DynamicBatcher) and core.batcher.max_batch_size == 0


def test_a_decoupled_model_with_the_queue_settings_loads():
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
    assert SchedulerCore(loaded, "1").execution_timeout_s is None


def test_a_model_that_is_not_decoupled_keeps_all_three():
    config = decoupled(
        execution_timeout_s=5,
        dynamic_batching={"max_batch_tokens": 256, "adaptive": {"target_p99_ms": 50}},
        model_transaction_policy={"decoupled": False},
    )
    loaded = ModelConfig.model_validate(config)
    assert loaded.execution_timeout_s == 5 and loaded.dynamic_batching.max_batch_tokens == 256


def test_sequence_batching_on_a_decoupled_model_is_refused_naming_both():
    with pytest.raises(ConfigError) as caught:
        parse_model_config(
            decoupled(sequence_batching={"max_sequence_idle_us": 1000000}),
            PATH,
            "stream",
        )
    message = str(caught.value)
    assert "sequence_batching" in message and "decoupled" in message
