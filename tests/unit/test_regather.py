"""The regather window of ``early_dispatch`` (engine/regather.py), alone and driving the
dynamic batcher in closed and open loops on a fake clock."""

from __future__ import annotations

import heapq
import random

import numpy as np
import pytest

from gpuserve.config import ModelConfig, TensorSpec
from gpuserve.engine.batcher import DynamicBatcher, Pending
from gpuserve.engine.regather import MIN_WINDOW_S, ReturnProbe
from gpuserve.engine.request import InferenceRequest


def item(at: float) -> Pending:
    request = InferenceRequest("m", None, {"x": np.zeros((1, 4), np.float32)})
    return Pending(request, 1, (4,), at, None, 1)


def test_the_window_keeps_the_delay_bound_until_answered_clients_come_back():
    probe = ReturnProbe()
    # first batch: nothing judged yet, the window is the smaller of the delay and a tenth
    assert probe.window(0.100, service_s=0.060, rows=16, max_queue_delay_s=0.002) == 0.002
    for k in range(8):  # half of the 16 answered rows are back within a tenth (6 ms)
        probe.arrived(0.101 + 0.0005 * k, 1)
    probe.arrived(0.120, 5)  # later arrivals do not count
    assert probe.window(0.160, service_s=0.060, rows=16, max_queue_delay_s=0.002) == (
        pytest.approx(0.006)
    )
    assert probe.returns_seen
    probe.arrived(0.161, 7)  # 7 of 16: not a closed loop any more
    assert probe.window(0.220, 0.060, 16, 0.002) == 0.002 and not probe.returns_seen


def test_no_window_for_a_zero_delay_or_under_a_timer_tick():
    probe = ReturnProbe()
    probe.window(0.0, 0.050, 4, 0.002)
    probe.arrived(0.001, 4)
    assert probe.window(0.050, 0.050, 4, max_queue_delay_s=0.0) == 0.0
    assert probe.returns_seen  # judged all the same
    probe.arrived(0.051, 4)
    assert probe.window(0.060, 0.005, 4, 0.002) == 0.0  # a tenth of 5 ms < 1 ms
    assert MIN_WINDOW_S == 0.001


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
    batcher = DynamicBatcher(max_batch_size=64, max_queue_delay_s=0.002, early_dispatch=True)
    batches = run_loop(batcher, [0.0001 * i for i in range(32)], per_row, 0.002, until_s=3.0)
    sizes = [rows for _, rows, _ in batches]
    assert sizes[-10:] == [32] * 10, sizes
    # each request waits for its batch's window at most: a tenth of a batch, not a batch
    start, _, arrived = batches[-1]
    assert start - min(arrived) <= 0.1 * per_row(32) + 1e-9


def test_without_the_returns_the_same_loop_stays_split():
    """The same loop when the returns take longer than a tenth of a batch (12 ms for 16-row
    batches of 57 ms): nothing is seen, the window keeps the 2 ms bound, batches stay split."""
    batcher = DynamicBatcher(max_batch_size=64, max_queue_delay_s=0.002, early_dispatch=True)
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
    batcher = DynamicBatcher(max_batch_size=64, max_queue_delay_s=0.002, early_dispatch=True)
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
    adaptive = DynamicBatcher.for_config(config({"target_p99_ms": 500}))
    batches = run_loop(adaptive, clients, per_row, 0.002, until_s=3.0)
    assert max(rows for _, rows, _ in batches[-10:]) < 32
    plain = run_loop(DynamicBatcher.for_config(config(None)), clients, per_row, 0.002, 3.0)
    assert [rows for _, rows, _ in plain[-5:]] == [32] * 5
