"""The bounded buffer of decoupled streams: the pure core, the two-sided channel, and the
generator driver (no sockets, no server).

The channel tests run a real producer thread against an asyncio consumer; they synchronise
on the channel's own state (``wait_until``), never on a fixed sleep.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from gpuserve.backends.streaming import run_generator
from gpuserve.engine.streaming.buffer import BufferCore, Offer, ResponseChannel, StreamItem
from gpuserve.errors import BackendError, GpuserveError, InvalidInputError
from tests.helpers import wait_until


def item(value: int, final: bool = False) -> StreamItem:
    return StreamItem({"X": np.array([value])}, final)


# -- BufferCore (pure) -----------------------------------------------------------------------


def test_the_core_holds_at_most_its_capacity_and_keeps_order():
    core = BufferCore(3)
    assert [core.offer(item(i)) for i in range(4)] == [Offer.ACCEPTED] * 3 + [Offer.FULL]
    assert core.full and len(core) == 3 and core.high_water == 3
    assert [core.take().outputs["X"][0] for _ in range(2)] == [0, 1]
    assert core.offer(item(3)) is Offer.ACCEPTED and core.offer(item(4)) is Offer.ACCEPTED
    assert core.offer(item(5)) is Offer.FULL
    taken = []
    while (next_item := core.take()) is not None:
        taken.append((next_item.index, int(next_item.outputs["X"][0])))
    assert taken == [(2, 2), (3, 3), (4, 4)]
    assert (core.produced, core.taken, core.high_water) == (5, 5, 3)


def test_nothing_is_accepted_after_the_final_item_or_a_cancel():
    core = BufferCore(2)
    assert core.offer(item(0, final=True)) is Offer.ACCEPTED
    assert core.finished and not core.drained
    assert core.offer(item(1)) is Offer.REFUSED
    assert core.take().final and core.drained
    other = BufferCore(2)
    other.offer(item(0))
    other.cancel()
    assert len(other) == 0 and other.drained
    assert other.offer(item(1)) is Offer.REFUSED and other.take() is None


def test_a_core_needs_room_for_one():
    with pytest.raises(ValueError, match="at least 1"):
        BufferCore(0)


@pytest.mark.parametrize("capacity", [1, 2, 7])
def test_the_lag_between_producer_and_consumer_never_exceeds_the_capacity(capacity):
    """Any interleaving of offers (when there is room) and takes: produced - taken <= cap."""
    rng = np.random.default_rng(capacity)
    core = BufferCore(capacity)
    for _ in range(2000):
        if rng.random() < 0.6:
            core.offer(item(core.produced))
        else:
            core.take()
        assert 0 <= core.produced - core.taken <= capacity
    assert core.high_water == capacity


# -- ResponseChannel (a producer thread, an asyncio consumer) --------------------------------


def run(coroutine):
    return asyncio.run(coroutine)


def test_send_blocks_while_full_and_resumes_when_the_consumer_takes():
    async def scenario():
        loop = asyncio.get_running_loop()
        channel = ResponseChannel(2, loop)
        sent = []

        def produce():
            for i in range(5):
                channel.send({"X": np.array([i])}, final=(i == 4))
                sent.append(i)

        producer = threading.Thread(target=produce)
        producer.start()
        await loop.run_in_executor(None, wait_until, lambda: len(sent) == 2)
        await loop.run_in_executor(None, wait_until, lambda: channel._producer_waiting)
        assert sent == [0, 1] and channel.core.produced == 2  # blocked on the third
        got = []
        while True:
            next_item = await channel.get()
            got.append(int(next_item.outputs["X"][0]))
            assert channel.core.produced - channel.core.taken <= 2
            if next_item.final:
                break
        await loop.run_in_executor(None, producer.join)
        return got, channel.core.high_water

    got, high_water = run(scenario())
    assert got == [0, 1, 2, 3, 4] and high_water == 2


def test_cancel_wakes_a_blocked_producer_and_later_sends_return_false():
    outcomes: list = []

    async def scenario():
        loop = asyncio.get_running_loop()
        channel = ResponseChannel(1, loop, on_done=outcomes.append)
        results = []

        def produce():
            results.append(channel.send({"X": np.array([0])}))
            results.append(channel.send({"X": np.array([1])}))  # blocks: full
            results.append(channel.send({"X": np.array([2])}))

        producer = threading.Thread(target=produce)
        producer.start()
        await loop.run_in_executor(None, wait_until, lambda: channel._producer_waiting)
        channel.cancel()
        await loop.run_in_executor(None, producer.join)
        assert channel.is_cancelled()
        assert await channel.get() is None
        await asyncio.sleep(0)  # on_done is called on the loop
        return results

    assert run(scenario()) == [True, False, False]
    assert outcomes == ["cancelled"]


def test_a_client_probe_cancels_a_producer_waiting_on_a_full_buffer():
    gone = threading.Event()

    async def scenario():
        loop = asyncio.get_running_loop()
        channel = ResponseChannel(1, loop, probe=gone.is_set)
        channel.send({"X": np.array([0])})
        blocked = loop.run_in_executor(None, channel.send, {"X": np.array([1])})
        await loop.run_in_executor(None, wait_until, lambda: channel._producer_waiting)
        gone.set()
        return await blocked, channel.is_cancelled()

    assert run(scenario()) == (False, True)


def test_the_final_item_reports_success_or_its_error_once():
    outcomes: list = []

    async def scenario():
        loop = asyncio.get_running_loop()
        ok = ResponseChannel(4, loop, on_done=outcomes.append)
        ok.send({"X": np.array([1])})
        ok.send(None, final=True)
        assert (await ok.get()).outputs is not None
        assert (await ok.get()).final
        ok.cancel()  # after the end: not a cancellation
        failed = ResponseChannel(
            4, loop, on_done=outcomes.append, to_error=lambda e: BackendError(str(e))
        )
        failed.send(None, final=True, error=RuntimeError("boom"))
        last = await failed.get()
        await asyncio.sleep(0)
        return last

    last = run(scenario())
    assert isinstance(last.error, BackendError) and last.final
    assert outcomes[0] is None and isinstance(outcomes[1], BackendError)
    assert len(outcomes) == 2


def test_a_response_the_converter_refuses_fails_that_response_only():
    def convert(outputs):
        if "BAD" in outputs:
            raise BackendError("undeclared output 'BAD'")
        return outputs

    async def scenario():
        channel = ResponseChannel(4, asyncio.get_running_loop(), convert=convert)
        channel.send({"BAD": np.array([1])})
        channel.send({"X": np.array([2])}, final=True)
        return await channel.get(), await channel.get()

    bad, good = run(scenario())
    assert isinstance(bad.error, BackendError) and not bad.final
    assert good.outputs["X"].tolist() == [2] and good.final


# -- run_generator ---------------------------------------------------------------------------


class FakeSink:
    """Accepts ``accept`` responses, then reports the client gone."""

    def __init__(self, accept: int = 10**9) -> None:
        self.accept = accept
        self.sent: list = []
        self.request_id = ""
        self.parameters: dict = {}

    def send(self, outputs, *, final=False, error=None) -> bool:
        if len(self.sent) >= self.accept:
            return False
        self.sent.append((outputs, final, error))
        return True

    def is_cancelled(self) -> bool:
        return len(self.sent) >= self.accept


def test_a_generator_runs_to_its_end_then_an_empty_final():
    sink = FakeSink()
    run_generator(({"X": np.array([i])} for i in range(3)), sink)
    assert [(o is None, f) for o, f, _ in sink.sent] == [(False, False)] * 3 + [(True, True)]


def test_a_cancelled_client_closes_the_generator():
    closed = []

    def generate():
        try:
            for i in range(100):
                yield {"X": np.array([i])}
        finally:
            closed.append(True)

    sink = FakeSink(accept=3)
    run_generator(generate(), sink)
    assert closed == [True] and len(sink.sent) == 3
    assert not any(final for _, final, _ in sink.sent)


@pytest.mark.parametrize(
    ("raised", "kind"), [(ValueError("bad"), ValueError), (InvalidInputError("no"), GpuserveError)]
)
def test_an_exception_ends_the_stream_with_it(raised, kind):
    def generate():
        yield {"X": np.array([0])}
        raise raised

    sink = FakeSink()
    run_generator(generate(), sink)
    (first, _, _), (last, final, error) = sink.sent
    assert first is not None and last is None and final and isinstance(error, kind)


def test_a_generator_that_yields_something_else_fails_clearly():
    sink = FakeSink()
    run_generator(iter([[1, 2]]), sink)
    _, final, error = sink.sent[-1]
    assert final and isinstance(error, TypeError) and "dicts of outputs" in str(error)
