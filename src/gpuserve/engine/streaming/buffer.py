"""The bounded buffer between a decoupled model's thread and the client of its stream.

:class:`BufferCore` is the pure state (no threads, no clock): a FIFO of at most ``capacity``
responses, with the counts tests assert on. :class:`ResponseChannel` wraps it for its two
sides: the model's thread (:meth:`ResponseChannel.send`, which blocks while the buffer is
full: back-pressure instead of memory) and the event loop (:meth:`ResponseChannel.get`,
awaited by the front end that writes the responses out). Cancelling (the client went away
or cancelled) empties the buffer and turns every later ``send`` into a no-op that returns
False, which is how a generator learns to stop.

Every response is timed on the channel's injected clock (``compute_infer``: from the previous
``send`` returning, or the start of execution, to this ``send``; ``compute_output``: from this
``send`` until the response is in the buffer) and handed to ``on_response`` on the event loop
when it leaves the buffer (taken by the consumer, or dropped by a cancel): the engine counts
it in Triton's ``response_stats`` (:mod:`gpuserve.engine.response_stats`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

from gpuserve.errors import GpuserveError

#: Seconds between two looks at the client's probe while the model waits on a full buffer.
PROBE_INTERVAL_S = 0.05


@dataclass(slots=True)
class StreamItem:
    """One response of a decoupled request, as the engine hands it to the service.

    Attributes:
        outputs: Output name -> array of this response, or None (an empty final, or an
            error).
        final: The request's last item: nothing follows.
        error: This response failed (the stream ends with it when ``final``).
        index: 0-based position in the stream.
        infer_s: Seconds the model took to produce it (from its previous response's send, or
            the start of execution).
        output_s: Seconds from the model's send until it was in the buffer (conversion and
            any wait for room).
    """

    outputs: dict[str, np.ndarray] | None
    final: bool = False
    error: GpuserveError | None = None
    index: int = 0
    infer_s: float = 0.0
    output_s: float = 0.0


class Offer(Enum):
    """What :meth:`BufferCore.offer` did with an item."""

    ACCEPTED = "accepted"
    FULL = "full"  # nothing was added: wait for the consumer, then offer again
    REFUSED = "refused"  # cancelled, or after the final item: never delivered


class BufferCore:
    """The bounded FIFO of one stream (pure; the caller serialises access).

    Args:
        capacity: Most items held at once (>= 1).

    Attributes:
        produced: Items accepted so far.
        taken: Items the consumer took so far.
        high_water: Most items held at once so far (never above ``capacity``).
        cancelled: The consumer cancelled: everything is refused from now on.
        finished: The final item was accepted.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._items: deque[StreamItem] = deque()
        self.produced = 0
        self.taken = 0
        self.high_water = 0
        self.cancelled = False
        self.finished = False

    def __len__(self) -> int:
        return len(self._items)

    @property
    def full(self) -> bool:
        """Whether an offer now would be refused as FULL."""
        return len(self._items) >= self.capacity

    def offer(self, item: StreamItem, force: bool = False) -> Offer:
        """Add ``item`` unless the buffer is full (``force``: even then, one over), cancelled
        or already finished; its ``index`` is set to its position in the stream."""
        if self.cancelled or self.finished:
            return Offer.REFUSED
        if self.full and not force:
            return Offer.FULL
        item.index = self.produced
        self._items.append(item)
        self.produced += 1
        self.finished = item.final
        self.high_water = max(self.high_water, len(self._items))
        return Offer.ACCEPTED

    def take(self) -> StreamItem | None:
        """The oldest item, or None when empty."""
        if not self._items:
            return None
        self.taken += 1
        return self._items.popleft()

    def cancel(self) -> list[StreamItem]:
        """Drop what is held and refuse everything from now on; returns the dropped items
        (accepted, never taken), oldest first."""
        self.cancelled = True
        dropped = list(self._items)
        self._items.clear()
        return dropped

    @property
    def drained(self) -> bool:
        """The final item was taken (or the stream was cancelled): the stream is over."""
        return self.cancelled or (self.finished and not self._items)


