"""Property test of the scheduling core: whatever happens (arrivals, timeouts, clients leaving,
failed and retried batches, hung instances, replacements, shutdown), every admitted request
finishes exactly once, is never run after it finished, and the counters agree."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuserve.config import ModelConfig, TensorSpec
from gpuserve.engine.batch import BatchResult, Pending
from gpuserve.engine.request import InferenceRequest, InferenceResponse
from gpuserve.engine.scheduling import InFlight, SchedulerCore
from gpuserve.errors import BackendError, GpuserveError, OverloadedError


@dataclass(eq=False)
class Worker:
    name: str
    capacity: int = 1
    in_flight: int = 0


operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("admit"),
            st.integers(1, 3),  # rows
            st.booleans(),  # with a queue timeout
            st.integers(1, 2),  # priority
            st.integers(1, 2),  # shape (2 keys)
        ),
        st.tuples(st.just("schedule")),
        st.tuples(st.just("complete"), st.integers(0, 7), st.sampled_from(["ok", "err", "bad"])),
        st.tuples(st.just("hung")),
        st.tuples(st.just("cancel"), st.integers(0, 30)),
        st.tuples(st.just("gone"), st.integers(0, 30)),
        st.tuples(st.just("replace")),
        st.tuples(st.just("wait"), st.floats(0.0, 0.4)),
    ),
    max_size=80,
)


def config(delay_us: int) -> ModelConfig:
    return ModelConfig(
        name="m",
        max_batch_size=4,
        execution_timeout_s=0.5,
        inputs=[TensorSpec(name="x", datatype="FP32", shape=[-1])],
        outputs=[TensorSpec(name="y", datatype="FP32", shape=[-1])],
        dynamic_batching={
            "max_queue_delay_us": delay_us,
            "max_queue_size": 10,
            "priority_levels": 2,
        },
    )


def result(record: InFlight[Worker], kind: str, at: float) -> BatchResult:
    batch = record.batch
    if kind == "ok":
        results: list = [{"y": item.request.inputs["x"]} for item in batch.items]
        return BatchResult(batch, results, started_s=at, finished_s=at)
    return BatchResult(batch, error=BackendError(kind), retryable=kind == "err", started_s=at)


@settings(max_examples=200, deadline=None)
@given(operations, st.sampled_from([0, 10_000]), st.booleans())
def test_every_request_finishes_exactly_once(ops, delay_us, respawn):
    core: SchedulerCore[Worker] = SchedulerCore(config(delay_us), "1")
    core.attach([Worker("w0", capacity=2), Worker("w1")])
    now = 0.0
    admitted: list[Pending] = []
    gone: set[int] = set()
    finished: dict[int, int] = {}
    running: list[InFlight[Worker]] = []
    spawned = 2

    def finish(items) -> None:
        for item in items:
            assert isinstance(item.outcome, (GpuserveError, InferenceResponse))
            finished[id(item)] = finished.get(id(item), 0) + 1
            assert finished[id(item)] == 1, "finished twice"

    def schedule() -> None:
        plan = core.schedule(now)
        finish(plan.finished)
        for record in plan.dispatched:
            for item in record.batch.items:
                assert id(item) not in finished, "ran after it finished"
            running.append(record)

    for op in ops:
        kind = op[0]
        if kind == "admit":
            _, rows, timeout, priority, shape = op
            index = len(admitted)
            request = InferenceRequest(
                "m",
                None,
                {"x": np.zeros((rows, shape), np.float32)},
                priority=priority,
                timeout_us=200_000 if timeout else None,
                is_cancelled=lambda index=index: index in gone,
            )
            try:
                admitted.append(core.admit(request, now))
            except OverloadedError:
                assert core.queued == 10
        elif kind == "schedule":
            schedule()
        elif kind == "complete" and running:
            record = running.pop(op[1] % len(running))
            done = core.complete(result(record, op[2], now), now)
            finish(done.finished)
        elif kind == "hung":
            for hung in core.hung(now, respawn):
                finish(hung.finished)
        elif kind == "cancel" and admitted:
            item = admitted[op[1] % len(admitted)]
            if core.cancel(item, now):
                finish([item])
        elif kind == "gone" and admitted:
            gone.add(op[1] % len(admitted))
        elif kind == "replace" and respawn and len(core.instances) < 2:
            core.add_instance(Worker(f"w{spawned}"))
            spawned += 1
        elif kind == "wait":
            now += op[1]
        busy = sum(w.in_flight for w in core.instances)
        assert busy == sum(1 for r in core.in_flight if r.instance in core.instances)
        assert core.in_flight_requests == len(admitted) - len(finished)

    # shutdown: let everything still running answer, then drain what waits
    core.close()
    for _ in range(50):
        if not running and not core.retrying:
            break
        while running:
            record = running.pop()
            finish(core.complete(result(record, "ok", now), now).finished)
        if not core.instances:
            core.add_instance(Worker("last"))
        schedule()
    finish(core.drain(BackendError("unloaded"), now))
    assert core.in_flight_requests == 0 and core.queued == 0 and core.retrying == []
    assert sorted(finished) == sorted(id(item) for item in admitted)
    assert all(item.outcome is not None for item in admitted)
