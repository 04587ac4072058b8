"""The runner contract's pure parts: capabilities merged once at load, the factory's choice of
runner, batchers built complete (token budget, unpadded) and the sequence batcher's budget.

No sockets, no threads: fake instances carry the capabilities their backends declared.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from gpuserve.backends.base import Admitted, Capabilities
from gpuserve.config import ModelConfig, TensorSpec
from gpuserve.engine.batcher import DynamicBatcher
from gpuserve.engine.lengths import default_batch_tokens
from gpuserve.engine.request import InferenceRequest, RequestCost
from gpuserve.engine.runners.batching import BatchingRunner
from gpuserve.engine.runners.factory import BatchRelay, build_runner
from gpuserve.engine.runners.streaming import StreamingRunner
from gpuserve.engine.scheduling import SchedulerCore
from gpuserve.engine.sequence.batcher import SequenceBatcher
from gpuserve.errors import ConfigError, InvalidInputError


@dataclass
class Context:
    device: str = "cpu"


@dataclass(eq=False)
class FakeInstance:
    capabilities: Capabilities = field(default_factory=Capabilities)
    context: Context = field(default_factory=Context)
    name: str = "m:1#0"
    capacity: int = 1
    in_flight: int = 0

    def submit(self, batch) -> None:
        self.in_flight += 1

    def stop(self) -> None:
        pass

    def start_trace(self, batches: int, directory: Path) -> None:
        pass


def config(**extra) -> ModelConfig:
    return ModelConfig(
        name="m",
        backend="python",
        max_batch_size=8,
        inputs=[TensorSpec(name="X", datatype="FP32", shape=[4])],
        outputs=[TensorSpec(name="Y", datatype="FP32", shape=[4])],
        **extra,
    )


def step(inputs):
    return Admitted((1,) * len(inputs["X"]))


def test_capabilities_of_a_version_are_what_every_instance_can_do():
    a = Capabilities(streams=True, unpadded=True, takes_tensors=True, admission=step)
    b = Capabilities(streams=True, unpadded=False, takes_tensors=True)
    merged = Capabilities.common([a, b])
    assert merged.streams and merged.takes_tensors and not merged.unpadded
    assert merged.admission is step  # hooks: the first instance's (the same model)
    assert Capabilities.common([a]) is a
    assert Capabilities.common([]) == Capabilities()


def run_factory(cfg: ModelConfig, *instances: FakeInstance):
    async def go():
        relay = BatchRelay()
        runner = build_runner(cfg, "1", list(instances), asyncio.get_running_loop(), relay)
        return runner, relay

    return asyncio.run(go())


def test_the_factory_picks_the_runner_once_from_config_and_capabilities():
    runner, relay = run_factory(config(), FakeInstance())
    assert isinstance(runner, BatchingRunner) and runner.kind == "batching"
    assert relay.runner is runner  # the instances' results reach it
    decoupled = config(model_transaction_policy={"decoupled": True})
    streaming, relay = run_factory(decoupled, FakeInstance(Capabilities(streams=True)))
    assert isinstance(streaming, StreamingRunner) and streaming.kind == "streaming"
    assert streaming.core.streams  # the same scheduling core, its requests answered as streams
    assert relay.runner is streaming  # its calls' results reach it as any batch's
    with pytest.raises(ConfigError, match="cannot stream responses"):
        run_factory(decoupled, FakeInstance())


def test_the_batcher_is_built_complete_for_the_device_and_the_capabilities():
    runner, _ = run_factory(config(), FakeInstance(Capabilities(unpadded=True)))
    batcher = runner.core.batcher
    assert isinstance(batcher, DynamicBatcher)
    assert batcher.unpadded and batcher.max_batch_tokens == default_batch_tokens(False)
    gpu, _ = run_factory(config(), FakeInstance(context=Context("cuda:0")))
    assert gpu.core.batcher.max_batch_tokens == default_batch_tokens(True)
    budget = config(dynamic_batching={"max_batch_tokens": 96})
    fixed, _ = run_factory(budget, FakeInstance(context=Context("cuda:0")))
    assert fixed.core.batcher.max_batch_tokens == 96
    assert not fixed.core.batcher.unpadded


def test_the_admission_step_runs_in_the_runner_for_every_caller():
    seen: list[int] = []

    def measure(inputs):
        if inputs["X"][0, 0] < 0:
            raise InvalidInputError("input 'X': negative")
        seen.append(len(inputs["X"]))
        return Admitted((3,) * len(inputs["X"]))

    async def go():
        instance = FakeInstance(Capabilities(admission=measure))
        runner = build_runner(config(), "1", [instance], asyncio.get_running_loop(), BatchRelay())
        request = InferenceRequest("m", None, {"X": np.ones((2, 4), np.float32)})
        runner.submit(request)
        assert request.cost == RequestCost((3, 3)) and seen == [2]
        bad = InferenceRequest("m", None, {"X": -np.ones((1, 4), np.float32)})
        with pytest.raises(InvalidInputError, match="negative"):
            runner.submit(bad)
        assert runner.stats.fail_reasons["invalid"] == 1  # counted on the version

    asyncio.run(go())


def sequence_config(budget: int) -> ModelConfig:
    return ModelConfig(
        name="seq",
        backend="python",
        max_batch_size=4,
        inputs=[TensorSpec(name="X", datatype="FP32", shape=[1])],
        outputs=[TensorSpec(name="Y", datatype="FP32", shape=[1])],
        sequence_batching={
            "oldest": {"max_candidate_sequences": 8},
            "max_batch_tokens": budget,
        },
    )


def seq_request(sid: int, tokens: int) -> InferenceRequest:
    request = InferenceRequest(
        "seq",
        None,
        {"X": np.ones((1, 1), np.float32)},
        parameters={"sequence_id": sid, "sequence_start": True, "sequence_end": False},
    )
    request.cost = RequestCost((tokens,))
    return request


@pytest.mark.parametrize(("budget", "sizes"), [(100, [2, 1, 1]), (10_000, [4])])
def test_the_sequence_batcher_keeps_a_batch_within_the_token_budget(budget, sizes):
    core: SchedulerCore[FakeInstance] = SchedulerCore(sequence_config(budget), "1")
    assert isinstance(core.batcher, SequenceBatcher) and core.batcher.max_batch_tokens == budget
    instance = FakeInstance()
    instance.capacity = 8
    core.attach([instance])
    for sid, tokens in ((1, 40), (2, 50), (3, 60), (4, 30)):
        core.admit(seq_request(sid, tokens), 0.0)
    formed = [len(record.batch.items) for record in core.schedule(0.0).dispatched]
    # 2 x 50 = 100 fits; 60 starts the next (2 x 60 > 100), 30 joins none with 60 beside it
    assert formed == sizes
