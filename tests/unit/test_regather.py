"""The regather window of ``early_dispatch`` (engine/regather.py), alone and driving the
dynamic batcher in closed and open loops on a fake clock."""

from __future__ import annotations

import heapq
import random

import numpy as np
import pytest

from gpuserve.config import ModelConfig, TensorSpec
from gpuserve.engine.batcher import DynamicBatcher, Pending
from gpuserve.engine.regather import (
    MIN_RETURNS,
    MIN_WINDOW_S,
    ReturnProbe,
    shares_cpu_with_event_loop,
)
from gpuserve.engine.request import InferenceRequest
from gpuserve.engine.scheduling import SchedulerCore


def item(at: float, key: tuple[int, ...] = (4,)) -> Pending:
    request = InferenceRequest("m", None, {"x": np.zeros((1, key[0]), np.float32)})
    return Pending(request, 1, key, at, None, 1)


def test_the_window_keeps_the_delay_bound_until_answered_clients_come_back_twice():
    probe = ReturnProbe()
    # first batch: nothing judged yet, the window is the smaller of the delay and a tenth
    assert probe.window(0.100, service_s=0.060, rows=16, max_queue_delay_s=0.002) == 0.002
    for k in range(8):  # half of the 16 answered rows are back within a tenth (6 ms)
        probe.arrived(0.101 + 0.0005 * k, 1)
    probe.arrived(0.120, 5)  # later arrivals do not count
    # one probe met: not yet (one batch's returns could be chance)
    assert probe.window(0.160, service_s=0.060, rows=16, max_queue_delay_s=0.002) == 0.002
    probe.arrived(0.161, 8)
    assert probe.window(0.220, 0.060, 16, 0.002) == pytest.approx(0.006)
    assert probe.returns_seen
    probe.arrived(0.221, 7)  # 7 of 16: not a closed loop any more
    assert probe.window(0.280, 0.060, 16, 0.002) == 0.002 and not probe.returns_seen


def test_a_few_arrivals_after_small_batches_prove_nothing():
    """After batches of 1-2 rows, one or two arrivals within a tenth are what Poisson traffic
    brings by chance: fewer than MIN_RETURNS never mark a closed loop."""
    probe = ReturnProbe()
    now = 0.0
    for _ in range(5):
        probe.window(now, 1.0, 2, 0.002)
        probe.arrived(now + 0.01, MIN_RETURNS - 1)
        now += 1.0
    assert probe.window(now, 1.0, 2, 0.002) == 0.002 and not probe.returns_seen


def test_no_window_for_a_zero_delay_or_under_a_timer_tick():
    probe = ReturnProbe()
    for k in range(3):
        probe.window(0.050 * k, 0.050, 4, 0.002)
        probe.arrived(0.050 * k + 0.001, 4)
    assert probe.window(0.150, 0.050, 4, max_queue_delay_s=0.0) == 0.0
    assert probe.returns_seen  # judged all the same
    probe.arrived(0.151, 4)
    assert probe.window(0.160, 0.005, 4, 0.002) == 0.0  # a tenth of 5 ms < 1 ms
    assert MIN_WINDOW_S == 0.001


def test_the_longer_window_is_for_one_cpu_instance_that_fills_the_cores():
    assert shares_cpu_with_event_loop(1, on_gpu=False, threads=1, cpus=1)
    assert shares_cpu_with_event_loop(1, on_gpu=False, threads=8, cpus=8)
    assert not shares_cpu_with_event_loop(1, on_gpu=False, threads=1, cpus=2)  # a core free
    assert not shares_cpu_with_event_loop(2, on_gpu=False, threads=1, cpus=1)
    assert not shares_cpu_with_event_loop(1, on_gpu=True, threads=8, cpus=8)


