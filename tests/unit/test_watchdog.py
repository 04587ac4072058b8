"""Crash containment (BC-22, in-process variant): an instance that hangs is detected by the
execution-time watchdog, its requests get an error instead of silence, and a replacement
instance serves the requests that follow.

The watchdog's rules (deadlines, which batches fail, the late result) are tested on a fake
clock in test_scheduler_core.py; this test runs them with real instance threads and the
driver's one loop timer, ordered by events (the only wait is the short watchdog timeout)."""

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
from gpuserve.errors import BackendError


class HangsOnMarker(Backend):
    """Blocks (until ``release`` is set) on a row whose first value is -1."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def load(self, context: LoadContext) -> None:
        pass

    def preprocess(self, inputs):
        return inputs["INPUT0"]

    def forward(self, x):
        if (x[:, 0] == -1).any():
            self.release.wait(30)
        return x * 2

    def postprocess(self, y):
        return {"OUTPUT0": y}


CONFIG = ModelConfig(
    name="m",
    max_batch_size=4,
    execution_timeout_s=0.05,
    inputs=[TensorSpec(name="INPUT0", datatype="FP32", shape=[2])],
    outputs=[TensorSpec(name="OUTPUT0", datatype="FP32", shape=[2])],
)


def request(value: float) -> InferenceRequest:
    return InferenceRequest("m", None, {"INPUT0": np.full((1, 2), value, np.float32)})


def test_hung_instance_fails_its_requests_and_is_replaced():
    release = threading.Event()

    async def main() -> None:
        scheduler = ModelScheduler(CONFIG, "1")
        created: list[Instance] = []
        may_respawn = asyncio.Event()

        def make(index: int) -> Instance:
            ctx = LoadContext(config=CONFIG, version_path=Path("."), version=1)
            instance = Instance(
                f"m:1#{index}", HangsOnMarker(release), ctx, scheduler.on_batch_done
            )
            instance.start()
            created.append(instance)
            return instance

        async def respawn(dead: Instance) -> Instance:
            await may_respawn.wait()  # a replacement takes a while to load
            return await asyncio.get_running_loop().run_in_executor(None, make, len(created))

        scheduler.attach([make(0)], asyncio.get_running_loop(), respawn)
        assert (await scheduler.infer(request(1.0))).outputs["OUTPUT0"][0, 0] == 2.0
        with pytest.raises(BackendError, match=r"m:1#0 did not finish within 0\.05 s"):
            await asyncio.wait_for(scheduler.infer(request(-1.0)), 5)  # bounded, not a hang
        assert not scheduler.healthy  # the only instance is being replaced
        # a request sent meanwhile waits for the replacement, then succeeds
        waiting = scheduler.submit(request(3.0))
        assert not waiting.done() and len(scheduler.batcher) == 1
        may_respawn.set()
        result = await asyncio.wait_for(waiting, 5)
        assert result.outputs["OUTPUT0"][0, 0] == 6.0
        assert scheduler.healthy and len(created) == 2 and scheduler.instances == [created[1]]
        executions = scheduler.stats.execution_count
        release.set()  # the abandoned thread ends; its late result is dropped
        await asyncio.get_running_loop().run_in_executor(None, created[0].stop)
        # the late result hopped onto the loop before the thread ended, so before this await
        assert scheduler.stats.execution_count == executions
        assert scheduler.in_flight_requests == 0
        assert scheduler.stats.fail_reasons == {"backend_error": 1}
        await scheduler.close()

    try:
        asyncio.run(main())
    finally:
        release.set()
