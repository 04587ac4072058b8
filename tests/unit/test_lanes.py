"""The two lanes of a model's queue on a fake clock: interactive rows lead every batch, bulk
rows fill what is left, a bulk-led batch goes only to an idle instance (so a bulk backlog
holds an interactive request back by at most the batch running when it arrives), each lane
has its own queue limit and its own statistics; and the generation scheduler's equivalent."""

from __future__ import annotations

import pytest

from gpuserve.engine.generate.blocks import BlockManager
from gpuserve.engine.generate.scheduler import GenerationScheduler
from gpuserve.engine.generate.sequence import Sequence
from gpuserve.engine.stats import RequestStats
from gpuserve.errors import OverloadedError
from gpuserve.service.apis.chunks import BULK_ROWS_IN_FLIGHT, WINDOW, ChunkPlan, chunk_plan
from gpuserve.service.lanes import parse_lane
from tests.unit.test_scheduler_core import Worker, config, core_with, request, run, values


def bulk(rows: int = 1, value: float = 0.0):
    r = request(rows, value)
    r.lane = "bulk"
    return r


def test_interactive_rows_lead_and_bulk_rows_fill_the_rest_of_the_batch():
    worker = Worker("w0")
    # bulk_quiet_us=0: no compute bound on the fill (that bound: test_batcher.py)
    core, _ = core_with(worker, cfg=config(max_batch_size=4, bulk_quiet_us=0))
    core.admit(request(value=-1), 0.0)
    (first,) = core.schedule(0.0).dispatched  # the instance is busy from here on
    for i in range(5):
        core.admit(bulk(value=100 + i), 0.001)
    core.admit(request(value=1), 0.002)
    core.admit(request(value=2), 0.003)
    core.complete(run(first, 0.0, 0.004), 0.004)
    (second,) = core.schedule(0.004).dispatched
    assert values(second.batch.items) == [1, 2, 100, 101]  # interactive first, then bulk


def test_a_bulk_led_batch_goes_only_to_an_idle_instance():
    worker = Worker("w0", capacity=2)  # a pipelined instance: room for two batches
    core, _ = core_with(worker, cfg=config(max_batch_size=2, bulk_quiet_us=0))
    core.admit(bulk(value=100), 0.0)
    core.admit(bulk(value=101), 0.0)
    core.admit(bulk(value=102), 0.0)
    (first,) = core.schedule(0.0).dispatched  # idle: bulk may lead
    assert values(first.batch.items) == [100, 101]
    assert not core.schedule(0.001).dispatched  # busy: the bulk backlog waits
    assert core.next_wakeup(0.001) is None  # and sets no timer (the completion pumps)
    core.admit(request(value=1), 0.002)
    (second,) = core.schedule(0.002).dispatched  # interactive goes into the free slot
    assert values(second.batch.items) == [1, 102]  # ... with a bulk row filling it
    assert worker.in_flight == 2


def test_without_the_idle_rule_bulk_would_fill_the_pipeline():
    """What the rule prevents: with interactive rows only, a second batch does go out."""
    worker = Worker("w0", capacity=2)
    core, _ = core_with(worker, cfg=config(max_batch_size=2))
    for i in range(3):
        core.admit(request(value=i), 0.0)
    assert len(core.schedule(0.0).dispatched) == 2


def test_each_lane_has_its_own_queue_limit():
    worker = Worker("w0")
    core, _ = core_with(worker, cfg=config(max_queue_size=2, bulk_max_queue_size=3))
    core.admit(request(value=-1), 0.0)
    core.schedule(0.0)  # busy
    for i in range(3):
        core.admit(bulk(value=i), 0.0)
    with pytest.raises(OverloadedError, match="bulk_max_queue_size"):
        core.admit(bulk(), 0.0)
    core.admit(request(), 0.0)  # the interactive lane still takes requests
    core.admit(request(), 0.0)
    with pytest.raises(OverloadedError, match="2 requests waiting"):
        core.admit(request(), 0.0)
    assert core.batcher.lane_queued() == (2, 3)


def test_each_finished_request_says_its_lane():
    worker = Worker("w0")
    core, events = core_with(worker, cfg=config(max_batch_size=8, bulk_quiet_us=0))
    core.admit(request(2), 0.0)
    core.admit(bulk(3), 0.0)
    (record,) = core.schedule(0.5).dispatched
    core.complete(run(record, 0.5, 0.6), 0.6)
    finished = [(e.lane, e.rows, e.queue_s) for e in events if isinstance(e, RequestStats)]
    assert finished == [("interactive", 2, pytest.approx(0.5)), ("bulk", 3, pytest.approx(0.5))]


def test_lane_values_are_checked():
    assert parse_lane("bulk", "x") == "bulk"
    with pytest.raises(Exception, match="header x-gpuserve-lane must be one of"):
        parse_lane("batch", "header x-gpuserve-lane")


# -- generation ------------------------------------------------------------------------------


def _seq(seq_id: int, is_bulk: bool, prompt: int = 4) -> Sequence:
    return Sequence(seq_id, str(seq_id), list(range(1, prompt + 1)), 8, 0.0, bulk=is_bulk)