def run_loop(
    batcher: DynamicBatcher,
    arrivals: list[float],
    service_s,
    turnaround_s: float | None,
    until_s: float,
) -> list[tuple[float, int, list[float]]]:
    """Drive ``batcher`` and one instance on a fake clock.

    Args:
        arrivals: First arrival time of each client (closed loop) or every arrival (open).
        service_s: rows -> seconds a batch takes.
        turnaround_s: A closed loop's time from an answer to the client's next arrival (the
            i-th answered row of a batch comes back i x 0.25 ms later still: the event loop
            answers them one by one); None: open loop.
        until_s: Stop time.

    Returns:
        (start, rows, arrival times of the rows) per batch.
    """
    future = list(arrivals)
    heapq.heapify(future)
    now = 0.0
    batches = []
    while now < until_s:
        while future and future[0] <= now:
            batcher.add(item(heapq.heappop(future)))
        batch = batcher.next_batch(now)
        if batch is None:
            wake = batcher.next_wakeup(can_dispatch=True)
            candidates = [t for t in (wake, future[0] if future else None) if t is not None]
            if not candidates:
                break
            now = max(now, min(candidates))
            continue
        took = service_s(batch.rows)
        batches.append((now, batch.rows, [p.arrival_s for p in batch.items]))
        end = now + took
        # rows that arrive while the batch runs are queued at their arrival times
        while future and future[0] <= end:
            batcher.add(item(heapq.heappop(future)))
        if turnaround_s is not None:
            for k in range(batch.rows):
                heapq.heappush(future, end + turnaround_s + 0.00025 * k)
        now = end
        batcher.instance_freed(now, took, batch.rows)
    return batches


def per_row(rows: int) -> float:
    """A CPU embedding model: 3.5 ms per short sentence, 1 ms per batch."""
    return 0.001 + 0.0035 * rows


def test_a_closed_loop_whose_answers_come_back_late_merges_into_one_batch():
    """32 clients whose answers take 2-10 ms to come back (an HTTP layer on the model's
    core): the 2 ms delay alone leaves the loop in two halves of about 16; once the returns
    are seen the window waits for them and every batch carries all 32."""
    batcher = DynamicBatcher(
        max_batch_size=64, max_queue_delay_s=0.002, early_dispatch=True, regather_beyond_delay=True
    )
    batches = run_loop(batcher, [0.0001 * i for i in range(32)], per_row, 0.002, until_s=3.0)
    sizes = [rows for _, rows, _ in batches]
    assert sizes[-10:] == [32] * 10, sizes
    # each request waits for its batch's window at most: a tenth of a batch, not a batch
    start, _, arrived = batches[-1]
    assert start - min(arrived) <= 0.1 * per_row(32) + 1e-9


def test_without_the_returns_the_same_loop_stays_split():
    """The same loop when the returns take longer than a tenth of a batch (12 ms for 16-row
    batches of 57 ms): nothing is seen, the window keeps the 2 ms bound, batches stay split."""
    batcher = DynamicBatcher(
        max_batch_size=64, max_queue_delay_s=0.002, early_dispatch=True, regather_beyond_delay=True
    )
    batches = run_loop(batcher, [0.0001 * i for i in range(32)], per_row, 0.012, until_s=3.0)
    sizes = [rows for _, rows, _ in batches[-10:]]
    assert max(sizes) < 32 and sum(sizes) == 10 * 32 / 2, sizes


def test_open_loop_arrivals_never_wait_past_the_delay():
    """Poisson arrivals at 60% of the model's capacity: completions bring no one back, the
    window keeps the delay's bound, so no request waits for company longer than the delay
    after its instance could take it."""
    rng = random.Random(7)
    t, arrivals = 0.0, []
    rate = 0.6 / 0.0035
    while t < 5.0:
        t += rng.expovariate(rate)
        arrivals.append(t)
    batcher = DynamicBatcher(
        max_batch_size=64, max_queue_delay_s=0.002, early_dispatch=True, regather_beyond_delay=True
    )
    batches = run_loop(batcher, arrivals, per_row, None, until_s=6.0)
    assert sum(rows for _, rows, _ in batches) == len(arrivals)
    assert not batcher._returns.returns_seen
    previous_end = 0.0
    for start, rows, arrived in batches:
        ready = max(previous_end, min(arrived))  # when the instance could have taken it
        assert start - ready <= 0.002 + 1e-9
        previous_end = start + per_row(rows)


