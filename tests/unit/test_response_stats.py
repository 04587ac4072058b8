"""Per-response statistics (Triton's ``response_stats``): the pure aggregate, the stream
channel's timing and what the streaming runner counts when a stream ends, on fake clocks."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest

from gpuserve.backends.base import Backend, Capabilities, LoadContext
from gpuserve.config import ModelConfig
from gpuserve.engine.instance import Instance
from gpuserve.engine.request import InferenceRequest
from gpuserve.engine.response_stats import (
    INTERVAL_BUCKETS_S,
    ResponseOutcome,
    ResponseStats,
)
from gpuserve.engine.runners.streaming import DecoupledStream, StreamingRunner
from gpuserve.engine.stats import ModelStats
from gpuserve.engine.streaming.buffer import ResponseChannel, StreamItem
from gpuserve.errors import BackendError


def test_each_outcome_adds_what_triton_adds():
    stats = ResponseStats()
    stats.record_response(0, ResponseOutcome.SUCCESS, 0.002, 0.001)
    stats.record_response(1, ResponseOutcome.FAIL, 0.004, 0.0005)
    stats.record_response(2, ResponseOutcome.EMPTY, 0.003, 9.0)  # an empty has no output time
    stats.record_cancel(2, 0.25)
    view = stats.as_dict()
    assert list(view) == ["0", "1", "2"]
    assert view["0"] == {
        "compute_infer": {"count": 1, "ns": 2_000_000},
        "compute_output": {"count": 1, "ns": 1_000_000},
        "success": {"count": 1, "ns": 3_000_000},
        "fail": {"count": 0, "ns": 0},
        "empty_response": {"count": 0, "ns": 0},
        "cancel": {"count": 0, "ns": 0},
    }
    assert view["1"]["fail"] == {"count": 1, "ns": 4_500_000}
    assert view["1"]["success"]["count"] == 0
    assert view["2"]["compute_infer"] == {"count": 1, "ns": 3_000_000}
    assert view["2"]["compute_output"]["count"] == 0
    assert view["2"]["empty_response"] == {"count": 1, "ns": 3_000_000}
    assert view["2"]["cancel"] == {"count": 1, "ns": 250_000_000}
    assert stats.totals == {
        ResponseOutcome.SUCCESS: 1,
        ResponseOutcome.FAIL: 1,
        ResponseOutcome.EMPTY: 1,
        ResponseOutcome.CANCEL: 1,
    }
    with pytest.raises(ValueError, match="record_cancel"):
        stats.record_response(0, ResponseOutcome.CANCEL, 0.0, 0.0)


def test_indices_aggregate_across_streams_and_render_in_model_stats():
    model = ModelStats("m", "1")
    for count in (3, 1, 2):
        for index in range(count):
            model.responses.record_response(index, ResponseOutcome.SUCCESS, 0.001, 0.0)
    view = model.as_dict()["response_stats"]
    assert {key: entry["success"]["count"] for key, entry in view.items()} == {
        "0": 3,
        "1": 2,
        "2": 1,
    }
    assert ModelStats("n", "1").as_dict()["response_stats"] == {}


def test_the_interval_histogram_counts_delivered_responses_only():
    stats = ResponseStats()
    stats.record_response(0, ResponseOutcome.SUCCESS, 0.0004, 0.0)  # first bucket
    stats.record_response(1, ResponseOutcome.FAIL, 0.02, 0.005)  # 0.025: its own bound
    stats.record_response(2, ResponseOutcome.EMPTY, 0.5, 0.0)  # not an interval
    stats.record_response(3, ResponseOutcome.SUCCESS, 99.0, 1.0)  # +Inf
    counts = stats.intervals.counts
    assert len(counts) == len(INTERVAL_BUCKETS_S) + 1
    assert counts[0] == 1
    assert counts[INTERVAL_BUCKETS_S.index(0.025)] == 1
    assert counts[-1] == 1
    assert sum(counts) == 3
    assert stats.intervals.sum_s == pytest.approx(0.0004 + 0.025 + 100.0)


class Ticks:
    """A fake clock that returns the given instants in turn (seconds)."""

    def __init__(self, *instants: float) -> None:
        self.instants = list(instants)

    def __call__(self) -> float:
        return self.instants.pop(0)


def run(coroutine_fn):
    return asyncio.run(coroutine_fn())


def test_the_channel_times_each_response_from_the_previous_send():
    async def main():
        taken: list[StreamItem] = []
        # send() reads the clock when called and again once its response is in the buffer.
        clock = Ticks(12.0, 12.5, 15.0, 15.25, 16.0, 16.0)
        channel = ResponseChannel(
            8, asyncio.get_running_loop(), on_response=taken.append, clock=clock
        )
        channel.mark_started(10.0)
        channel.mark_started(11.0)  # only the first start counts
        assert channel.send({"Y": np.zeros(1)})
        assert channel.send({"Y": np.ones(1)})
        assert channel.send(None, final=True)
        items = [await channel.get() for _ in range(3)]
        assert taken == items
        assert [(i.index, i.infer_s, i.output_s) for i in items] == [
            (0, 2.0, 0.5),  # produced 10.0 -> 12.0, in the buffer at 12.5
            (1, 2.5, 0.25),  # from 12.5 (the previous send returned) to 15.0
            (2, 0.75, 0.0),
        ]
        assert items[2].final and items[2].outputs is None

    run(main)


def test_responses_dropped_by_a_cancel_are_still_counted_and_refused_ones_are_not():
    async def main():
        taken: list[StreamItem] = []
        done: list[object] = []
        clock = Ticks(1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0)  # the last: the refused send
        channel = ResponseChannel(
            8,
            asyncio.get_running_loop(),
            on_response=taken.append,
            on_done=done.append,
            clock=clock,
        )
        channel.mark_started(0.0)
        for _ in range(3):
            assert channel.send({"Y": np.zeros(1)})
        first = await channel.get()
        assert taken == [first]
        channel.cancel()
        assert not channel.send({"Y": np.zeros(1)})  # refused: never counted
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert [i.index for i in taken] == [0, 1, 2]
        assert done == ["cancelled"]

    run(main)


def test_an_error_response_is_timed_like_any_other():
    async def main():
        taken: list[StreamItem] = []
        channel = ResponseChannel(
            2, asyncio.get_running_loop(), on_response=taken.append, clock=Ticks(5.0, 5.5)
        )
        channel.mark_started(4.0)
        channel.send(None, final=True, error=BackendError("boom"))
        item = await channel.get()
        assert item is not None and item.error is not None
        assert (item.infer_s, item.output_s) == (1.0, 0.5)

    run(main)


# -- the streaming runner: what a stream's end counts, on a fake clock ------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1.0

    def __call__(self) -> float:
        return self.now


class GatedBackend(Backend):
    """Streams ``count`` responses at the clock's instants, then waits for ``release``."""

    def __init__(self, clock: Clock, count: int) -> None:
        self.clock = clock
        self.count = count
        self.sent = threading.Event()
        self.release = threading.Event()

    def load(self, context: LoadContext) -> None:
        pass

    def capabilities(self) -> Capabilities:
        return Capabilities(streams=True)

    def preprocess(self, inputs):
        raise AssertionError("a decoupled model's batches are streamed")

    forward = postprocess = preprocess

    def stream(self, inputs, sink) -> None:
        for index in range(self.count):
            self.clock.now += 0.5  # half a second to produce each response
            sink.send({"Y": np.array([index], np.int32)})
        self.sent.set()
        self.release.wait(10)


