"""Instance pipelining, several instances, and out-of-memory splitting, with in-test backends."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from gpuserve.backends.base import Backend, LoadContext
from gpuserve.config import ModelConfig, TensorSpec
from gpuserve.engine.instance import Instance
from gpuserve.engine.request import InferenceRequest
from gpuserve.engine.scheduler import ModelScheduler
from gpuserve.errors import OutOfMemoryError


class SleepyStages(Backend):
    """Each stage sleeps (sleep releases the GIL, like device work or tokenisers in C)."""

    def __init__(self, p: float, f: float, q: float) -> None:
        self.p, self.f, self.q = p, f, q
        self.forward_threads: set[str] = set()

    def load(self, context: LoadContext) -> None:
        pass

    def preprocess(self, inputs):
        time.sleep(self.p)
        return inputs["INPUT0"]

    def forward(self, x):
        self.forward_threads.add(threading.current_thread().name)
        time.sleep(self.f)
        return x * 2

    def postprocess(self, y):
        time.sleep(self.q)
        return {"OUTPUT0": y}


class OomAbove(Backend):
    """Raises a CUDA-style out-of-memory error for batches above ``limit`` rows."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.sizes: list[int] = []

    def load(self, context: LoadContext) -> None:
        pass

    def preprocess(self, inputs):
        return inputs["INPUT0"]

    def forward(self, x):
        self.sizes.append(x.shape[0])
        if x.shape[0] > self.limit:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return x * 2

    def postprocess(self, y):
        return {"OUTPUT0": y}


def config(max_batch_size: int = 1, delay_us: int = 0) -> ModelConfig:
    return ModelConfig(
        name="m",
        max_batch_size=max_batch_size,
        inputs=[TensorSpec(name="INPUT0", datatype="FP32", shape=[4])],
        outputs=[TensorSpec(name="OUTPUT0", datatype="FP32", shape=[4])],
        dynamic_batching={"max_queue_delay_us": delay_us},
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


async def run_requests(scheduler: ModelScheduler, n: int) -> float:
    t0 = time.monotonic()
    results = await asyncio.gather(*(scheduler.infer(request(float(i))) for i in range(n)))
    elapsed = time.monotonic() - t0
    for i, result in enumerate(results):
        np.testing.assert_array_equal(result.outputs["OUTPUT0"], np.full((1, 4), 2.0 * i))
    return elapsed


def test_pipelined_stages_overlap_towards_one_over_max_stage_time():
    p, f, q, n = 0.02, 0.03, 0.02, 20

    async def main(depth: int) -> float:
        scheduler = start(config(), [SleepyStages(p, f, q)], depth)
        elapsed = await run_requests(scheduler, n)
        await scheduler.close()
        return elapsed

    serial = asyncio.run(main(1))
    pipelined = asyncio.run(main(3))
    # serial ~ n * (p + f + q) = 1.4 s; pipelined ~ n * max(p, f, q) + p + q = 0.64 s
    assert serial >= n * (p + f + q) * 0.95
    assert pipelined < n * max(p, f, q) * 1.5, (serial, pipelined)
    assert serial / pipelined > 1.6


def test_two_instances_serve_concurrently():
    async def main() -> tuple[float, set[str]]:
        backends = [SleepyStages(0.0, 0.1, 0.0), SleepyStages(0.0, 0.1, 0.0)]
        scheduler = start(config(), backends, 1)
        elapsed = await run_requests(scheduler, 8)
        await scheduler.close()
        return elapsed, backends[0].forward_threads | backends[1].forward_threads

    elapsed, threads = asyncio.run(main())
    assert len(threads) == 2  # both instances ran batches
    assert elapsed < 8 * 0.1 * 0.75  # ~0.4 s with two, 0.8 s with one


def test_out_of_memory_batch_is_split_and_every_caller_gets_its_rows():
    async def main() -> None:
        backend = OomAbove(limit=2)
        scheduler = start(config(max_batch_size=8, delay_us=200_000), [backend], 1)
        values = [float(i + 1) for i in range(8)]
        results = await asyncio.gather(*(scheduler.infer(request(v)) for v in values))
        for v, result in zip(values, results, strict=True):
            np.testing.assert_array_equal(result.outputs["OUTPUT0"], np.full((1, 4), 2 * v))
        assert backend.sizes[0] == 8 and max(backend.sizes[1:]) <= 4
        # a single request too big for the device fails alone, with a retryable 503-kind error
        with pytest.raises(OutOfMemoryError, match="out of memory"):
            await scheduler.infer(request(1.0, rows=3))
        result = await scheduler.infer(request(5.0, rows=2))
        np.testing.assert_array_equal(result.outputs["OUTPUT0"], np.full((2, 4), 10.0))
        await scheduler.close()

    asyncio.run(main())