def test_adaptive_batching_keeps_the_delay_bound():
    """Under adaptive batching the delay comes from a latency target: the same closed loop
    keeps the window within it (and stays split), as the config wires it."""

    def config(adaptive: dict | None) -> ModelConfig:
        return ModelConfig(
            name="m",
            backend="python",
            max_batch_size=64,
            inputs=[TensorSpec(name="X", datatype="FP32", shape=[4])],
            outputs=[TensorSpec(name="Y", datatype="FP32", shape=[4])],
            dynamic_batching={"max_queue_delay_us": 2000, "adaptive": adaptive},
        )

    clients = [0.0001 * i for i in range(32)]
    adaptive = DynamicBatcher.for_config(config({"target_p99_ms": 500}), regather_beyond_delay=True)
    batches = run_loop(adaptive, clients, per_row, 0.002, until_s=3.0)
    assert max(rows for _, rows, _ in batches[-10:]) < 32
    plain = config(None)
    merged = run_loop(
        DynamicBatcher.for_config(plain, regather_beyond_delay=True), clients, per_row, 0.002, 3.0
    )
    assert [rows for _, rows, _ in merged[-5:]] == [32] * 5
    # the runner asks for it only where waiting costs the model nothing (the default: no)
    split = run_loop(DynamicBatcher.for_config(plain), clients, per_row, 0.002, 3.0)
    assert max(rows for _, rows, _ in split[-10:]) < 32
    core = SchedulerCore(plain, "1", regather_beyond_delay=True)
    assert isinstance(core.batcher, DynamicBatcher)
    wired = run_loop(core.batcher, clients, per_row, 0.002, 3.0)
    assert [rows for _, rows, _ in wired[-5:]] == [32] * 5


def test_a_window_never_holds_a_batch_of_another_shape():
    """The clients of a finished batch of shape A come back as shape A: a queued batch of
    shape B cannot take them, so it goes at once instead of waiting out a window."""
    batcher = DynamicBatcher(
        max_batch_size=64, max_queue_delay_s=0.002, early_dispatch=True, regather_beyond_delay=True
    )
    for k in range(4):
        batcher.add(item(0.0001 * k, key=(4,)))
    assert batcher.next_batch(0.010).rows == 4  # shape A runs 0.010 .. 0.110
    for k in range(4):
        batcher.add(item(0.050 + 0.0001 * k, key=(8,)))  # shape B queued meanwhile
    batcher.instance_freed(0.110, service_s=0.100, rows=4)
    batch = batcher.next_batch(0.110)
    assert batch is not None and batch.rows == 4 and batch.items[0].shape_key == (8,)


def test_the_rows_expected_back_are_counted_in_the_finished_batch_s_shape():
    """A finished batch of 4 shape-A rows with 3 A and 5 B rows queued: 7 A rows can come
    together (the 3 queued and the 4 answered ones), so the window ends when 7 are there; the
    5 B rows cannot join and are not waited for."""
    batcher = DynamicBatcher(max_batch_size=64, max_queue_delay_s=0.050, early_dispatch=True)
    for k in range(4):
        batcher.add(item(0.0001 * k))
    assert batcher.next_batch(0.050).rows == 4  # runs 0.050 .. 0.150
    for k in range(3):
        batcher.add(item(0.060 + 0.0001 * k))
    for k in range(5):
        batcher.add(item(0.061 + 0.0001 * k, key=(8,)))
    batcher.instance_freed(0.150, service_s=0.100, rows=4)  # window min(50 ms, 10 ms)
    assert batcher.next_batch(0.150) is None  # 3 of the 7 A rows expected
    for _ in range(4):
        batcher.add(item(0.152))
    batch = batcher.next_batch(0.152)  # before the window's end (0.160)
    assert batch is not None and batch.rows == 7 and {p.shape_key for p in batch.items} == {(4,)}