class ResponseChannel:
    """One stream's buffer, shared by the model's thread and the event loop (implements
    :class:`gpuserve.backends.streaming.ResponseSink`).

    Args:
        capacity: Most responses held (``max_buffered_responses``).
        loop: The event loop the consumer runs on.
        request_id: The client's request id (``""`` for none).
        parameters: The request's parameters.
        convert: Turns a model's outputs into checked numpy outputs (raises to fail the
            response); runs on the producer's thread.
        to_error: Turns what a model raised or sent as an error into a GpuserveError.
        probe: True once the client went away (read from the producer's thread too).
        on_done: Called once on the loop thread when the stream ends: with the final item's
            error (None on success), or ``"cancelled"``.
        on_response: Called on the loop thread with every item that leaves the buffer (taken,
            or dropped by a cancel), timed; before ``on_done``.
        clock: Monotonic clock, seconds (read on the producer's thread).
    """

    def __init__(
        self,
        capacity: int,
        loop: asyncio.AbstractEventLoop,
        request_id: str = "",
        parameters: dict[str, Any] | None = None,
        convert: Callable[[dict[str, Any]], dict[str, np.ndarray]] | None = None,
        to_error: Callable[[BaseException], GpuserveError] | None = None,
        probe: Callable[[], bool] | None = None,
        on_done: Callable[[GpuserveError | str | None], None] | None = None,
        on_response: Callable[[StreamItem], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.core = BufferCore(capacity)
        self._loop = loop
        self._request_id = request_id
        self._parameters = dict(parameters or {})
        self._convert = convert
        self._to_error = to_error
        self._probe = probe
        self._on_done = on_done
        self._on_response = on_response
        self._clock = clock
        self._last_sent_s: float | None = None  # guarded by _cond
        self._done_reported = False
        self._cond = threading.Condition()
        self._consumer_waiting = False
        self._producer_waiting = False
        self._ready = asyncio.Event()

    # -- ResponseSink (the model's side, any thread) ---------------------------------------

    @property
    def request_id(self) -> str:
        return self._request_id

    def mark_started(self, now: float) -> None:
        """The model's execution started at ``now`` (seconds on the channel's clock): the
        first response's ``infer_s`` counts from here."""
        with self._cond:
            if self._last_sent_s is None:
                self._last_sent_s = now

    @property
    def parameters(self) -> dict[str, Any]:
        return self._parameters

    def is_cancelled(self) -> bool:
        """True once the consumer cancelled or the client's probe says it went away."""
        if self.core.cancelled:
            return True
        if self._probe is not None and self._probe():
            self.cancel()
            return True
        return False

    def send(
        self,
        outputs: dict[str, Any] | None,
        *,
        final: bool = False,
        error: BaseException | None = None,
    ) -> bool:
        """Queue one response (see :class:`~gpuserve.backends.streaming.ResponseSink`);
        blocks while the buffer is full. Returns False when nothing was queued (cancelled,
        or after the final response)."""
        called_s = self._clock()
        item = self._item(outputs, final, error)
        with self._cond:
            while True:
                verdict = self.core.offer(item)
                if verdict is Offer.ACCEPTED:
                    sent_s = self._clock()
                    last = called_s if self._last_sent_s is None else self._last_sent_s
                    item.infer_s = called_s - last
                    item.output_s = sent_s - called_s
                    self._last_sent_s = sent_s
                if verdict is not Offer.FULL:
                    break
                if self._probe is not None and self._probe():
                    self._cancel_locked()
                    return False
                self._producer_waiting = True
                self._cond.wait(PROBE_INTERVAL_S if self._probe is not None else None)
            self._producer_waiting = False
            wake = verdict is Offer.ACCEPTED and self._consumer_waiting
            if wake:
                self._consumer_waiting = False
        if wake:
            self._call_on_loop(self._ready.set)
        return verdict is Offer.ACCEPTED

    def fail(self, error: GpuserveError) -> None:
        """End the stream now with ``error`` as its final response, without waiting for room
        in the buffer (the server ends it: a queue timeout, the watchdog, an unload); a model
        still sending is refused from then on. A no-op once the stream ended. Any thread,
        never blocks."""
        with self._cond:
            verdict = self.core.offer(StreamItem(None, True, error), force=True)
            self._cond.notify_all()  # a producer waiting for room finds the stream over
            wake = verdict is Offer.ACCEPTED and self._consumer_waiting
            if wake:
                self._consumer_waiting = False
        if wake:
            self._call_on_loop(self._ready.set)

    def _item(
        self, outputs: dict[str, Any] | None, final: bool, error: BaseException | None
    ) -> StreamItem:
        if error is not None:
            return StreamItem(None, final, self._error(error))
        if outputs is None or self._convert is None:
            return StreamItem(outputs, final)
        try:
            return StreamItem(self._convert(outputs), final)
        except Exception as err:  # a bad response fails that response (the model's bug)
            return StreamItem(None, final, self._error(err))

    def _error(self, error: BaseException) -> GpuserveError:
        if isinstance(error, GpuserveError):
            return error
        if self._to_error is not None:
            return self._to_error(error)
        return GpuserveError(f"{type(error).__name__}: {error}")

    # -- the consumer's side (the event loop) ----------------------------------------------

    async def get(self) -> StreamItem | None:
        """The next response, waiting for the model; None once the stream was cancelled."""
        while True:
            with self._cond:
                item = self.core.take()
                if item is not None:
                    if self._producer_waiting:
                        self._cond.notify_all()
                    if item.final:
                        self._report(item.error)
                if item is None:
                    if self.core.cancelled:
                        return None
                    self._ready.clear()
                    self._consumer_waiting = True
            if item is not None:
                if self._on_response is not None:
                    self._on_response(item)
                return item
            await self._ready.wait()

    def cancel(self, reason: str = "cancelled") -> None:
        """The client went away or cancelled: drop held responses, refuse later ones, and
        wake a producer waiting on a full buffer. Idempotent; any thread.

        Args:
            reason: What the request is counted as (``on_done``'s argument).
        """
        with self._cond:
            if self.core.drained and not self.core.cancelled:
                return  # the stream already ended normally
            self._cancel_locked(reason)

    def _cancel_locked(self, reason: str = "cancelled") -> None:
        if self.core.cancelled:
            return
        dropped = self.core.cancel()
        self._cond.notify_all()
        if dropped and self._on_response is not None:
            self._call_on_loop(lambda: self._count(dropped))
        self._report(reason)
        self._call_on_loop(self._ready.set)

    def _count(self, items: list[StreamItem]) -> None:
        """Hand dropped ``items`` to ``on_response`` (loop thread)."""
        if self._on_response is not None:
            for item in items:
                self._on_response(item)

    def _report(self, outcome: GpuserveError | str | None) -> None:
        if self._done_reported or self._on_done is None:
            return
        self._done_reported = True
        on_done = self._on_done
        self._call_on_loop(lambda: on_done(outcome))

    def _call_on_loop(self, callback: Callable[[], None]) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(callback)
