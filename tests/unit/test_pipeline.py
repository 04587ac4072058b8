"""Instance pipelining, several instances, and out-of-memory splitting, with in-test backends.

Overlap is shown by events, not wall time: a stage waits for an event that only another
stage running at the same time can set, so a pipeline that did not overlap would stall (and
fail the wait) instead of being merely slower.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest

from gpuserve.backends.base import Backend, LoadContext
from gpuserve.config import ModelConfig, TensorSpec
from gpuserve.engine.instance import Instance
from gpuserve.engine.request import InferenceRequest
from gpuserve.engine.runners.batching import ModelScheduler
from gpuserve.errors import OutOfMemoryError

WAIT_S = 10.0  # only reached when the overlap under test is missing


class RecordedStages(Backend):
    """Records (stage, batch value, thread) per stage; optional hooks block a stage."""

    def __init__(self) -> None:
        self.log: list[tuple[str, float, str]] = []
        self.lock = threading.Lock()
        self.done: dict[tuple[str, float], threading.Event] = {}
        self.before_forward = lambda value: None

    def load(self, context: LoadContext) -> None:
        pass

    def _record(self, stage: str, value: float) -> None:
        with self.lock:
            self.log.append((stage, value, threading.current_thread().name))
            self.done.setdefault((stage, value), threading.Event()).set()

    def finished(self, stage: str, value: float) -> threading.Event:
        with self.lock:
            return self.done.setdefault((stage, value), threading.Event())

    def preprocess(self, inputs):
        x = inputs["INPUT0"]
        self._record("pre", float(x[0, 0]))
        return x

    def forward(self, x):
        self.before_forward(float(x[0, 0]))
        self._record("fwd", float(x[0, 0]))
        return x * 2

    def postprocess(self, y):
        self._record("post", float(y[0, 0]) / 2)
        return {"OUTPUT0": y}


class MeetInForward(Backend):
    """Every forward waits at a barrier shared by all instances: it passes only while as many
    forwards run at once as the barrier has parties."""

    def __init__(self, barrier: threading.Barrier) -> None:
        self.barrier = barrier
        self.forward_threads: set[str] = set()

    def load(self, context: LoadContext) -> None:
        pass

    def preprocess(self, inputs):
        return inputs["INPUT0"]

    def forward(self, x):
        self.forward_threads.add(threading.current_thread().name)
        self.barrier.wait(WAIT_S)
        return x * 2

    def postprocess(self, y):
        return {"OUTPUT0": y}


class OomAbove(Backend):
    """Raises a CUDA-style out-of-memory error for batches above ``limit`` rows; each forward
    waits for ``gate``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.sizes: list[int] = []
        self.gate = threading.Event()
        self.gate.set()

    def load(self, context: LoadContext) -> None:
        pass

    def preprocess(self, inputs):
        return inputs["INPUT0"]

    def forward(self, x):
        assert self.gate.wait(WAIT_S)
        self.sizes.append(x.shape[0])
        if x.shape[0] > self.limit:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return x * 2

    def postprocess(self, y):
        return {"OUTPUT0": y}


def config(max_batch_size: int = 1) -> ModelConfig:
    return ModelConfig(
        name="m",
        max_batch_size=max_batch_size,
        inputs=[TensorSpec(name="INPUT0", datatype="FP32", shape=[4])],
        outputs=[TensorSpec(name="OUTPUT0", datatype="FP32", shape=[4])],
    )


def start(cfg: ModelConfig, backends: list[Backend], depth: int) -> ModelScheduler:
    scheduler = ModelScheduler(cfg, "1")
    instances = []
    for i, backend in enumerate(backends):
        context = LoadContext(config=cfg, version_path=Path("."), version=1, instance_index=i)
        instance = Instance(f"m:1#{i}", backend, context, scheduler.on_batch_done, depth)
        instance.start()
        instances.append(instance)
    scheduler.attach(instances, asyncio.get_running_loop())
    return scheduler


