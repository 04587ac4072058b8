"""The dynamic batcher as a pure state machine, on a fake clock."""

from __future__ import annotations

import numpy as np
import pytest

from gpuserve.engine.batch import Batch, BatchResult
from gpuserve.engine.batcher import DynamicBatcher, Pending
from gpuserve.engine.request import InferenceRequest
from gpuserve.errors import OverloadedError


def item(
    rows: int = 1,
    at: float = 0.0,
    key: object = (16,),
    priority: int = 1,
    deadline: float | None = None,
    tag: str = "",
) -> Pending:
    request = InferenceRequest("m", None, {"x": np.zeros((rows, 16), np.float32)}, id=tag)
    return Pending(request, rows, key, at, deadline, priority)


def tags(batch) -> list[str]:
    return [p.request.id for p in batch.items]


def test_zero_delay_sends_whatever_is_queued_at_once():
    b = DynamicBatcher(max_batch_size=8)
    b.add(item(tag="a"))
    b.add(item(tag="b"))
    batch = b.next_batch(now=0.0)
    assert batch is not None and tags(batch) == ["a", "b"] and batch.rows == 2
    assert len(b) == 0 and b.next_batch(0.0) is None


def test_delay_waits_for_the_leading_request_then_sends():
    b = DynamicBatcher(max_batch_size=8, max_queue_delay_s=0.010)
    b.add(item(at=0.0, tag="a"))
    assert b.next_batch(now=0.005) is None
    assert b.next_wakeup(can_dispatch=True) == pytest.approx(0.010)
    b.add(item(at=0.006, tag="b"))
    batch = b.next_batch(now=0.010)
    assert tags(batch) == ["a", "b"]


def test_full_batch_goes_without_waiting_and_respects_max_rows():
    b = DynamicBatcher(max_batch_size=4, max_queue_delay_s=10.0)
    for i, rows in enumerate([1, 3, 2, 1]):
        b.add(item(rows=rows, tag=str(i)))
    batch = b.next_batch(now=0.0)
    assert batch.rows == 4 and tags(batch) == ["0", "1"]
    # 2 + 1 = 3 rows left, not full: waits for the delay
    assert b.next_batch(now=1.0) is None
    batch = b.next_batch(now=10.0)
    assert tags(batch) == ["2", "3"] and batch.rows == 3


def test_requests_that_do_not_fit_are_skipped_not_split():
    b = DynamicBatcher(max_batch_size=4)
    b.add(item(rows=3, tag="a"))
    b.add(item(rows=3, tag="b"))
    b.add(item(rows=1, tag="c"))
    assert tags(b.next_batch(0.0)) == ["a", "c"]
    assert tags(b.next_batch(0.0)) == ["b"]


def test_preferred_batch_size_sends_before_the_delay():
    b = DynamicBatcher(max_batch_size=16, max_queue_delay_s=10.0, preferred_batch_sizes=[4, 8])
    for i in range(3):
        b.add(item(tag=str(i)))
    assert b.next_batch(0.0) is None
    for i in range(3, 6):
        b.add(item(tag=str(i)))
    batch = b.next_batch(0.0)
    assert batch.rows == 4 and tags(batch) == ["0", "1", "2", "3"]


def test_different_shapes_are_never_stacked_together():
    b = DynamicBatcher(max_batch_size=8)
    b.add(item(key=(10,), tag="short1"))
    b.add(item(key=(20,), tag="long"))
    b.add(item(key=(10,), tag="short2"))
    assert tags(b.next_batch(0.0)) == ["short1", "short2"]
    assert tags(b.next_batch(0.0)) == ["long"]


def test_priority_level_one_is_served_first():
    b = DynamicBatcher(max_batch_size=1, priority_levels=2)
    b.add(item(priority=2, tag="low"))
    b.add(item(priority=1, at=1.0, tag="high"))
    assert tags(b.next_batch(2.0)) == ["high"]
    assert tags(b.next_batch(2.0)) == ["low"]


def test_full_queue_refuses_at_once():
    b = DynamicBatcher(max_batch_size=8, max_queue_size=2)
    b.add(item())
    b.add(item())
    with pytest.raises(OverloadedError, match="full"):
        b.add(item())
    assert len(b) == 2


