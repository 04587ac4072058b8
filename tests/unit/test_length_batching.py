"""Length-aware, token-budget batch formation (engine/lengths.py + the batcher), fake clock."""

from __future__ import annotations

import random

import numpy as np
import pytest

from gpuserve.backends.base import Capabilities
from gpuserve.config import ModelConfig
from gpuserve.engine.batch import Pending
from gpuserve.engine.batcher import DynamicBatcher
from gpuserve.engine.lengths import (
    CPU_BATCH_TOKENS,
    GPU_BATCH_TOKENS,
    fits_lengths,
    select_group,
)
from gpuserve.engine.request import InferenceRequest, RequestCost
from gpuserve.engine.scheduling import SchedulerCore


def text_item(lengths: list[int], at: float = 0.0, tag: str = "", priority: int = 1) -> Pending:
    """A queued text request of ``len(lengths)`` rows with those token lengths."""
    rows = len(lengths)
    request = InferenceRequest(
        "m",
        None,
        {"TEXT": np.array([[b"x"]] * rows, dtype=object)},
        id=tag,
        cost=RequestCost(tuple(lengths)),
    )
    item = Pending(request, rows, (("TEXT", (1,)),), at, None, priority)
    item.length = max(lengths)
    item.tokens = sum(lengths)
    return item


def tags(batch) -> list[str]:
    return [p.request.id for p in batch.items]


def test_similar_lengths_join_and_far_lengths_wait_for_their_own_batch():
    b = DynamicBatcher(max_batch_size=32, max_batch_tokens=4096)
    for tag, length in [("s1", 12), ("long", 250), ("s2", 14), ("s3", 11), ("l2", 240)]:
        b.add(text_item([length], tag=tag))
    first = b.next_batch(now=0.0)
    assert sorted(tags(first)) == ["s1", "s2", "s3"]
    assert first.rows == 3 and first.tokens == 37 and first.padded_tokens == 3 * 14
    second = b.next_batch(now=0.0)
    assert sorted(tags(second)) == ["l2", "long"]
    assert second.padded_tokens == 2 * 250 and second.tokens == 490
    assert len(b) == 0


def test_the_oldest_request_always_leads_so_a_long_one_is_not_starved():
    b = DynamicBatcher(max_batch_size=32, max_batch_tokens=4096)
    b.add(text_item([256], at=0.0, tag="long"))
    for i in range(20):
        b.add(text_item([10], at=0.001 * (i + 1), tag=f"s{i}"))
    first = b.next_batch(now=0.1)
    assert tags(first) == ["long"]  # the leader goes first, alone: nothing of its length
    second = b.next_batch(now=0.1)
    assert len(second.items) == 20


def test_token_budget_bounds_padded_tokens_and_marks_the_batch_full():
    b = DynamicBatcher(max_batch_size=64, max_queue_delay_s=10.0, max_batch_tokens=1024)
    for i in range(10):
        b.add(text_item([200], at=0.0, tag=f"c{i}"))
    batch = b.next_batch(now=0.0)  # full by tokens: sent although the delay has not run out
    assert batch is not None and batch.rows == 5 and batch.padded_tokens == 1000
    assert b.next_batch(now=0.0).rows == 5


def test_a_leader_over_the_budget_still_runs_alone():
    b = DynamicBatcher(max_batch_size=8, max_batch_tokens=100)
    b.add(text_item([256, 256], tag="big"))
    b.add(text_item([250], tag="other"))
    batch = b.next_batch(now=0.0)
    assert tags(batch) == ["big"] and batch.padded_tokens == 512
    assert tags(b.next_batch(now=0.0)) == ["other"]


def test_rows_limit_still_applies_to_cost_carrying_requests():
    b = DynamicBatcher(max_batch_size=4, max_batch_tokens=10_000)
    for i in range(6):
        b.add(text_item([20], tag=f"r{i}"))
    assert b.next_batch(now=0.0).rows == 4
    assert b.next_batch(now=0.0).rows == 2


def test_group_waits_for_the_delay_when_it_is_not_full():
    b = DynamicBatcher(max_batch_size=32, max_queue_delay_s=0.005, max_batch_tokens=4096)
    b.add(text_item([30], at=0.0, tag="a"))
    assert b.next_batch(now=0.001) is None
    b.add(text_item([31], at=0.002, tag="b"))
    assert b.next_batch(now=0.004) is None
    assert sorted(tags(b.next_batch(now=0.005))) == ["a", "b"]


def test_early_dispatch_counts_rows_of_any_length():
    """In a closed loop the previous batch's rows coming back are all that is coming, even
    if some of them go in another length group: no waiting out the delay."""
    b = DynamicBatcher(
        max_batch_size=32, max_queue_delay_s=1.0, early_dispatch=True, max_batch_tokens=4096
    )
    for i in range(4):
        b.add(text_item([20], at=0.0, tag=f"a{i}"))
    assert b.next_batch(now=1.0).rows == 4  # waited out; sets the expectation to 4 rows
    b.add(text_item([20], at=1.1, tag="x"))
    b.add(text_item([20], at=1.1, tag="y"))
    b.add(text_item([200], at=1.1, tag="z"))
    assert b.next_batch(now=1.2) is None  # 3 rows queued < 4 expected
    b.add(text_item([210], at=1.2, tag="w"))
    batch = b.next_batch(now=1.2)
    assert batch is not None and sorted(tags(batch)) == ["x", "y"]