def test_interactive_sequences_wait_ahead_of_bulk_and_take_a_bulk_slot():
    scheduler = GenerationScheduler(BlockManager(64, 4, False), 2, 64, lambda: 0.0)
    scheduler.add(_seq(1, True))
    scheduler.add(_seq(2, True))
    scheduler.add(_seq(3, True))
    plan = scheduler.schedule()
    assert plan is not None and [c.seq.seq_id for c in plan.chunks] == [1, 2]
    scheduler.complete(plan, {1: 7, 2: 7})
    scheduler.add(_seq(4, False))
    assert [s.seq_id for s in scheduler.waiting] == [4, 3]  # ahead of the waiting bulk one
    plan = scheduler.schedule()  # both slots hold bulk: the newest bulk gives its slot
    assert plan is not None
    assert [s.seq_id for s in plan.made_room] == [2]
    assert 4 in [c.seq.seq_id for c in plan.chunks]
    assert 2 not in [c.seq.seq_id for c in plan.chunks]
    assert [s.seq_id for s in scheduler.waiting] == [2, 3]  # it will be recomputed


def test_bulk_sequences_are_preempted_first_when_blocks_run_out():
    scheduler = GenerationScheduler(BlockManager(4, 4, False), 4, 64, lambda: 0.0)
    scheduler.add(_seq(1, False, prompt=4))  # older, interactive
    scheduler.add(_seq(2, True, prompt=4))
    scheduler.add(_seq(3, False, prompt=4))
    plan = scheduler.schedule()
    assert plan is not None
    scheduler.complete(plan, {c.seq.seq_id: 9 for c in plan.chunks if c.samples})
    plan = scheduler.schedule()  # each needs a new block; one block free: bulk goes first
    assert plan is not None and [s.seq_id for s in plan.preempted][:1] == [2]


def test_no_batch_carries_more_than_bulk_max_batch_size_bulk_rows():
    worker = Worker("w0")
    core, _ = core_with(
        worker, cfg=config(max_batch_size=8, bulk_max_batch_size=2, bulk_quiet_us=0)
    )
    for i in range(6):
        core.admit(bulk(value=100 + i), 0.0)
    (first,) = core.schedule(0.0).dispatched
    assert values(first.batch.items) == [100, 101]  # led by bulk: bulk_max_batch_size rows
    core.admit(request(value=1), 0.001)
    core.complete(run(first, 0.0, 0.002), 0.002)
    (second,) = core.schedule(0.002).dispatched
    assert values(second.batch.items) == [1, 102, 103]  # led by interactive: 2 bulk rows more


def test_bulk_calls_are_cut_into_short_chunks_with_more_of_them_in_flight():
    live = config(max_batch_size=64)
    assert chunk_plan([live], bulk=False) == ChunkPlan(64, WINDOW)
    assert chunk_plan([live], bulk=True) == ChunkPlan(1, BULK_ROWS_IN_FLIGHT)  # the default
    two = config(max_batch_size=64, bulk_chunk_rows=2)
    small = config(max_batch_size=64, bulk_chunk_rows=8, bulk_max_batch_size=4)
    assert chunk_plan([two, small], bulk=True) == ChunkPlan(2, BULK_ROWS_IN_FLIGHT // 2)
    assert chunk_plan([small], bulk=True) == ChunkPlan(4, BULK_ROWS_IN_FLIGHT // 4)
    assert chunk_plan([config(max_batch_size=1)], bulk=True) == ChunkPlan(1, BULK_ROWS_IN_FLIGHT)


class _Service:
    """The inference service as serve_chunks uses it: admissions recorded in ``log``, each
    chunk answered at once."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def admit_loaded(self, model, version, wire, probe, traceparent):
        return self.admit(model, version, wire, probe, traceparent)

    def admit(self, model, version, wire, probe, traceparent):
        import types

        self.log.append(f"chunk {wire}")
        return types.SimpleNamespace(version="1")

    def submit(self, admission):
        import asyncio

        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


@pytest.mark.parametrize("lane", ["interactive", "bulk"])
def test_a_bulk_call_yields_the_event_loop_between_its_chunks(lane):
    """A bulk call admits its chunks one per turn of the event loop, so a request arriving
    meanwhile is admitted between them; an interactive call admits its window at once."""
    import asyncio

    from gpuserve.service.apis.chunks import CallState, serve_chunks
    from gpuserve.service.lanes import LANE

    log: list[str] = []

    async def main() -> None:
        async def other() -> None:
            log.append("other")

        token = LANE.set(lane)
        try:
            call = asyncio.ensure_future(
                serve_chunks(_Service(log), "m", lambda i: i, 4, CallState(None), window=4)
            )
        finally:
            LANE.reset(token)
        asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(other()))
        await call

    asyncio.run(main())
    first_other = log.index("other")
    if lane == "bulk":
        assert first_other < 4, log  # let in before the call's window was all admitted
    else:
        assert first_other == 4, log