def test_expired_requests_leave_the_queue_and_are_never_batched():
    b = DynamicBatcher(max_batch_size=8, max_queue_delay_s=1.0)
    b.add(item(tag="a", deadline=0.3))
    b.add(item(tag="b"))
    assert b.next_wakeup(can_dispatch=False) == pytest.approx(0.3)
    assert [p.request.id for p in b.expire(0.5)] == ["a"]
    assert tags(b.next_batch(1.0)) == ["b"]


def test_a_timer_fired_at_next_wakeup_finds_the_batch_due():
    # 0.04 + 0.05 is a hair above 0.09 in binary: the due check adds the same way
    b = DynamicBatcher(max_batch_size=8, max_queue_delay_s=0.05)
    b.add(item(at=0.04, tag="a"))
    wake = b.next_wakeup(can_dispatch=True)
    assert b.next_batch(wake - 1e-9) is None
    assert tags(b.next_batch(wake)) == ["a"]


def test_deadlines_are_known_without_expiring():
    b = DynamicBatcher(max_batch_size=8)
    b.add(item(tag="a"))
    assert not b.has_deadlines
    b.add(item(tag="b", deadline=1.0))
    assert b.has_deadlines
    assert [p.request.id for p in b.expire(1.0)] == ["b"] and not b.has_deadlines


def test_removed_request_is_not_batched_and_its_deadline_is_forgotten():
    b = DynamicBatcher(max_batch_size=8, max_queue_delay_s=1.0)
    a = item(tag="a", deadline=0.2)
    b.add(a)
    b.add(item(tag="b"))
    assert b.remove(a) and not b.remove(a)
    assert b.next_wakeup(can_dispatch=False) is None
    assert b.expire(5.0) == []
    assert tags(b.next_batch(1.0)) == ["b"]


def test_model_without_batching_runs_one_request_per_batch():
    b = DynamicBatcher(max_batch_size=0, max_queue_delay_s=1.0)
    b.add(item(rows=1, tag="a"))
    b.add(item(rows=1, tag="b"))
    assert tags(b.next_batch(0.0)) == ["a"]
    assert tags(b.next_batch(0.0)) == ["b"]


def test_counts_rows_and_drains():
    b = DynamicBatcher(max_batch_size=8, max_queue_delay_s=1.0)
    b.add(item(rows=3))
    b.add(item(rows=2))
    assert b.queued_rows == 5 and len(b) == 2
    assert len(b.drain()) == 2 and len(b) == 0 and b.queued_rows == 0


def test_requests_whose_client_left_are_dropped_not_batched():
    b = DynamicBatcher(max_batch_size=8)
    gone = {"b": True, "c": False}
    for tag in ("a", "b", "c"):
        it = item(tag=tag)
        if tag in gone:
            it.request.is_cancelled = lambda tag=tag: gone[tag]
        b.add(it)
    assert not b.has_cancelled
    batch = b.next_batch(0.0)
    assert tags(batch) == ["a", "c"]
    assert b.has_cancelled
    assert [p.request.id for p in b.take_cancelled()] == ["b"]
    assert b.take_cancelled() == [] and len(b) == 0 and not b.has_cancelled


def test_early_dispatch_sends_once_the_previous_batch_size_is_queued():
    b = DynamicBatcher(max_batch_size=8, max_queue_delay_s=0.002, early_dispatch=True)
    for i in range(3):
        b.add(item(tag=str(i)))
    assert b.next_batch(0.0) is None  # nothing learnt yet: wait out the delay
    assert b.next_batch(0.002).rows == 3
    for i in range(3):
        b.add(item(at=0.0021, tag=f"b{i}"))
    batch = b.next_batch(0.0021)  # as many as last time: no need to wait
    assert batch is not None and batch.rows == 3
    b.add(item(at=0.003, tag="c"))
    assert b.next_batch(0.003) is None  # fewer than last time: wait (bounded by the delay)
    assert b.next_batch(0.005).rows == 1