CONFIG = ModelConfig(
    name="m",
    backend="python",
    max_batch_size=0,
    inputs=[{"name": "X", "datatype": "INT32", "shape": [1]}],
    outputs=[{"name": "Y", "datatype": "INT32", "shape": [1]}],
    model_transaction_policy={"decoupled": True},
)


async def started_runner(backend: GatedBackend, clock: Clock) -> tuple[StreamingRunner, Instance]:
    """The version's streaming runner on one real instance (its thread runs the streams)."""
    runner = StreamingRunner(CONFIG, "1", Capabilities(streams=True), clock=clock)
    context = LoadContext(config=CONFIG, version_path=Path("."), version=1)
    instance = Instance("m:1#0", backend, context, runner.on_batch_done)
    await asyncio.to_thread(instance.start, 10)
    runner.attach([instance], asyncio.get_running_loop())
    return runner, instance


async def _until(predicate, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.001)


def request(**kwargs) -> InferenceRequest:
    return InferenceRequest("m", None, {"X": np.zeros(1, np.int32)}, **kwargs)


def test_a_cancel_while_the_model_runs_counts_once_timed_until_its_call_returns():
    async def main():
        clock = Clock()
        backend = GatedBackend(clock, count=2)
        runner, instance = await started_runner(backend, clock)
        stream = runner.stream(request())
        assert isinstance(stream, DecoupledStream)
        job = stream.job
        first = await job.channel.get()
        second = await job.channel.get()
        assert (first.index, second.index) == (0, 1)
        assert (first.infer_s, second.infer_s) == (0.5, 0.5)  # from the start, then the 1st
        await asyncio.to_thread(backend.sent.wait, 10)
        clock.now = 10.0
        job.channel.cancel()
        await _until(lambda: job.cancelled_s is not None)
        assert runner.stats.responses.totals[ResponseOutcome.CANCEL] == 0  # not yet: it runs
        clock.now = 10.25
        backend.release.set()
        await _until(lambda: not job.running)
        view = runner.stats.as_dict()["response_stats"]
        assert {k: v["success"]["count"] for k, v in view.items()} == {"0": 1, "1": 1, "2": 0}
        assert view["2"]["cancel"] == {"count": 1, "ns": 250_000_000}
        assert view["0"]["compute_infer"] == {"count": 1, "ns": 500_000_000}
        assert runner.stats.fail_reasons["cancelled"] == 1
        await asyncio.to_thread(instance.stop)

    run(main)


def test_a_request_that_never_ran_counts_no_response():
    async def main():
        clock = Clock()
        busy = GatedBackend(clock, count=0)
        runner, instance = await started_runner(busy, clock)
        running = runner.stream(request())
        await asyncio.to_thread(busy.sent.wait, 10)
        queued = runner.stream(request(timeout_us=1000))
        assert isinstance(running, DecoupledStream) and isinstance(queued, DecoupledStream)
        clock.now += 1.0  # the queued one's timeout passes while the instance is busy
        item = await queued.job.channel.get()
        assert item is not None and item.error is not None and item.error.reason == "timeout"
        busy.release.set()
        await _until(lambda: not running.job.running)
        assert runner.stats.responses.by_index == {}
        assert runner.stats.fail_reasons["timeout"] == 1
        await asyncio.to_thread(instance.stop)

    run(main)
