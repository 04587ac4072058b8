"""The scheduler and instances together, with in-test backends and no sockets."""

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
from gpuserve.errors import BackendError, OverloadedError, RequestTimeoutError


class Doubler(Backend):
    """OUTPUT0 = 2 * INPUT0; fails when a row starts with -999; records batch sizes."""

    def __init__(self, delay_s: float = 0.0, drop_row: bool = False) -> None:
        self.delay_s = delay_s
        self.drop_row = drop_row
        self.batches: list[int] = []
        self.gate = threading.Event()
        self.gate.set()

    def load(self, context: LoadContext) -> None:
        pass

    def preprocess(self, inputs):
        return inputs["INPUT0"]

    def forward(self, x):
        self.gate.wait()
        self.batches.append(x.shape[0])
        if (x[:, 0] == -999).any():
            raise ValueError("marker row")
        time.sleep(self.delay_s)
        y = x * 2
        return y[:-1] if self.drop_row else y

    def postprocess(self, y):
        return {"OUTPUT0": y}


def make_config(**batching) -> ModelConfig:
    return ModelConfig(
        name="double",
        max_batch_size=8,
        inputs=[TensorSpec(name="INPUT0", datatype="FP32", shape=[4])],
        outputs=[TensorSpec(name="OUTPUT0", datatype="FP32", shape=[4])],
        dynamic_batching=batching,
    )


def start(config: ModelConfig, backend: Backend) -> ModelScheduler:
    scheduler = ModelScheduler(config, "1")
    context = LoadContext(config=config, version_path=Path("."), version=1)
    instance = Instance("double:1#0", backend, context, scheduler.on_batch_done)
    instance.start()
    scheduler.attach([instance], asyncio.get_running_loop())
    return scheduler


def request(rows: int, start_value: float, **kwargs) -> InferenceRequest:
    x = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) + start_value
    return InferenceRequest("double", None, {"INPUT0": x}, **kwargs)


def test_concurrent_requests_batch_and_each_gets_its_own_rows():
    async def main():
        backend = Doubler()
        backend.gate.clear()  # hold the first batch so the others queue up behind it
        scheduler = start(make_config(), backend)
        first = asyncio.ensure_future(scheduler.infer(request(1, 1000.0)))
        await asyncio.sleep(0.05)
        sizes = [1, 3, 2, 2]
        tasks = [
            asyncio.ensure_future(scheduler.infer(request(n, 100.0 * i)))
            for i, n in enumerate(sizes)
        ]
        await asyncio.sleep(0.05)
        backend.gate.set()
        results = await asyncio.gather(first, *tasks)
        for i, (n, result) in enumerate(zip(sizes, results[1:], strict=True)):
            expected = (np.arange(n * 4, dtype=np.float32).reshape(n, 4) + 100.0 * i) * 2
            np.testing.assert_array_equal(result.outputs["OUTPUT0"], expected)
        assert backend.batches == [1, 8]
        assert scheduler.stats.execution_count == 2
        assert scheduler.stats.inference_count == 9
        await scheduler.close()

    asyncio.run(main())


def test_a_failing_request_fails_alone():
    async def main():
        backend = Doubler()
        backend.gate.clear()
        scheduler = start(make_config(), backend)
        blocker = asyncio.ensure_future(scheduler.infer(request(1, 0.0)))
        await asyncio.sleep(0.05)
        good = [asyncio.ensure_future(scheduler.infer(request(1, 10.0 * i))) for i in range(3)]
        bad = asyncio.ensure_future(scheduler.infer(request(1, -999.0)))
        await asyncio.sleep(0.05)
        backend.gate.set()
        await blocker
        for task in good:
            assert (await task).outputs["OUTPUT0"].shape == (1, 4)
        with pytest.raises(BackendError, match="marker row"):
            await bad
        assert scheduler.stats.fail_reasons["backend_error"] == 1
        await scheduler.close()

    asyncio.run(main())


def test_wrong_row_count_fails_every_member_with_a_clear_message():
    async def main():
        scheduler = start(make_config(), Doubler(drop_row=True))
        with pytest.raises(
            BackendError, match="returned 2 rows in output 'OUTPUT0' for a batch of 3"
        ):
            await scheduler.infer(request(3, 0.0))
        await scheduler.close()

    asyncio.run(main())


def test_full_queue_is_refused_immediately_and_queue_timeout_never_runs_the_request():
    async def main():
        backend = Doubler(delay_s=0.3)
        scheduler = start(make_config(max_queue_size=1), backend)
        running = asyncio.ensure_future(scheduler.infer(request(1, 0.0)))
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(scheduler.infer(request(1, 5.0, timeout_us=100_000)))
        await asyncio.sleep(0.01)
        t0 = time.monotonic()
        with pytest.raises(OverloadedError):
            await scheduler.infer(request(1, 9.0))
        assert time.monotonic() - t0 < 0.05
        with pytest.raises(RequestTimeoutError, match="timed out in the queue"):
            await queued
        await running
        assert backend.batches == [1]  # the timed-out request never ran
        assert scheduler.stats.fail_reasons == {"rejected": 1, "timeout": 1}
        await scheduler.close()

    asyncio.run(main())


def test_cancelled_queued_request_is_removed():
    async def main():
        backend = Doubler(delay_s=0.2)
        scheduler = start(make_config(), backend)
        running = asyncio.ensure_future(scheduler.infer(request(1, 0.0)))
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(scheduler.infer(request(1, 5.0)))
        await asyncio.sleep(0.01)
        queued.cancel()
        await running
        await asyncio.sleep(0.3)
        assert backend.batches == [1]
        assert len(scheduler.batcher) == 0 and scheduler.in_flight_requests == 0
        await scheduler.close()

    asyncio.run(main())