def test_a_straggler_regathers_when_an_instance_frees_instead_of_running_alone():
    """Closed loop of 8 clients: one request arrived while a batch of 7 ran. When the batch
    finishes the straggler is overdue, but it waits (up to the regather window) for the 7
    clients that just got their answers, so the loop settles at batches of 8, not 7 + 1."""
    b = DynamicBatcher(max_batch_size=8, max_queue_delay_s=0.002, early_dispatch=True)
    for i in range(7):
        b.add(item(tag=f"a{i}"))
    assert b.next_batch(0.002).rows == 7
    b.add(item(at=0.010, tag="straggler"))  # the batch of 7 runs 0.002 .. 0.052
    b.instance_freed(0.052, service_s=0.050, rows=7)
    assert b.next_batch(0.052) is None  # overdue, but the window is open
    assert b.next_wakeup(can_dispatch=True) == pytest.approx(0.054)
    for i in range(7):
        b.add(item(at=0.0526, tag=f"b{i}"))
    batch = b.next_batch(0.0526)
    assert batch is not None and batch.rows == 8 and tags(batch)[0] == "straggler"


def test_regather_window_is_bounded_by_a_tenth_of_the_batch_time_and_the_delay():
    b = DynamicBatcher(max_batch_size=8, max_queue_delay_s=0.010, early_dispatch=True)
    b.add(item(tag="x"))
    b.add(item(tag="y"))
    assert b.next_batch(0.010).rows == 2
    b.add(item(at=0.011, tag="late"))
    b.instance_freed(0.020, service_s=0.010, rows=2)  # window: min(10 ms, 1 ms)
    assert b.next_batch(0.0205) is None
    batch = b.next_batch(0.021)
    assert batch is not None and tags(batch) == ["late"]  # nobody came: it goes alone
    # a window under a timer tick (1 ms) is not opened: fast batches do not wait a tick
    b.add(item(at=0.021, tag="fast"))
    b.instance_freed(0.030, service_s=0.005, rows=1)
    assert tags(b.next_batch(0.030)) == ["fast"]
    # without early dispatch there is no window
    plain = DynamicBatcher(max_batch_size=8, max_queue_delay_s=0.010)
    plain.add(item(tag="p"))
    plain.instance_freed(0.0, service_s=1.0, rows=1)
    assert tags(plain.next_batch(0.010)) == ["p"]


def test_two_halves_merge_on_one_instance_but_not_across_two():
    """4 + 4 on one instance: when a half finishes, its 4 clients come back and join the 4
    queued, so the next batch has 8. With two instances the other half is still running, so
    only the rows of the finished batch are expected and 4 go at once."""
    b = DynamicBatcher(max_batch_size=8, max_queue_delay_s=0.002, early_dispatch=True)
    for i in range(4):
        b.add(item(tag=f"a{i}"))
    assert b.next_batch(0.002).rows == 4
    for i in range(4):
        b.add(item(at=0.003, tag=f"b{i}"))  # arrive while the first half runs
    b.instance_freed(0.030, service_s=0.028, rows=4)  # window min(2 ms, 2.8 ms)
    assert b.next_batch(0.030) is None  # 4 queued, 8 expected
    for i in range(4):
        b.add(item(at=0.031, tag=f"c{i}"))
    assert b.next_batch(0.031).rows == 8
    # two instances: b-rows run on the second instance; the first frees with nothing queued
    two = DynamicBatcher(max_batch_size=8, max_queue_delay_s=0.002, early_dispatch=True)
    for i in range(4):
        two.add(item(tag=f"a{i}"))
    assert two.next_batch(0.002).rows == 4
    two.instance_freed(0.030, service_s=0.028, rows=4)  # queue empty: no window
    for i in range(4):
        two.add(item(at=0.031, tag=f"c{i}"))
    assert two.next_batch(0.031).rows == 4  # as many as last time: at once


# -- the bulk lane's sizing (engine/bulk_policy.py) -------------------------------------------

BULK = 2  # the bulk level of a batcher with one priority level


def text(rows: int, length: int, at: float = 0.0, tag: str = "", priority: int = 1) -> Pending:
    """A queued request of ``rows`` rows of ``length`` tokens each."""
    p = item(rows, at, key=("text",), priority=priority, tag=tag)
    p.length = length
    p.tokens = rows * length
    return p


