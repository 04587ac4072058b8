"""The scheduling core on a fake clock: every timing behaviour of the scheduler, no threads.

Instances are fake workers; a test plays the instance by building the BatchResult itself
(``run`` doubles the inputs through the real assembly functions), at whatever time it likes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from gpuserve.config import ModelConfig, TensorSpec
from gpuserve.engine.assembly import OutputMismatch, OutputSpec, split_outputs, stack_inputs
from gpuserve.engine.batch import BatchResult, Pending
from gpuserve.engine.request import InferenceRequest, InferenceResponse
from gpuserve.engine.scheduling import InFlight, SchedulerCore
from gpuserve.engine.stats import BatchStats, RequestStats
from gpuserve.errors import (
    BackendError,
    CancelledRequestError,
    GpuserveError,
    InvalidInputError,
    OutOfMemoryError,
    OverloadedError,
    RequestTimeoutError,
    UnavailableError,
)


@dataclass(eq=False)
class Worker:
    name: str
    capacity: int = 1
    in_flight: int = 0


def config(max_batch_size: int = 8, timeout_s: float = 0.0, **batching) -> ModelConfig:
    return ModelConfig(
        name="double",
        max_batch_size=max_batch_size,
        execution_timeout_s=timeout_s,
        inputs=[TensorSpec(name="INPUT0", datatype="FP32", shape=[4])],
        outputs=[TensorSpec(name="OUTPUT0", datatype="FP32", shape=[4])],
        dynamic_batching=batching,
    )


def core_with(
    *workers: Worker, cfg: ModelConfig | None = None
) -> tuple[SchedulerCore[Worker], list[object]]:
    core: SchedulerCore[Worker] = SchedulerCore(cfg or config(), "1")
    events: list[object] = []
    core.stats.listeners.append(events.append)
    core.attach(list(workers) or [Worker("w0")])
    return core, events


def request(rows: int = 1, value: float = 0.0, **kwargs) -> InferenceRequest:
    x = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) + value
    return InferenceRequest("double", None, {"INPUT0": x}, **kwargs)


def run(
    record: InFlight[Worker], started: float, finished: float, fail_value: float | None = None
) -> BatchResult:
    """What an instance doubling its inputs reports; rows starting with ``fail_value`` get a
    row error (as a RowErrors-returning model's)."""
    batch = record.batch
    x = stack_inputs(batch.items)["INPUT0"]
    rows = [] if fail_value is None else np.flatnonzero(x[:, 0] == fail_value).tolist()
    spec = OutputSpec("double", ("OUTPUT0",), batched=True)
    results = split_outputs(spec, batch.items, {"OUTPUT0": x * 2}, dict.fromkeys(rows, "marker"))
    return BatchResult(
        batch, results, started_s=started, finished_s=finished, forward_s=finished - started
    )


def failed(
    record: InFlight[Worker], error: GpuserveError, retryable: bool = True, at: float = 0.0
) -> BatchResult:
    return BatchResult(record.batch, error=error, retryable=retryable, started_s=at, finished_s=at)


def values(items) -> list[float]:
    return [float(item.request.inputs["INPUT0"][0, 0]) for item in items]


def response(item: Pending) -> InferenceResponse:
    assert isinstance(item.outcome, InferenceResponse), item.outcome
    return item.outcome


def reasons(events) -> list[str | None]:
    return [e.reason for e in events if isinstance(e, RequestStats)]


# -- admission ---------------------------------------------------------------------------------


def test_admission_counts_rows_once_and_queues():
    core, _ = core_with()
    item = core.admit(request(3), now=5.0)
    assert (item.rows, item.arrival_s, item.deadline_s, item.priority) == (3, 5.0, None, 1)
    assert item.shape_key == (("INPUT0", (4,)),)
    assert core.queued == 1 and core.in_flight_requests == 1


def test_full_queue_is_refused_at_once_and_counted():
    core, events = core_with(cfg=config(max_queue_size=1))
    core.admit(request(), 0.0)
    with pytest.raises(OverloadedError, match=r"queue of model 'double' is full \(1 requests"):
        core.admit(request(2), 0.0)
    assert core.queued == 1 and core.in_flight_requests == 1
    assert [(e.rows, e.reason) for e in events] == [(2, "rejected")]


def test_unknown_priority_and_closing_are_refused_and_counted():
    core, events = core_with(cfg=config(priority_levels=2))
    with pytest.raises(InvalidInputError, match=r"priority': 3 is not a level .* \(1\.\.2"):
        core.admit(request(priority=3), 0.0)
    core.close()
    with pytest.raises(UnavailableError, match="model 'double' version 1 is unloading"):
        core.admit(request(), 0.0)
    unattached: SchedulerCore[Worker] = SchedulerCore(config(), "1")
    with pytest.raises(UnavailableError):
        unattached.admit(request(), 0.0)
    assert reasons(events) == ["invalid", "unavailable"]
    assert core.in_flight_requests == 0


def test_request_and_default_timeouts_set_the_deadline():
    core, _ = core_with(cfg=config(default_timeout_us=50_000))
    assert core.admit(request(), 1.0).deadline_s == pytest.approx(1.05)
    assert core.admit(request(timeout_us=10_000), 1.0).deadline_s == pytest.approx(1.01)


# -- batch formation and dispatch ------------------------------------------------------------


def test_zero_delay_dispatches_at_once_to_a_free_instance():
    worker = Worker("w0")
    core, _ = core_with(worker)
    item = core.admit(request(), 0.0)
    plan = core.schedule(0.0)
    assert [r.batch.items for r in plan.dispatched] == [[item]]
    record = plan.dispatched[0]
    assert record.instance is worker and worker.in_flight == 1 and record.batch.seq == 1
    assert record.deadline_s == float("inf")  # no watchdog configured
    assert core.in_flight == [record] and core.queued == 0
    assert core.next_wakeup(0.0) is None  # nothing can change without an event


def test_queue_delay_holds_the_leading_request_then_sends_what_came():
    core, _ = core_with(cfg=config(max_queue_delay_us=10_000, early_dispatch=False))
    a = core.admit(request(value=1), 0.0)
    assert not core.schedule(0.0).dispatched
    assert core.next_wakeup(0.0) == pytest.approx(0.010)
    b = core.admit(request(value=2), 0.004)
    assert not core.schedule(0.0099).dispatched
    (record,) = core.schedule(0.010).dispatched
    assert record.batch.items == [a, b] and record.batch.rows == 2


def test_requests_queued_behind_a_busy_instance_form_one_batch_and_get_their_rows():
    core, events = core_with()
    core.admit(request(1, 1000.0), 0.0)
    (first,) = core.schedule(0.0).dispatched
    sizes = [1, 3, 2, 2]
    items = [core.admit(request(n, 100.0 * i), 0.001) for i, n in enumerate(sizes)]
    assert not core.schedule(0.001).dispatched  # the only instance is busy
    assert core.next_wakeup(0.001) is None  # no timer: the completion will pump
    done = core.complete(run(first, 0.0, 0.002), 0.002)
    assert len(done.finished) == 1 and not done.late
    (second,) = core.schedule(0.002).dispatched
    assert second.batch.items == items and second.batch.rows == 8
    done = core.complete(run(second, 0.002, 0.005), 0.006)
    assert done.finished == items
    for i, (n, item) in enumerate(zip(sizes, items, strict=True)):
        expected = (np.arange(n * 4, dtype=np.float32).reshape(n, 4) + 100.0 * i) * 2
        np.testing.assert_array_equal(response(item).outputs["OUTPUT0"], expected)
        assert response(item).rows == n
        timing = response(item).timing
        assert timing.queue_s == pytest.approx(0.001)  # admitted 0.001, batch started 0.002
        assert timing.compute_s == pytest.approx(0.003)
        assert timing.total_s == pytest.approx(0.005)
    assert core.stats.execution_count == 2 and core.stats.inference_count == 9
    assert core.in_flight_requests == 0
    batches = [(e.batch_size, e.requests, e.ok) for e in events if isinstance(e, BatchStats)]
    assert batches == [(1, 1, True), (8, 4, True)]


def test_batches_go_to_the_least_busy_instance_with_room():
    a, b = Worker("a", capacity=2), Worker("b", capacity=1)
    core, _ = core_with(a, b, cfg=config(max_batch_size=1))
    for i in range(4):
        core.admit(request(value=i), 0.0)
    plan = core.schedule(0.0)
    assert [r.instance.name for r in plan.dispatched] == ["a", "b", "a"]
    assert (a.in_flight, b.in_flight, core.queued) == (2, 1, 1)
    core.complete(run(plan.dispatched[1], 0.0, 0.001), 0.001)
    (record,) = core.schedule(0.001).dispatched
    assert record.instance is b and values(record.batch.items) == [3.0]


def test_a_model_without_batching_runs_one_request_per_batch():
    core, _ = core_with(Worker("w", capacity=3), cfg=config(max_batch_size=0))
    items = [core.admit(request(2, value=i), 0.0) for i in range(2)]
    assert [i.rows for i in items] == [1, 1]
    assert [r.batch.items for r in core.schedule(0.0).dispatched] == [[items[0]], [items[1]]]


# -- expiry ---------------------------------------------------------------------------------


def test_queue_timeout_fails_the_request_at_its_deadline_and_it_never_runs():
    core, events = core_with(cfg=config(max_queue_size=1))
    running = core.admit(request(value=0), 0.0)
    (first,) = core.schedule(0.0).dispatched
    queued = core.admit(request(value=5, timeout_us=100_000), 0.010)
    with pytest.raises(OverloadedError):
        core.admit(request(value=9), 0.011)
    assert core.next_wakeup(0.011) == pytest.approx(0.110)  # the deadline, instance busy
    assert core.expire(0.1099) == [] and not core.schedule(0.1099).finished
    plan = core.schedule(0.110)
    assert list(plan.finished) == [queued] and not plan.dispatched
    assert isinstance(queued.outcome, RequestTimeoutError)
    assert queued.outcome.message == (
        "request timed out in the queue of model 'double' after 100 ms without running"
    )
    assert core.queued == 0 and core.next_wakeup(0.110) is None
    core.complete(run(first, 0.0, 0.2), 0.2)
    assert not core.schedule(0.2).dispatched  # the timed-out request never runs
    assert response(running).rows == 1
    assert core.stats.fail_reasons == {"rejected": 1, "timeout": 1}
    assert core.stats.execution_count == 1 and core.in_flight_requests == 0
    timeout = next(e for e in events if isinstance(e, RequestStats) and e.reason == "timeout")
    assert timeout.queue_s == timeout.total_s == pytest.approx(0.100)


# -- retry in halves -------------------------------------------------------------------------


def test_a_failing_request_fails_alone_and_halves_run_before_new_work():
    core, events = core_with()
    blocker = core.admit(request(value=7), 0.0)
    (first,) = core.schedule(0.0).dispatched
    good = [core.admit(request(value=10.0 * i), 0.001) for i in (1, 2, 3)]
    bad = core.admit(request(value=-999), 0.001)
    core.complete(run(first, 0.0, 0.002), 0.002)
    (batch,) = core.schedule(0.002).dispatched
    assert batch.batch.items == [*good, bad]
    late = core.admit(request(value=55), 0.003)  # new work, arriving while the batch runs
    done = core.complete(failed(batch, BackendError("marker row"), at=0.003), 0.004)
    assert not done.finished and [b.items for b in done.retried] == [good[:2], [good[2], bad]]
    assert core.retrying == list(done.retried)
    assert core.next_wakeup(0.004) == 0.004  # halves wait and the instance is free
    order: list[list[float]] = []
    t = 0.004
    while core.in_flight_requests:
        plan = core.schedule(t)
        assert len(plan.dispatched) == 1
        record = plan.dispatched[0]
        order.append(values(record.batch.items))
        t += 0.001
        if -999.0 in values(record.batch.items):
            result = failed(record, BackendError("model 'double' failed: marker row"), at=t)
        else:
            result = run(record, t, t)
        core.complete(result, t)
    # the halves (and their halves) ran first; the late request only after every one of them
    assert order == [[10.0, 20.0], [30.0, -999.0], [30.0], [-999.0], [55.0]]
    for item in (blocker, *good, late):
        assert response(item).outputs["OUTPUT0"].shape == (1, 4)
    assert isinstance(bad.outcome, BackendError) and "marker row" in bad.outcome.message
    assert core.stats.fail_reasons == {"backend_error": 1}
    assert reasons(events).count(None) == 5


def test_out_of_memory_splits_until_the_rows_fit():
    core, _ = core_with()
    items = [core.admit(request(value=i), 0.0) for i in range(4)]
    (record,) = core.schedule(0.0).dispatched
    oom = OutOfMemoryError("model 'double' ran out of memory on cuda:0")
    done = core.complete(failed(record, oom), 0.1)
    assert [half.rows for half in done.retried] == [2, 2]
    sizes = []
    while core.in_flight_requests:
        (record,) = core.schedule(0.2).dispatched
        sizes.append(record.batch.rows)
        result = failed(record, oom) if record.batch.rows > 1 else run(record, 0.2, 0.3)
        core.complete(result, 0.3)
    assert sizes == [2, 2, 1, 1, 1, 1]
    assert all(response(item).outputs["OUTPUT0"].shape == (1, 4) for item in items)
    # a single request that does not fit fails alone, with the error as it came
    alone = core.admit(request(3), 1.0)
    (record,) = core.schedule(1.0).dispatched
    done = core.complete(failed(record, oom, at=1.0), 1.1)
    assert list(done.finished) == [alone] and alone.outcome is oom and not done.retried


def test_an_output_mismatch_fails_every_member_without_retrying():
    core, events = core_with()
    items = [core.admit(request(1, value=i), 0.0) for i in range(3)]
    (record,) = core.schedule(0.0).dispatched
    mismatch = OutputMismatch("model 'double' returned 2 rows in output 'OUTPUT0' for a batch of 3")
    done = core.complete(failed(record, mismatch, retryable=False, at=0.01), 0.02)
    assert done.finished == items and not done.retried and core.retrying == []
    assert all(item.outcome is mismatch for item in items)
    assert core.stats.fail_reasons == {"backend_error": 3} and core.in_flight_requests == 0
    (batch_event,) = [e for e in events if isinstance(e, BatchStats)]
    assert not batch_event.ok and batch_event.requests == 3
    queue_times = [e.queue_s for e in events if isinstance(e, RequestStats)]
    assert queue_times == pytest.approx([0.01] * 3)  # until the batch started


def test_row_errors_fail_only_their_request():
    core, _ = core_with()
    items = [core.admit(request(value=v), 0.0) for v in (1.0, -5.0, 2.0)]
    (record,) = core.schedule(0.0).dispatched
    done = core.complete(run(record, 0.0, 0.01, fail_value=-5.0), 0.01)
    assert done.finished == items and not done.retried
    assert isinstance(items[1].outcome, BackendError)
    assert "failed on row 0 of the request: marker" in items[1].outcome.message
    assert isinstance(items[0].outcome, InferenceResponse)
    assert core.stats.fail_reasons == {"backend_error": 1} and core.stats.inference_count == 2


# -- watchdog --------------------------------------------------------------------------------


def test_hung_instance_fails_its_batches_is_dropped_and_its_late_result_is_ignored():
    stuck, other = Worker("m:1#0", capacity=2), Worker("m:1#1")
    core, events = core_with(stuck, other, cfg=config(max_batch_size=1, timeout_s=0.3))
    a = core.admit(request(value=1), 1.0)
    b = core.admit(request(value=2), 1.0)
    plan = core.schedule(1.0)
    assert [(r.instance.name, r.deadline_s) for r in plan.dispatched] == [
        ("m:1#0", pytest.approx(1.3)),
        ("m:1#1", pytest.approx(1.3)),
    ]
    c = core.admit(request(value=3), 1.1)
    (third,) = core.schedule(1.1).dispatched  # to the instance with room
    assert third.instance is stuck and third.deadline_s == pytest.approx(1.4)
    assert core.next_wakeup(1.1) == pytest.approx(1.3)  # the earliest watchdog deadline
    core.complete(run(plan.dispatched[1], 1.0, 1.2), 1.2)  # b's instance answers in time
    assert core.hung(1.299, respawn=True) == []
    (hung,) = core.hung(1.3, respawn=True)
    assert hung.instance is stuck and [r.batch.items for r in hung.batches] == [[a], [c]]
    assert hung.finished == [a, c] and core.instances == [other]
    for item in (a, c):
        assert isinstance(item.outcome, BackendError)
        assert item.outcome.message == (
            "model 'double' instance m:1#0 did not finish within 0.3 s (execution_timeout_s); "
            "it is being restarted"
        )
    assert isinstance(b.outcome, InferenceResponse)
    assert core.hung(10.0, respawn=True) == [] and core.next_wakeup(1.3) is None
    executions = core.stats.execution_count
    done = core.complete(run(plan.dispatched[0], 1.0, 5.0), 5.0)  # the abandoned thread's
    assert done.late and not done.finished
    assert core.stats.execution_count == executions
    assert core.in_flight_requests == 0
    assert core.stats.fail_reasons == {"backend_error": 2}
    failures = [e for e in events if isinstance(e, RequestStats) and e.reason]
    timings = [(e.queue_s, e.compute_s, e.total_s) for e in failures]
    assert timings == [
        (0.0, pytest.approx(0.3), pytest.approx(0.3)),
        (0.0, pytest.approx(0.2), pytest.approx(0.2)),
    ]


def test_requests_wait_for_the_replacement_of_the_only_instance():
    core, _ = core_with(Worker("old"), cfg=config(timeout_s=0.3))
    hanging = core.admit(request(value=-1), 0.0)
    (record,) = core.schedule(0.0).dispatched
    (hung,) = core.hung(0.3, respawn=True)
    assert hung.finished == [hanging] and core.instances == []
    waiting = core.admit(request(value=3), 0.35)  # a replacement is coming: it waits
    assert not core.schedule(0.35).dispatched and waiting.outcome is None
    fresh = Worker("new")
    core.add_instance(fresh)
    (record,) = core.schedule(0.5).dispatched
    assert record.instance is fresh and record.deadline_s == pytest.approx(0.8)
    core.complete(run(record, 0.5, 0.6), 0.6)
    assert response(waiting).outputs["OUTPUT0"][0, 0] == 6.0
    assert core.in_flight_requests == 0


def test_without_a_replacement_the_queue_fails_once_no_instance_is_left():
    core, _ = core_with(Worker("only"), cfg=config(timeout_s=0.3))
    core.admit(request(value=-1), 0.0)
    core.schedule(0.0)
    queued = core.admit(request(value=2), 0.1)
    (hung,) = core.hung(0.3, respawn=False)
    assert hung.finished[-1] is queued and isinstance(queued.outcome, UnavailableError)
    assert queued.outcome.message == "model 'double' has no working instance"
    assert core.in_flight_requests == 0 and core.queued == 0


def test_a_failed_replacement_fails_the_queue_if_no_instance_is_left():
    core, _ = core_with(Worker("only"), cfg=config(timeout_s=0.3))
    core.admit(request(value=-1), 0.0)
    core.schedule(0.0)
    queued = core.admit(request(value=2), 0.1)
    core.hung(0.3, respawn=True)
    assert core.replacement_failed("CUDA error", 0.5) == [queued]
    assert isinstance(queued.outcome, UnavailableError)
    assert queued.outcome.message == "model 'double' has no working instance: CUDA error"
    core.add_instance(Worker("late"))
    assert core.replacement_failed("again", 0.6) == []  # one instance is left: nothing fails


# -- cancellation ------------------------------------------------------------------------------


def test_a_cancelled_queued_request_leaves_the_queue_and_is_counted():
    core, events = core_with()
    core.admit(request(), 0.0)
    (running,) = core.schedule(0.0).dispatched
    queued = core.admit(request(value=5), 0.01)
    assert core.cancel(queued, 0.02)
    assert isinstance(queued.outcome, CancelledRequestError)
    assert queued.outcome.message == "client cancelled"
    assert core.queued == 0 and core.in_flight_requests == 1
    assert not core.cancel(queued, 0.03)  # not queued any more: nothing happens
    core.complete(run(running, 0.0, 0.1), 0.1)
    assert not core.schedule(0.1).dispatched and core.in_flight_requests == 0
    assert not core.cancel(running.batch.items[0], 0.2)  # ran: too late to cancel
    assert reasons(events) == ["cancelled", None]


def test_a_request_cancelled_while_its_batch_runs_is_counted_cancelled_never_a_success():
    core, events = core_with()
    gone, stays = core.admit(request(value=1), 0.0), core.admit(request(value=2), 0.0)
    (record,) = core.schedule(0.0).dispatched
    assert not core.cancel(gone, 0.05)  # its batch runs: nothing to take out
    assert gone.cancelled and gone.outcome is None and core.in_flight_requests == 2
    done = core.complete(run(record, 0.0, 0.1), 0.1)
    assert list(done.finished) == [gone, stays]
    assert isinstance(gone.outcome, CancelledRequestError)
    assert response(stays).outputs["OUTPUT0"][0, 0] == 4.0
    assert reasons(events) == ["cancelled", None]  # in batch order
    assert core.stats.fail_reasons == {"cancelled": 1} and core.in_flight_requests == 0


def test_a_cancelled_request_is_not_retried_and_leaves_a_waiting_retry_half():
    core, events = core_with()
    items = [core.admit(request(value=10.0 * i), 0.0) for i in range(1, 6)]
    (record,) = core.schedule(0.0).dispatched
    assert not core.cancel(items[0], 0.01)  # running: marked
    done = core.complete(failed(record, BackendError("marker row"), at=0.0), 0.02)
    # the cancelled one is finished, not retried; the others are halved
    assert list(done.finished) == [items[0]]
    assert isinstance(items[0].outcome, CancelledRequestError)
    assert [b.items for b in done.retried] == [items[1:3], items[3:]]
    assert core.cancel(items[4], 0.03)  # waits in a retry half: taken out of it
    assert [b.items for b in core.retrying] == [items[1:3], items[3:4]]
    assert core.retrying[1].rows == 1
    assert core.cancel(items[3], 0.03)  # the half is empty now: it goes
    assert [b.items for b in core.retrying] == [items[1:3]]
    (again,) = core.schedule(0.04).dispatched
    core.complete(run(again, 0.04, 0.05), 0.05)
    assert core.in_flight_requests == 0
    assert reasons(events) == ["cancelled", "cancelled", "cancelled", None, None]


def test_requests_whose_client_left_are_dropped_when_batches_form():
    core, _ = core_with()
    gone = {"b"}
    items = {
        tag: core.admit(request(value=i, id=tag, is_cancelled=lambda t=tag: t in gone), 0.0)
        for i, tag in enumerate("abc")
    }
    plan = core.schedule(0.0)
    assert [i.request.id for i in plan.dispatched[0].batch.items] == ["a", "c"]
    assert list(plan.finished) == [items["b"]]
    assert isinstance(items["b"].outcome, CancelledRequestError)
    assert items["b"].outcome.message == "client went away"
    assert core.stats.fail_reasons == {"cancelled": 1} and core.in_flight_requests == 2


def test_a_client_gone_while_every_instance_is_busy_is_dropped_without_running():
    core, _ = core_with()
    core.admit(request(), 0.0)
    (running,) = core.schedule(0.0).dispatched
    left = [False]
    queued = core.admit(request(value=1, is_cancelled=lambda: left[0]), 0.01)
    left[0] = True
    core.complete(run(running, 0.0, 0.1), 0.1)
    plan = core.schedule(0.1)
    assert not plan.dispatched and list(plan.finished) == [queued]
    assert core.in_flight_requests == 0


# -- close / drain -------------------------------------------------------------------------------


def test_close_refuses_new_work_while_queued_and_running_requests_carry_on():
    core, _ = core_with()
    core.admit(request(value=1), 0.0)
    (running,) = core.schedule(0.0).dispatched
    queued = core.admit(request(value=2), 0.01)
    core.close()
    with pytest.raises(UnavailableError, match="is unloading"):
        core.admit(request(), 0.1)
    assert core.in_flight_requests == 2  # closing alone fails nothing
    core.complete(run(running, 0.0, 0.1), 0.1)
    (record,) = core.schedule(0.1).dispatched  # the queued request still runs
    assert record.batch.items == [queued]
    assert core.drain(UnavailableError("unloaded"), 0.15) == []  # a running one is not failed
    core.complete(run(record, 0.1, 0.2), 0.2)
    assert isinstance(queued.outcome, InferenceResponse) and core.in_flight_requests == 0


def test_drain_fails_queued_requests_and_retry_halves():
    core, _ = core_with()
    first = [core.admit(request(value=v), 0.0) for v in (1, 2)]
    (record,) = core.schedule(0.0).dispatched
    queued = core.admit(request(value=3), 0.01)
    core.complete(failed(record, BackendError("flaky")), 0.02)  # halves wait to run
    assert len(core.retrying) == 2
    core.close()
    error = UnavailableError("model 'double' unloaded before it ran")
    drained = core.drain(error, 0.5)
    assert sorted(values(drained)) == [1.0, 2.0, 3.0]
    assert all(item.outcome is error for item in (*first, queued))
    assert core.retrying == [] and core.queued == 0 and core.in_flight_requests == 0
    assert core.stats.fail_reasons == {"unavailable": 3}


# -- next_wakeup -------------------------------------------------------------------------------


def test_next_wakeup_is_the_earliest_of_delay_deadline_and_watchdog():
    core, _ = core_with(
        Worker("w", capacity=2),
        cfg=config(max_queue_delay_us=50_000, early_dispatch=False, timeout_s=1.0),
    )
    assert core.next_wakeup(0.0) is None  # idle: no timer at all
    core.admit(request(timeout_us=30_000), 0.0)
    wake = core.next_wakeup(0.0)
    assert wake == pytest.approx(0.03)  # its deadline comes before its delay
    assert len(core.schedule(wake).finished) == 1
    core.admit(request(), 0.04)
    wake = core.next_wakeup(0.04)
    assert wake == pytest.approx(0.09)  # the leading request's delay
    (record,) = core.schedule(wake).dispatched
    assert core.next_wakeup(wake) == pytest.approx(1.09)  # only the watchdog is left
    core.admit(request(), 0.5)
    assert core.next_wakeup(0.5) == pytest.approx(0.55)
    core.complete(run(record, wake, 0.6), 0.6)
    assert core.next_wakeup(0.6) == pytest.approx(0.55)  # overdue: the driver fires at once
    core.schedule(0.6)
    assert core.next_wakeup(0.6) == pytest.approx(1.6)


def test_next_wakeup_covers_the_regather_window():
    core, _ = core_with(cfg=config(max_queue_delay_us=5_000, early_dispatch=True))
    core.admit(request(), 0.0)
    (record,) = core.schedule(0.005).dispatched
    core.admit(request(), 0.006)
    # the batch took 30 ms: a window of min(5 ms, 3 ms) opens for its client to send again
    core.complete(run(record, 0.010, 0.040), 0.040)
    wake = core.next_wakeup(0.040)
    assert wake == pytest.approx(0.043)
    assert not core.schedule(0.041).dispatched
    assert len(core.schedule(wake).dispatched) == 1


def test_next_wakeup_without_a_free_instance_only_watches_deadlines():
    core, _ = core_with(cfg=config(max_queue_delay_us=50_000))
    core.admit(request(), 0.0)
    core.schedule(0.05)
    core.admit(request(), 0.06)  # the instance is busy: its delay alone cannot dispatch it
    assert core.next_wakeup(0.06) is None
