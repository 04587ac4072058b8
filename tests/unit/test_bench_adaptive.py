"""Adaptive batching: the pure policy on a fake clock, with the batcher, and in the scheduler."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from gpuserve.backends.base import Backend, LoadContext
from gpuserve.config import ModelConfig, TensorSpec
from gpuserve.engine.adaptive import AdaptiveBatching
from gpuserve.engine.batcher import DynamicBatcher, Pending
from gpuserve.engine.instance import Instance
from gpuserve.engine.request import InferenceRequest
from gpuserve.engine.runners.batching import ModelScheduler

A, B = 0.005, 0.002  # fake model: a batch of n rows takes 5 ms + 2 ms per row


def cost(rows: int) -> float:
    return A + B * rows


def item(at: float, rows: int = 1) -> Pending:
    request = InferenceRequest("m", None, {"x": np.zeros((rows, 4), np.float32)})
    return Pending(request, rows, (4,), at)


def trained(target_s: float = 0.050, spread_s: float = 0.0, max_batch: int = 64):
    policy = AdaptiveBatching(target_s, max_batch, initial_delay_s=0.5)
    for rows in (1, 2, 4, 8, 16, 3, 6, 12):
        policy.observe_values(rows, spread_s, cost(rows))
    return policy


def test_fits_the_linear_batch_cost():
    a, b = trained().cost()
    assert a == pytest.approx(A, rel=1e-6) and b == pytest.approx(B, rel=1e-6)


def test_cap_is_the_largest_batch_that_fits_the_budget():
    policy = trained()  # budget 0.8 * 50 ms = 40 ms; 5 + 2n <= 40 -> n <= 17.5
    assert policy.best_cap() == 17
    decision = policy.decide(queued_rows=3)
    assert decision.row_cap == 17


def test_before_any_measurement_the_configured_delay_is_kept_without_cap():
    policy = AdaptiveBatching(0.050, 64, initial_delay_s=0.004)
    decision = policy.decide(queued_rows=0)
    assert decision.max_queue_delay_s == 0.004 and decision.row_cap is None


def test_a_lone_client_gets_no_delay():
    policy = trained(spread_s=0.0)
    assert policy.decide(queued_rows=1).max_queue_delay_s == 0.0


def test_delay_follows_gathering_time_up_to_the_batch_overhead():
    # max batch 8: cap 8 (no cap needed), c(8) = 21 ms leaves 19 ms of the 40 ms budget
    gathering = trained(spread_s=0.002, max_batch=8).decide(queued_rows=2)
    assert gathering.row_cap is None
    assert gathering.max_queue_delay_s == pytest.approx(1.5 * 0.002)
    slow = trained(spread_s=0.010, max_batch=8).decide(queued_rows=2)
    assert slow.max_queue_delay_s == pytest.approx(A)  # never wait longer than a batch costs
    tight = AdaptiveBatching(0.050, 64)  # batches of 16 are typical: c = 37 ms, 3 ms left
    for _ in range(30):
        for rows in (15, 16, 17):
            tight.observe_values(rows, 0.010, cost(rows))
    assert tight.decide(queued_rows=2).max_queue_delay_s == pytest.approx(0.003, rel=0.15)


def test_a_backlog_lifts_the_cap_and_the_delay():
    decision = trained(spread_s=0.002).decide(queued_rows=18)
    assert decision.row_cap is None and decision.max_queue_delay_s == 0.0


def test_a_flat_cost_means_no_cap():
    policy = AdaptiveBatching(0.050, 32)
    for rows in (1, 4, 16, 32):
        policy.observe_values(rows, 0.0, 0.010)
    assert policy.best_cap() == 32 and policy.decide(1).row_cap is None


def test_one_batch_size_seen_assumes_proportional_cost():
    policy = AdaptiveBatching(0.050, 64)
    for _ in range(5):
        policy.observe_values(4, 0.0, 0.008)
    a, b = policy.cost()
    assert a == 0.0 and b == pytest.approx(0.002)


def test_old_batches_fade_from_the_fit():
    policy = trained()
    for rows in (1, 2, 4, 8) * 40:  # the model got 3x slower per row
        policy.observe_values(rows, 0.0, A + 3 * B * rows)
    assert policy.cost()[1] == pytest.approx(3 * B, rel=0.05)


def test_the_batcher_obeys_the_policy_on_a_fake_clock():
    """Requests trickle in 2 ms apart; a fixed 50 ms delay would hold the first for 50 ms,
    the adaptive batcher waits only as long as a batch's overhead (5 ms)."""
    batcher = DynamicBatcher(max_batch_size=8, max_queue_delay_s=0.050)
    policy = trained(spread_s=0.010, max_batch=8)  # delay min(15 ms, a = 5 ms, 19 ms)
    results = []
    for now in (0.0, 0.002, 0.004, 0.006):
        batcher.add(item(now))
        policy.apply(batcher)
        results.append(batcher.next_batch(now))
    assert batcher.max_queue_delay_s == pytest.approx(0.005)
    assert results[:3] == [None, None, None]
    assert results[3] is not None and results[3].rows == 4