def request(value: float, rows: int = 1) -> InferenceRequest:
    x = np.full((rows, 4), value, dtype=np.float32)
    return InferenceRequest("m", None, {"INPUT0": x})


async def run_requests(scheduler: ModelScheduler, n: int) -> None:
    results = await asyncio.gather(*(scheduler.infer(request(float(i))) for i in range(n)))
    for i, result in enumerate(results):
        np.testing.assert_array_equal(result.outputs["OUTPUT0"], np.full((1, 4), 2.0 * i))


def test_pipelined_stages_overlap_three_batches():
    backend = RecordedStages()
    met: list[bool] = []

    def forward_waits_for_the_neighbours(value: float) -> None:
        if value == 1.0:  # batch 1 computes while batch 0 is postprocessed and 2 preprocessed
            met.append(backend.finished("post", 0.0).wait(WAIT_S))
            met.append(backend.finished("pre", 2.0).wait(WAIT_S))

    backend.before_forward = forward_waits_for_the_neighbours

    async def main() -> None:
        scheduler = start(config(), [backend], 3)
        assert scheduler.instances[0].capacity == 3
        await run_requests(scheduler, 6)
        await scheduler.close()

    asyncio.run(main())
    assert met == [True, True]
    threads = {stage: {t for s, _, t in backend.log if s == stage} for stage in ("pre", "fwd")}
    assert len(threads["pre"]) == 1 and len(threads["fwd"]) == 1
    assert threads["pre"] != threads["fwd"]  # one thread per stage
    # each stage still sees the batches in order
    for stage in ("pre", "fwd", "post"):
        assert [v for s, v, _ in backend.log if s == stage] == [float(i) for i in range(6)]


def test_without_pipelining_the_stages_run_one_batch_at_a_time():
    backend = RecordedStages()

    async def main() -> None:
        scheduler = start(config(), [backend], 1)
        assert scheduler.instances[0].capacity == 1
        await run_requests(scheduler, 4)
        await scheduler.close()

    asyncio.run(main())
    expected = [(stage, float(i)) for i in range(4) for stage in ("pre", "fwd", "post")]
    assert [(s, v) for s, v, _ in backend.log] == expected
    assert len({t for _, _, t in backend.log}) == 1  # one thread runs every stage


def test_two_instances_serve_concurrently():
    barrier = threading.Barrier(2)
    backends = [MeetInForward(barrier), MeetInForward(barrier)]

    async def main() -> None:
        scheduler = start(config(), backends, 1)
        await run_requests(scheduler, 8)  # four rounds, both instances in forward at once
        await scheduler.close()

    asyncio.run(main())
    assert not barrier.broken
    threads = backends[0].forward_threads | backends[1].forward_threads
    assert len(threads) == 2  # both instances ran batches


def test_out_of_memory_batch_is_split_and_every_caller_gets_its_rows():
    async def main() -> None:
        backend = OomAbove(limit=2)
        backend.gate.clear()
        scheduler = start(config(max_batch_size=8), [backend], 1)
        blocker = scheduler.submit(request(0.0))  # holds the instance while 8 queue up
        values = [float(i + 1) for i in range(8)]
        futures = [scheduler.submit(request(v)) for v in values]
        backend.gate.set()
        await blocker
        results = await asyncio.gather(*futures)
        for v, result in zip(values, results, strict=True):
            np.testing.assert_array_equal(result.outputs["OUTPUT0"], np.full((1, 4), 2 * v))
        assert backend.sizes == [1, 8, 4, 4, 2, 2, 2, 2]
        # a single request too big for the device fails alone, with a retryable 503-kind error
        with pytest.raises(OutOfMemoryError, match="out of memory"):
            await scheduler.infer(request(1.0, rows=3))
        result = await scheduler.infer(request(5.0, rows=2))
        np.testing.assert_array_equal(result.outputs["OUTPUT0"], np.full((2, 4), 10.0))
        assert scheduler.stats.fail_reasons == {"out_of_memory": 1}
        await scheduler.close()

    asyncio.run(main())