def test_cancelled_requests_are_dropped_while_a_group_forms():
    b = DynamicBatcher(max_batch_size=8, max_batch_tokens=4096)
    lead = text_item([10], tag="lead")
    gone = text_item([10], tag="gone")
    gone.request.is_cancelled = lambda: True
    b.add(lead)
    b.add(gone)
    batch = b.next_batch(now=0.0)
    assert tags(batch) == ["lead"]
    assert b.take_cancelled() == [gone] and len(b) == 0


def test_lower_priority_items_join_by_length_and_priority_order_breaks_ties():
    b = DynamicBatcher(max_batch_size=2, max_batch_tokens=4096, priority_levels=2)
    b.add(text_item([20], tag="low", priority=2))
    b.add(text_item([20], tag="high-lead", priority=1))
    b.add(text_item([20], tag="high", priority=1))
    assert tags(b.next_batch(now=0.0)) == ["high-lead", "high"]
    assert tags(b.next_batch(now=0.0)) == ["low"]


def test_requests_without_cost_batch_by_arrival_as_before():
    b = DynamicBatcher(max_batch_size=8, max_batch_tokens=16)
    request = InferenceRequest("m", None, {"x": np.zeros((3, 4), np.float32)}, id="plain")
    b.add(Pending(request, 3, (("x", (4,)),), 0.0))
    batch = b.next_batch(now=0.0)
    assert tags(batch) == ["plain"] and batch.tokens == 0 and batch.padded_tokens == 0


def test_select_group_prefers_the_nearest_lengths():
    head = text_item([100], tag="head")
    others = [text_item([n], tag=f"n{n}") for n in (60, 99, 130, 101, 90, 300)]
    group = select_group(head, others, row_limit=3, max_tokens=None)
    assert [i.request.id for i in group.items] == ["head", "n99", "n101"]
    assert group.full and group.longest == 101


def test_fits_lengths_ratio_and_slack():
    assert fits_lengths(1, 9)  # short texts: a few tokens of padding are fine
    assert not fits_lengths(10, 30)
    assert fits_lengths(100, 130) and not fits_lengths(100, 139)


def test_random_mixes_never_exceed_limits_and_every_request_runs_once():
    rng = random.Random(7)
    b = DynamicBatcher(max_batch_size=16, max_queue_delay_s=0.002, max_batch_tokens=1024)
    added: list[str] = []
    seen: list[str] = []
    now = 0.0
    for _step in range(400):
        now += 0.001
        for _ in range(rng.randint(0, 3)):
            lengths = [rng.randint(2, 256) for _ in range(rng.randint(1, 3))]
            tag = f"r{len(added)}"
            added.append(tag)
            b.add(text_item(lengths, at=now, tag=tag))
        batch = b.next_batch(now)
        if batch is not None:
            assert batch.rows <= 16
            longest = max(i.length for i in batch.items)
            assert len(batch.items) == 1 or batch.padded_tokens <= 1024
            assert batch.padded_tokens == batch.rows * longest
            shortest = min(i.length for i in batch.items)
            assert fits_lengths(shortest, longest) or len(batch.items) == 1
            seen.extend(tags(batch))
    while len(b):
        now += 0.01
        batch = b.next_batch(now)
        assert batch is not None
        seen.extend(tags(batch))
    assert sorted(seen) == sorted(added) and len(seen) == len(set(seen))


@pytest.mark.parametrize(
    ("on_gpu", "budget"), [(False, CPU_BATCH_TOKENS), (True, GPU_BATCH_TOKENS)]
)
def test_the_default_budget_follows_the_instances_device(on_gpu, budget):
    config = ModelConfig.model_validate(
        {
            "name": "m",
            "backend": "python",
            "max_batch_size": 8,
            "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1]}],
            "outputs": [{"name": "Y", "datatype": "FP32", "shape": [1]}],
        }
    )
    core: SchedulerCore = SchedulerCore(config, "1", Capabilities(), on_gpu)
    core.attach([])
    assert core.batcher.max_batch_tokens == budget


def test_a_configured_budget_is_kept_and_admission_reads_the_cost():
    config = ModelConfig.model_validate(
        {
            "name": "m",
            "backend": "python",
            "max_batch_size": 8,
            "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1]}],
            "outputs": [{"name": "Y", "datatype": "FP32", "shape": [1]}],
            "dynamic_batching": {"max_batch_tokens": 300},
        }
    )
    core: SchedulerCore = SchedulerCore(config, "1", Capabilities(), on_gpu=True)
    core.attach([])
    assert core.batcher.max_batch_tokens == 300
    request = InferenceRequest(
        "m",
        None,
        {"TEXT": np.array([[b"a"], [b"b"]], dtype=object)},
        cost=RequestCost((7, 40)),
    )
    item = core.admit(request, now=0.0)
    assert item.length == 40 and item.tokens == 47


def test_unpadded_batches_ignore_lengths_and_count_real_tokens():
    b = DynamicBatcher(max_batch_size=32, max_batch_tokens=300, unpadded=True)
    for tag, length in [("a", 10), ("b", 250), ("c", 12), ("d", 100)]:
        b.add(text_item([length], tag=tag))
    batch = b.next_batch(now=0.0)
    assert tags(batch) == ["a", "b", "c"]  # arrival order, 272 real tokens <= 300
    assert batch.tokens == 272 and batch.padded_tokens == 272  # no padding is computed
    assert tags(b.next_batch(now=0.0)) == ["d"]