def trained(b: DynamicBatcher) -> DynamicBatcher:
    """``b`` after measuring batches of 5 ms + 0.1 ms per padded token (20 and 100 tokens)."""
    for padded, seconds in [(20, 0.007), (100, 0.015)] * 3:
        batch = Batch([], 1, 0.0, tokens=padded, padded_tokens=padded)
        b.ran(BatchResult(batch, started_s=1.0, finished_s=1.0 + seconds), 0.0)
    return b


def test_the_bulk_cost_fit_is_learned_from_finished_batches():
    b = trained(DynamicBatcher(max_batch_size=64, max_batch_tokens=512))
    a, per_token = b.bulk_policy.cost.coefficients()
    assert a == pytest.approx(0.005) and per_token == pytest.approx(0.0001)


def test_a_bulk_led_batch_is_sized_to_the_compute_budget_while_interactive_traffic_is_about():
    b = trained(
        DynamicBatcher(
            max_batch_size=64, max_batch_tokens=512, bulk_max_compute_s=0.010, bulk_quiet_s=1.0
        )
    )
    b.add(text(1, 10, at=0.0, tag="i"))
    assert tags(b.next_batch(0.0)) == ["i"]  # interactive traffic seen at t=0
    for n in range(8):
        b.add(text(2, 10, at=0.1, tag=f"b{n}", priority=BULK))
    # 10 ms budget: 5 ms fixed + 50 padded tokens, two chunks of 2 x 10 tokens
    assert tags(b.next_batch(0.5)) == ["b0", "b1"]
    # no interactive arrival for a second: the whole token budget (here: what is queued)
    assert tags(b.next_batch(1.5)) == [f"b{n}" for n in range(2, 8)]


def test_bulk_fill_of_an_interactive_batch_adds_at_most_half_the_budget():
    b = trained(
        DynamicBatcher(max_batch_size=64, max_batch_tokens=512, bulk_max_compute_s=0.010)
    )
    for n in range(8):
        b.add(text(2, 10, at=0.0, tag=f"b{n}", priority=BULK))
    b.add(text(1, 10, at=0.2, tag="i"))
    # 10 tokens of its own + 5 ms of fill (50 tokens): two chunks of 20
    assert tags(b.next_batch(0.2)) == ["i", "b0", "b1"]


def test_before_any_batch_is_measured_bulk_runs_one_chunk_at_a_time_and_fills_nothing():
    b = DynamicBatcher(max_batch_size=64, max_batch_tokens=512)
    for n in range(4):
        b.add(text(2, 10, at=0.0, tag=f"b{n}", priority=BULK))
    b.add(text(1, 10, at=0.1, tag="i"))
    assert tags(b.next_batch(0.1)) == ["i"]
    assert tags(b.next_batch(0.2)) == ["b0"]
    assert tags(b.next_batch(1.2)) == ["b1", "b2", "b3"]  # quiet again: all of them


def test_bulk_rows_without_costs_are_sized_in_rows():
    b = DynamicBatcher(max_batch_size=64, bulk_max_compute_s=0.010, bulk_quiet_s=1.0)
    for rows, seconds in [(1, 0.006), (9, 0.014)] * 3:  # 5 ms + 1 ms per row
        b.ran(BatchResult(Batch([], rows, 0.0), started_s=0.0, finished_s=seconds), 0.0)
    for n in range(10):
        b.add(item(2, at=0.0, priority=BULK, tag=f"b{n}"))
    b.add(item(1, at=0.0, tag="i"))
    # fill: half of 10 ms at 1 ms per row, 5 rows: two chunks of 2
    assert tags(b.next_batch(0.0)) == ["i", "b0", "b1"]
    assert tags(b.next_batch(0.1)) == ["b2", "b3"]  # lead: 5 ms + 5 rows: two chunks
    assert tags(b.next_batch(2.0)) == [f"b{n}" for n in range(4, 10)]


def test_a_zero_quiet_time_turns_the_bound_off():
    b = trained(DynamicBatcher(max_batch_size=64, max_batch_tokens=512, bulk_quiet_s=0.0))
    for n in range(4):
        b.add(text(2, 10, at=0.0, tag=f"b{n}", priority=BULK))
    b.add(text(1, 10, at=0.0, tag="i"))
    assert tags(b.next_batch(0.0)) == ["i", "b0", "b1", "b2", "b3"]
