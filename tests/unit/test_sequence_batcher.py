"""The sequence batcher inside the scheduling core, on a fake clock (no threads, no sleeps).

The tests play the instances: ``run`` computes a running-sum model over the batch the core
dispatched (state in, state out, controls read from the rows; READY false rows get garbage),
as a real instance would.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from gpuserve.config import ModelConfig, TensorSpec
from gpuserve.engine.assembly import OutputSpec, split_outputs, stack_inputs
from gpuserve.engine.batch import Batch, BatchResult, Pending
from gpuserve.engine.request import InferenceRequest, InferenceResponse
from gpuserve.engine.scheduling import InFlight, SchedulerCore
from gpuserve.engine.sequence.batcher import SequenceBatch, SequenceBatcher
from gpuserve.engine.sequence.layout import FillerRow
from gpuserve.engine.stats import BatchStats
from gpuserve.errors import BackendError, InvalidInputError, OverloadedError


@dataclass(eq=False)
class Worker:
    name: str
    capacity: int = 1
    in_flight: int = 0


CONTROLS = [
    {"name": "START", "kind": "start"},
    {"name": "END", "kind": "end", "datatype": "FP32"},
    {"name": "READY", "kind": "ready", "datatype": "BOOL"},
    {"name": "CORRID", "kind": "corrid", "datatype": "UINT64"},
]


def config(
    strategy: dict | None = None,
    max_batch_size: int = 4,
    shape: tuple[int, ...] = (1,),
    timeout_s: float = 0.0,
    **seq,
) -> ModelConfig:
    """The running-sum model (``shape``: of X and of its state)."""
    state = {"input_name": "SUM_IN", "output_name": "SUM_OUT", "datatype": "FP32"}
    section = {
        "control_inputs": CONTROLS,
        "states": [{**state, "shape": list(shape)}],
        **(strategy or {}),
        **seq,
    }
    return ModelConfig(
        name="running_sum",
        max_batch_size=max_batch_size,
        inputs=[TensorSpec(name="X", datatype="FP32", shape=list(shape))],
        outputs=[TensorSpec(name="SUM", datatype="FP32", shape=list(shape))],
        sequence_batching=section,
        execution_timeout_s=timeout_s,
    )


def core_with(*workers: Worker, cfg: ModelConfig | None = None) -> SchedulerCore[Worker]:
    core: SchedulerCore[Worker] = SchedulerCore(cfg or config(), "1")
    core.attach(list(workers) or [Worker("w0")])
    assert isinstance(core.batcher, SequenceBatcher)
    return core


def req(
    seq_id: int | str | None, x: float, start: bool = False, end: bool = False
) -> InferenceRequest:
    params: dict = {}
    if seq_id is not None:
        params = {"sequence_id": seq_id, "sequence_start": start, "sequence_end": end}
    return InferenceRequest(
        "running_sum", None, {"X": np.array([[x]], np.float32)}, parameters=params
    )


SPEC = OutputSpec("running_sum", ("SUM",), batched=True)


def run(record: InFlight[Worker], at: float = 0.0, drop_state: bool = False) -> BatchResult:
    """A running-sum model: SUM_OUT = SUM_IN + X, SUM = SUM_OUT (+1000 * END); a row with
    READY false (a direct batch's filler row) gets -999 in both."""
    batch = record.batch
    x = stack_inputs(batch.items)
    assert x["READY"].dtype == np.bool_ and x["READY"].shape == (batch.rows, 1)
    total = np.where(x["READY"], x["SUM_IN"] + x["X"], np.float32(-999.0))
    outputs = {"SUM": total + 1000 * x["END"], "SUM_OUT": total}
    results = split_outputs(SPEC, batch.items, outputs)
    if drop_state:  # a backend that answers without the state output
        results = [{"SUM": r["SUM"]} for r in results if isinstance(r, dict)]
    return BatchResult(batch, results, started_s=at, finished_s=at)


def answer(item: Pending) -> float:
    assert isinstance(item.outcome, InferenceResponse), item.outcome
    assert "SUM_OUT" not in item.outcome.outputs  # state stays in the server
    return float(item.outcome.outputs["SUM"][0, 0])


def step(core: SchedulerCore[Worker], now: float) -> list[InFlight[Worker]]:
    """Schedule at ``now`` and complete every dispatched batch at once; returns them."""
    plan = core.schedule(now)
    for record in plan.dispatched:
        core.complete(run(record, now), now)
    return list(plan.dispatched)


def test_a_sequence_keeps_its_state_and_gets_its_controls() -> None:
    core = core_with()
    items = [core.admit(req(7, 1.0, start=True), 0.0)]
    plan = core.schedule(0.0)
    (record,) = plan.dispatched
    inputs = record.batch.items[0].request.inputs
    assert inputs["START"].tolist() == [[1]] and inputs["START"].dtype == np.int32
    assert inputs["END"].tolist() == [[0.0]] and inputs["CORRID"].tolist() == [[7]]
    assert inputs["CORRID"].dtype == np.uint64 and inputs["SUM_IN"].tolist() == [[0.0]]
    core.complete(run(record), 0.0)
    items += [core.admit(req(7, 2.0), 0.1), core.admit(req(7, 3.0, end=True), 0.1)]
    step(core, 0.1)  # one request per sequence per batch: the END waits for the 2
    assert items[2].outcome is None
    step(core, 0.2)
    assert [answer(i) for i in items] == [1.0, 3.0, 1006.0]
    assert core.batcher.sequence_stats().live == 0
    assert core.batcher.stats.ended == 1
    with pytest.raises(InvalidInputError, match=r"sequence id 7 .* ended"):
        core.admit(req(7, 1.0), 0.3)


def test_sequences_share_a_batch_one_row_each_in_order() -> None:
    core = core_with()
    a = [core.admit(req(11, v, start=(v == 1)), 0.0) for v in (1.0, 2.0, 3.0)]
    b = [core.admit(req(12, v, start=(v == 10)), 0.0) for v in (10.0, 20.0)]
    sizes = [len(r.batch.items) for r in step(core, 0.0) + step(core, 0.1) + step(core, 0.2)]
    assert sizes == [2, 2, 1]
    assert [answer(i) for i in a] == [1.0, 3.0, 6.0]
    assert [answer(i) for i in b] == [10.0, 30.0]


def test_a_sequence_stays_on_its_instance() -> None:
    w0, w1 = Worker("w0"), Worker("w1")
    core = core_with(w0, w1)
    for sid in (1, 2, 3, 4):
        core.admit(req(sid, 1.0, start=True), 0.0)
    plan = core.schedule(0.0)
    lanes = {
        record.instance.name: [i.request.parameters["sequence_id"] for i in record.batch.items]
        for record in plan.dispatched
    }
    assert lanes == {"w0": [1, 3], "w1": [2, 4]}
    for record in plan.dispatched:
        assert isinstance(record.batch, SequenceBatch) and record.batch.instance is record.instance
    # w0 finishes; w1 is still busy: sequence 2's next request waits for w1, not w0
    r0 = next(r for r in plan.dispatched if r.instance is w0)
    core.complete(run(r0), 0.1)
    r1 = next(r for r in plan.dispatched if r.instance is w1)
    core.complete(run(r1), 0.1)
    core.admit(req(2, 5.0), 0.2)
    w1.in_flight = 1  # pretend w1 is busy with something else
    assert core.schedule(0.2).dispatched == []
    w1.in_flight = 0
    (again,) = core.schedule(0.3).dispatched
    assert again.instance is w1


def test_requests_without_a_live_sequence_are_refused_with_the_id() -> None:
    core = core_with()
    with pytest.raises(
        InvalidInputError, match="sequence model: every request needs parameter 'sequence_id'"
    ):
        core.admit(req(None, 1.0), 0.0)
    with pytest.raises(InvalidInputError, match=r"sequence id 99 .*never started.*sequence_start"):
        core.admit(req(99, 1.0), 0.0)
    with pytest.raises(InvalidInputError, match="'sequence_id': expected"):
        core.admit(
            InferenceRequest(
                "running_sum",
                None,
                {"X": np.zeros((1, 1), np.float32)},
                parameters={"sequence_id": 1.5},
            ),
            0.0,
        )
    with pytest.raises(InvalidInputError, match=r"does not fit .*CORRID"):
        core.admit(req("not-a-number", 1.0, start=True), 0.0)
    with pytest.raises(InvalidInputError, match="one row"):
        two = InferenceRequest(
            "running_sum",
            None,
            {"X": np.zeros((2, 1), np.float32)},
            parameters={"sequence_id": 5, "sequence_start": True},
        )
        core.admit(two, 0.0)
    assert core.in_flight_requests == 0 and len(core.batcher) == 0


def test_start_on_a_live_sequence_restarts_it() -> None:
    core = core_with()
    first = core.admit(req(3, 5.0, start=True), 0.0)
    step(core, 0.0)
    again = core.admit(req(3, 2.0, start=True), 0.1)
    more = core.admit(req(3, 1.0), 0.1)
    step(core, 0.1)
    step(core, 0.2)
    assert [answer(first), answer(again), answer(more)] == [5.0, 2.0, 3.0]
    assert core.batcher.stats.started == 2


def test_idle_sequences_are_released_and_counted() -> None:
    cfg = config(max_sequence_idle_us=500_000)
    core = core_with(cfg=cfg)
    core.admit(req(1, 1.0, start=True), 0.0)
    core.admit(req(2, 1.0, start=True), 0.0)
    step(core, 0.0)
    assert core.next_wakeup(0.0) == pytest.approx(0.5)
    core.admit(req(2, 1.0), 0.4)
    step(core, 0.4)
    core.schedule(0.6)  # 1 idle since 0.0 -> released; 2 active at 0.4
    stats = core.batcher.sequence_stats()
    assert (stats.released_idle, stats.live) == (1, 1)
    assert core.next_wakeup(0.6) == pytest.approx(0.9)
    with pytest.raises(InvalidInputError, match=r"sequence id 1 .*released after 600 ms idle"):
        core.admit(req(1, 1.0), 0.7)
    core.schedule(1.0)
    assert core.batcher.sequence_stats().released_idle == 2
    assert core.next_wakeup(1.0) is None  # nothing live: no timer


def test_direct_slots_bound_live_sequences_per_instance() -> None:
    core = core_with(cfg=config({"direct": {}}, max_batch_size=2))
    first = [core.admit(req(s, 1.0, start=True), 0.0) for s in (1, 2, 3)]
    (record,) = step(core, 0.0)
    assert len(record.batch.items) == 2  # two slots; sequence 3 waits for one
    assert first[2].outcome is None
    assert core.batcher.sequence_stats().waiting_for_slot == 1
    core.admit(req(1, 1.0, end=True), 0.1)
    step(core, 0.1)  # 1 ends, its slot goes to 3
    step(core, 0.2)
    assert answer(first[2]) == 1.0


def test_direct_delay_and_minimum_slot_utilization() -> None:
    cfg = config({"direct": {"max_queue_delay_us": 1000, "minimum_slot_utilization": 0.5}})
    core = core_with(cfg=cfg)
    core.admit(req(1, 1.0, start=True), 0.0)
    assert core.schedule(0.0).dispatched == []
    assert core.next_wakeup(0.0) == pytest.approx(0.001)
    core.admit(req(2, 1.0, start=True), 0.0002)  # 2 of 4 slots ready: utilization reached
    (record,) = core.schedule(0.0002).dispatched
    assert len(record.batch.items) == 2


def test_oldest_waits_for_the_delay_or_a_preferred_size() -> None:
    cfg = config(
        {
            "oldest": {
                "max_candidate_sequences": 8,
                "max_queue_delay_us": 2000,
                "preferred_batch_sizes": [3],
            }
        }
    )
    core = core_with(cfg=cfg)
    core.admit(req(1, 1.0, start=True), 0.0)
    core.admit(req(2, 1.0, start=True), 0.0)
    assert core.schedule(0.001).dispatched == []
    (record,) = core.schedule(0.002).dispatched  # delay ran out
    assert len(record.batch.items) == 2
    core.complete(run(record), 0.002)
    for sid in (1, 2, 3):
        core.admit(req(sid, 1.0, start=(sid == 3)), 0.003)
    (record,) = core.schedule(0.003).dispatched  # preferred size 3 reached
    assert [i.request.parameters["sequence_id"] for i in record.batch.items] == [1, 2, 3]


def test_a_failed_request_keeps_the_state_and_a_missing_state_output_is_an_error() -> None:
    core = core_with()
    core.admit(req(1, 4.0, start=True), 0.0)
    step(core, 0.0)
    bad = core.admit(req(1, 100.0), 0.1)
    (record,) = core.schedule(0.1).dispatched
    core.complete(BatchResult(record.batch, error=BackendError("boom"), retryable=False), 0.1)
    assert isinstance(bad.outcome, BackendError)
    lost = core.admit(req(1, 1.0), 0.2)
    (record,) = core.schedule(0.2).dispatched
    core.complete(run(record, drop_state=True), 0.2)
    assert (
        isinstance(lost.outcome, BackendError)
        and "state output(s) ['SUM_OUT']" in lost.outcome.message
    )
    ok = core.admit(req(1, 1.0), 0.3)
    step(core, 0.3)
    assert answer(ok) == 5.0  # 4 + 1: neither failure changed the state


def test_a_failed_oldest_batch_fails_its_requests_without_halves() -> None:
    core = core_with(cfg=config({"oldest": {"max_candidate_sequences": 4}}))
    a = core.admit(req(1, 1.0, start=True), 0.0)
    b = core.admit(req(2, 2.0, start=True), 0.0)
    (record,) = core.schedule(0.0).dispatched
    done = core.complete(BatchResult(record.batch, error=BackendError("oom"), retryable=True), 0.0)
    assert list(done.finished) == [a, b] and not done.retried and not core.retrying
    assert isinstance(a.outcome, BackendError) and isinstance(b.outcome, BackendError)
    later = core.admit(req(1, 1.0), 0.0)  # the sequence lives on; the failure left its state
    step(core, 0.1)
    assert answer(later) == 1.0


def test_cancel_expire_and_queue_limit() -> None:
    core = core_with(cfg=config(max_queue_size=3))
    a = core.admit(req(1, 1.0, start=True), 0.0)
    core.admit(req(2, 1.0, start=True), 0.0)
    gone = [False]
    probe = req(4, 1.0, start=True)
    probe.is_cancelled = lambda: gone[0]
    core.admit(probe, 0.0)
    with pytest.raises(OverloadedError):
        core.admit(req(3, 1.0, start=True), 0.0)
    assert core.cancel(a, 0.0) and not core.cancel(a, 0.0)
    gone[0] = True
    plan = core.schedule(0.0)
    assert [
        [i.request.parameters.get("sequence_id") for i in r.batch.items] for r in plan.dispatched
    ] == [[None, 2]]  # sequence 1 (slot 0) has nothing ready: a filler row
    assert [i.request is probe for i in plan.finished] == [True]  # cancelled, never run
    core.complete(run(plan.dispatched[0]), 0.0)
    late = req(2, 1.0)
    late.timeout_us = 1000
    item = core.admit(late, 0.0)
    core.batcher.instances()[0].in_flight = 1  # the instance is busy: it waits and times out
    assert core.next_wakeup(0.0) == pytest.approx(0.001)
    assert core.schedule(0.001).finished == [item]
    assert core.in_flight_requests == 0 and len(core.batcher) == 0


def test_unbatched_sequence_model_gets_rows_without_a_batch_dimension() -> None:
    core = core_with(cfg=config(max_batch_size=0))
    params = {"sequence_id": 5, "sequence_start": True}
    core.admit(
        InferenceRequest(
            "running_sum", None, {"X": np.array([2.0], np.float32)}, parameters=params
        ),
        0.0,
    )
    (record,) = core.schedule(0.0).dispatched
    inputs = record.batch.items[0].request.inputs
    assert inputs["START"].shape == (1,) and inputs["SUM_IN"].shape == (1,)


def test_a_model_without_sequence_batching_ignores_sequence_parameters() -> None:
    plain = ModelConfig(
        name="plain",
        inputs=[TensorSpec(name="X", datatype="FP32", shape=[1])],
        outputs=[TensorSpec(name="SUM", datatype="FP32", shape=[1])],
    )
    core: SchedulerCore[Worker] = SchedulerCore(plain, "1")
    core.attach([Worker("w0")])
    assert not isinstance(core.batcher, SequenceBatcher)
    item = core.admit(req(77, 1.0), 0.0)  # an id never started: served statelessly
    (record,) = core.schedule(0.0).dispatched
    assert record.batch.items == [item] and set(item.request.inputs) == {"X"}


def test_no_timer_spins_once_the_last_sequence_has_ended() -> None:
    core = core_with(cfg=config(max_sequence_idle_us=500_000))
    core.admit(req(1, 1.0, start=True), 0.0)
    step(core, 0.0)  # sequence 1 idle from 0.0: a release time at 0.5
    core.admit(req(1, 1.0, end=True), 0.1)
    step(core, 0.1)  # ended and released before it could idle out
    wake = core.next_wakeup(0.2)
    assert wake is None or wake > 0.2  # a stale release time in the past would spin the loop
    core.schedule(0.6)
    assert core.next_wakeup(0.6) is None
    assert core.batcher.sequence_stats().released_idle == 0


def ids(batch: Batch) -> list[int | str | None]:
    """The sequence id of each row of ``batch`` (None for a filler row)."""
    return [i.request.parameters.get("sequence_id") for i in batch.items]


def test_direct_lays_the_batch_out_by_slot_with_filler_rows() -> None:
    core = core_with()  # direct (the default), 4 slots
    batches: list[BatchStats] = []
    core.stats.listeners.append(lambda e: batches.append(e) if isinstance(e, BatchStats) else None)
    starts = [core.admit(req(sid, float(sid), start=True), 0.0) for sid in (1, 2, 3, 4)]
    (record,) = step(core, 0.0)
    assert ids(record.batch) == [1, 2, 3, 4]  # slots 0..3
    two = core.admit(req(2, 10.0), 0.1)
    four = core.admit(req(4, 10.0), 0.1)
    (record,) = core.schedule(0.1).dispatched
    batch = record.batch
    assert ids(batch) == [None, 2, None, 4] and batch.rows == 4
    assert [type(i) is FillerRow for i in batch.items] == [True, False, True, False]
    x = stack_inputs(batch.items)
    assert x["READY"][:, 0].tolist() == [False, True, False, True]
    assert x["START"][:, 0].tolist() == [0, 0, 0, 0] and x["END"][:, 0].tolist() == [0.0] * 4
    assert x["CORRID"][:, 0].tolist() == [0, 2, 0, 4]
    assert x["X"][:, 0].tolist() == [0.0, 10.0, 0.0, 10.0]
    assert x["SUM_IN"][:, 0].tolist() == [0.0, 2.0, 0.0, 4.0]  # fillers: a dummy zero state
    done = core.complete(run(record, 0.1), 0.1)
    assert list(done.finished) == [two, four]  # filler rows are answered to nobody
    assert record.batch.items == [two, four] and record.batch.rows == 4
    assert [answer(two), answer(four)] == [12.0, 14.0]
    # the filler rows' -999 outputs never became sequences 1's and 3's state
    more = [core.admit(req(sid, 1.0), 0.2) for sid in (1, 3)]
    (record,) = core.schedule(0.2).dispatched
    assert ids(record.batch) == [1, None, 3]  # up to the highest ready slot only
    core.complete(run(record, 0.2), 0.2)
    assert [answer(i) for i in more] == [2.0, 4.0]
    assert [answer(i) for i in starts] == [1.0, 2.0, 3.0, 4.0]
    assert core.stats.inference_count == 8  # requests only, never filler rows
    assert [(b.batch_size, b.requests) for b in batches] == [(4, 4), (4, 2), (3, 2)]
    assert sorted(core.stats.batch_sizes) == [3, 4]  # executed sizes include filler rows
    assert core.in_flight_requests == 0


def test_direct_rows_of_other_shapes_wait_as_filler_rows() -> None:
    core = core_with(cfg=config(shape=(-1,)))

    def wide(sid: int, n: int, start: bool = False) -> InferenceRequest:
        return InferenceRequest(
            "running_sum",
            None,
            {"X": np.ones((1, n), np.float32)},
            parameters={"sequence_id": sid, "sequence_start": start},
        )

    core.admit(wide(2, 3, start=True), 0.0)  # slot 0
    core.admit(wide(1, 2, start=True), 0.0)  # slot 1
    (record,) = core.schedule(0.0).dispatched  # the oldest (slot 0) leads: width 3
    assert ids(record.batch) == [2]
    core.complete(
        BatchResult(record.batch, [{"SUM": np.zeros((1, 3)), "SUM_OUT": np.zeros((1, 3))}]), 0.0
    )
    (record,) = core.schedule(0.1).dispatched
    assert ids(record.batch) == [None, 1]
    filler = record.batch.items[0].request.inputs
    assert filler["X"].shape == (1, 2) and filler["SUM_IN"].shape == (1, 0)


def test_a_failed_direct_batch_fails_its_requests_without_halves() -> None:
    core = core_with()
    first = [core.admit(req(sid, 1.0, start=True), 0.0) for sid in (1, 2, 3)]
    step(core, 0.0)
    a, c = core.admit(req(1, 1.0), 0.1), core.admit(req(3, 1.0), 0.1)
    (record,) = core.schedule(0.1).dispatched
    assert ids(record.batch) == [1, None, 3]
    done = core.complete(BatchResult(record.batch, error=BackendError("oom")), 0.1)
    assert list(done.finished) == [a, c] and not done.retried and not core.retrying
    assert isinstance(a.outcome, BackendError) and isinstance(c.outcome, BackendError)
    assert core.in_flight_requests == 0
    again = core.admit(req(1, 5.0), 0.2)
    step(core, 0.2)
    assert answer(again) == 6.0 and answer(first[0]) == 1.0  # the failure left the state


def test_a_row_error_of_a_filler_row_fails_nobody() -> None:
    core = core_with()
    for sid in (1, 2):
        core.admit(req(sid, 1.0, start=True), 0.0)
    step(core, 0.0)
    b = core.admit(req(2, 2.0), 0.1)
    (record,) = core.schedule(0.1).dispatched
    items = record.batch.items
    outputs = {"SUM": np.array([[0.0], [3.0]], np.float32), "SUM_OUT": np.array([[0.0], [3.0]])}
    results = split_outputs(SPEC, items, outputs, row_errors={0: "no outputs for a filler"})
    done = core.complete(BatchResult(record.batch, results), 0.1)
    assert list(done.finished) == [b] and answer(b) == 3.0


def test_a_hung_instance_fails_the_requests_of_a_direct_batch_not_its_fillers() -> None:
    core = core_with(cfg=config(timeout_s=1.0))
    for sid in (1, 2):
        core.admit(req(sid, 1.0, start=True), 0.0)
    step(core, 0.0)
    b = core.admit(req(2, 1.0), 0.1)
    (record,) = core.schedule(0.1).dispatched
    record.instance.in_flight = 1
    assert ids(record.batch) == [None, 2]
    (hung,) = core.hung(1.2, respawn=True)
    assert hung.finished == [b] and isinstance(b.outcome, BackendError)
    assert core.in_flight_requests == 0
    assert core.stats.fail_reasons and sum(core.stats.fail_reasons.values()) == 1


def test_oldest_packs_rows_without_fillers() -> None:
    core = core_with(cfg=config({"oldest": {"max_candidate_sequences": 4}}))
    for sid in (1, 2, 3):
        core.admit(req(sid, 1.0, start=True), 0.0)
    step(core, 0.0)
    core.admit(req(3, 1.0), 0.1)
    (record,) = core.schedule(0.1).dispatched
    assert ids(record.batch) == [3] and record.batch.rows == 1
