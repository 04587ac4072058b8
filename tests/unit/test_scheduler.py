"""The asyncio driver (ModelScheduler) with real instances and in-test backends, no sockets.

The timing rules themselves are tested on a fake clock in test_scheduler_core.py; these tests
check the wiring: futures, the loop timer, the hop of results from the instance threads, and
close. A backend holds its batches on a ``threading.Event`` gate instead of sleeping, so every
test is ordered by events, not by wall time.
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
from gpuserve.errors import (
    BackendError,
    OverloadedError,
    RequestTimeoutError,
    UnavailableError,
)


class Doubler(Backend):
    """OUTPUT0 = 2 * INPUT0; fails when a row starts with -999; records batch sizes. Each
    forward waits for ``gate``."""

    def __init__(self, drop_row: bool = False) -> None:
        self.drop_row = drop_row
        self.batches: list[int] = []
        self.ran: list[float] = []
        self.gate = threading.Event()
        self.gate.set()

    def load(self, context: LoadContext) -> None:
        pass

    def preprocess(self, inputs):
        return inputs["INPUT0"]

    def forward(self, x):
        assert self.gate.wait(10), "test gate never opened"
        self.batches.append(x.shape[0])
        self.ran.extend(x[:, 0].tolist())
        if (x[:, 0] == -999).any():
            raise ValueError("marker row")
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
        first = scheduler.submit(request(1, 1000.0))
        assert scheduler.instances[0].in_flight == 1  # dispatched at admission
        sizes = [1, 3, 2, 2]
        futures = [scheduler.submit(request(n, 100.0 * i)) for i, n in enumerate(sizes)]
        assert len(scheduler.batcher) == 4 and scheduler.in_flight_requests == 5
        backend.gate.set()
        results = await asyncio.gather(first, *futures)
        for i, (n, result) in enumerate(zip(sizes, results[1:], strict=True)):
            expected = (np.arange(n * 4, dtype=np.float32).reshape(n, 4) + 100.0 * i) * 2
            np.testing.assert_array_equal(result.outputs["OUTPUT0"], expected)
            assert result.rows == n and result.model_version == "1"
            assert result.timing.total_s >= result.timing.queue_s >= 0
        assert backend.batches == [1, 8]
        assert scheduler.stats.execution_count == 2
        assert scheduler.stats.inference_count == 9
        assert scheduler.in_flight_requests == 0
        await scheduler.close()

    asyncio.run(main())


def test_infer_awaits_the_same_path():
    async def main():
        scheduler = start(make_config(), Doubler())
        result = await scheduler.infer(request(2, 1.0))
        np.testing.assert_array_equal(result.outputs["OUTPUT0"][:, 0], [2.0, 10.0])
        await scheduler.close()

    asyncio.run(main())


def test_a_failing_request_fails_alone():
    async def main():
        backend = Doubler()
        backend.gate.clear()
        scheduler = start(make_config(), backend)
        blocker = scheduler.submit(request(1, 0.0))
        good = [scheduler.submit(request(1, 10.0 * i)) for i in range(3)]
        bad = scheduler.submit(request(1, -999.0))
        backend.gate.set()
        await blocker
        for future in good:
            assert (await future).outputs["OUTPUT0"].shape == (1, 4)
        with pytest.raises(BackendError, match="marker row"):
            await bad
        assert backend.batches[:2] == [1, 4] and sorted(backend.batches[2:]) == [1, 1, 2, 2]
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


def test_full_queue_is_refused_at_once_and_the_timer_expires_a_queued_request():
    async def main():
        backend = Doubler()
        backend.gate.clear()
        scheduler = start(make_config(max_queue_size=1), backend)
        running = scheduler.submit(request(1, 0.0))
        queued = scheduler.submit(request(1, 5.0, timeout_us=20_000))
        with pytest.raises(OverloadedError):
            scheduler.submit(request(1, 9.0))  # raises in submit: nothing to await
        with pytest.raises(RequestTimeoutError, match="timed out in the queue"):
            await queued  # the loop timer armed at the deadline fires with no other event
        backend.gate.set()
        await running
        assert backend.ran == [0.0]  # the timed-out request never ran
        assert scheduler.stats.fail_reasons == {"rejected": 1, "timeout": 1}
        await scheduler.close()

    asyncio.run(main())


def test_cancelled_queued_request_is_removed():
    async def main():
        backend = Doubler()
        backend.gate.clear()
        scheduler = start(make_config(), backend)
        running = scheduler.submit(request(1, 0.0))
        queued = asyncio.ensure_future(scheduler.infer(request(1, 5.0)))
        await asyncio.sleep(0)  # let the task run up to its await: it is queued
        assert len(scheduler.batcher) == 1
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert len(scheduler.batcher) == 0 and scheduler.in_flight_requests == 1
        backend.gate.set()
        await running
        assert backend.ran == [0.0] and scheduler.in_flight_requests == 0
        assert scheduler.stats.fail_reasons == {"cancelled": 1}
        await scheduler.close()

    asyncio.run(main())


def test_cancelling_a_submitted_future_takes_it_out_at_once_or_counts_it_cancelled():
    # the future of submit (no task: the HTTP front end, a stream, an ensemble step) is how
    # those callers say they left
    async def main():
        backend = Doubler()
        backend.gate.clear()
        scheduler = start(make_config(), backend)
        running = scheduler.submit(request(1, 0.0))
        queued = scheduler.submit(request(1, 5.0))
        assert len(scheduler.batcher) == 1
        queued.cancel()
        await asyncio.sleep(0)  # its done callbacks run
        assert len(scheduler.batcher) == 0 and scheduler.in_flight_requests == 1
        assert scheduler.stats.fail_reasons == {"cancelled": 1}
        running.cancel()  # its batch runs: it finishes for nobody, counted cancelled
        backend.gate.set()
        for _ in range(10_000):  # at most 10 s
            if not scheduler.in_flight_requests:
                break
            await asyncio.sleep(0.001)
        assert backend.ran == [0.0] and not scheduler.in_flight_requests
        assert scheduler.stats.fail_reasons == {"cancelled": 2}
        assert scheduler.stats.inference_count == 0
        await scheduler.close()

    asyncio.run(main())


def test_a_request_whose_client_left_is_answered_and_never_runs():
    async def main():
        backend = Doubler()
        backend.gate.clear()
        scheduler = start(make_config(), backend)
        running = scheduler.submit(request(1, 0.0))
        left = threading.Event()
        gone = scheduler.submit(request(1, 7.0, is_cancelled=left.is_set))
        stays = scheduler.submit(request(1, 8.0))
        left.set()
        backend.gate.set()
        await running
        assert (await stays).outputs["OUTPUT0"][0, 0] == 16.0
        with pytest.raises(Exception, match="client went away"):
            await gone
        assert backend.ran == [0.0, 8.0]
        await scheduler.close()

    asyncio.run(main())


def test_one_timer_is_armed_at_the_cores_next_wakeup():
    now = [100.0]

    async def main():
        config = make_config(max_queue_delay_us=50_000)
        scheduler = ModelScheduler(config, "1", clock=lambda: now[0])
        backend = Doubler()
        backend.gate.clear()
        context = LoadContext(config=scheduler.config, version_path=Path("."), version=1)
        instance = Instance("double:1#0", backend, context, scheduler.on_batch_done)
        instance.start()
        scheduler.attach([instance], asyncio.get_running_loop())
        first = scheduler.submit(request(1, 1.0))
        assert scheduler._timer_at == pytest.approx(100.05)  # the leading request's delay
        now[0] = 100.01
        second = scheduler.submit(request(1, 2.0, timeout_us=10_000))
        assert scheduler._timer_at == pytest.approx(100.02)  # an earlier deadline re-arms it
        now[0] = 100.06
        scheduler._timer.cancel()
        scheduler._on_timer()  # as the loop would: the second expired, the first goes
        with pytest.raises(RequestTimeoutError):
            await second
        assert scheduler._timer is None and instance.in_flight == 1
        backend.gate.set()
        assert (await first).outputs["OUTPUT0"][0, 0] == 2.0
        await scheduler.close()

    asyncio.run(main())


def test_close_lets_running_work_finish_and_fails_what_is_still_queued():
    async def main():
        backend = Doubler()
        backend.gate.clear()
        scheduler = start(make_config(), backend)
        running = scheduler.submit(request(1, 0.0))
        queued = scheduler.submit(request(1, 5.0))
        closing = asyncio.ensure_future(scheduler.close(drain_timeout_s=0.0))
        with pytest.raises(UnavailableError, match="unloaded before it ran"):
            await queued
        with pytest.raises(UnavailableError, match="is unloading"):
            scheduler.submit(request(1, 9.0))
        backend.gate.set()
        await closing  # stops the instance once its batch is done
        assert (await running).outputs["OUTPUT0"][0, 0] == 0.0
        assert scheduler.in_flight_requests == 0 and backend.ran == [0.0]
        assert scheduler.stats.fail_reasons == {"unavailable": 2}

    asyncio.run(main())


def test_close_waits_for_queued_work_within_the_drain_timeout():
    async def main():
        backend = Doubler()
        backend.gate.clear()
        scheduler = start(make_config(), backend)
        futures = [scheduler.submit(request(1, float(i))) for i in range(3)]
        closing = asyncio.ensure_future(scheduler.close(drain_timeout_s=30.0))
        await asyncio.sleep(0)
        assert not closing.done()
        backend.gate.set()
        await closing
        assert [(await f).outputs["OUTPUT0"][0, 0] for f in futures] == [0.0, 2.0, 4.0]

    asyncio.run(main())