def test_the_cap_sends_full_batches_without_waiting():
    batcher = DynamicBatcher(max_batch_size=64, max_queue_delay_s=1.0)
    policy = trained(spread_s=0.010)  # cap 17
    for i in range(17):
        batcher.add(item(0.0001 * i))
    policy.apply(batcher)
    batch = batcher.next_batch(0.002)
    assert batch is not None and batch.rows == 17


def test_observe_reads_rows_and_gathering_time_from_the_batch():
    batcher = DynamicBatcher(max_batch_size=8)
    for at in (0.0, 0.002, 0.003):
        batcher.add(item(at))
    batch = batcher.next_batch(0.003)
    policy = AdaptiveBatching(0.050, 8)
    policy.observe(batch, 0.011)
    assert policy.batches == 1 and policy._spread_s == pytest.approx(0.003)
    assert policy.predict_s(3) == pytest.approx(0.011)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        AdaptiveBatching(0.0, 8)
    with pytest.raises(ValueError):
        AdaptiveBatching(0.05, 8, headroom=1.5)


class Doubler(Backend):
    def load(self, context: LoadContext) -> None:
        pass

    def preprocess(self, inputs):
        return inputs["INPUT0"]

    def forward(self, x):
        time.sleep(0.002)
        return x * 2

    def postprocess(self, y):
        return {"OUTPUT0": y}


def test_scheduler_with_adaptive_config_stops_waiting_for_company_that_never_comes():
    config = ModelConfig(
        name="double",
        max_batch_size=8,
        inputs=[TensorSpec(name="INPUT0", datatype="FP32", shape=[4])],
        outputs=[TensorSpec(name="OUTPUT0", datatype="FP32", shape=[4])],
        dynamic_batching={"max_queue_delay_us": 300_000, "adaptive": {"target_p99_ms": 50}},
    )

    async def main() -> list[float]:
        scheduler = ModelScheduler(config, "1")
        context = LoadContext(config=config, version_path=Path("."), version=1)
        instance = Instance("double:1#0", Doubler(), context, scheduler.on_batch_done)
        instance.start()
        scheduler.attach([instance], asyncio.get_running_loop())
        took = []
        for _ in range(3):
            start = time.monotonic()
            x = np.ones((1, 4), np.float32)
            response = await scheduler.infer(InferenceRequest("double", None, {"INPUT0": x}))
            assert np.array_equal(response.outputs["OUTPUT0"], x * 2)
            took.append(time.monotonic() - start)
        await scheduler.close(5.0)
        return took

    took = asyncio.run(main())
    assert took[0] >= 0.29  # the configured delay, before anything was measured
    assert max(took[1:]) < 0.1  # a lone client: the policy dropped the delay
