"""The open sequences of a sequence model and the slots they hold: pure bookkeeping for the
sequence batcher (:mod:`gpuserve.engine.sequence.batcher`).

A *lane* is one instance's set of slots (lane ``i`` runs on the ``i``-th instance). A sequence
takes a free slot on the lane with the fewest open sequences when it opens, and keeps it until
it is released (its END request ran, or it was idle too long); a sequence that finds no free
slot waits in the backlog, first come first placed. Times are seconds on the caller's clock.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from gpuserve.engine.batch import Pending
from gpuserve.engine.sequence.tensors import SequenceId

__all__ = ["Live", "SequenceStats", "SequenceTable"]

#: Ids of released sequences remembered, to say why a later request is refused.
REMEMBERED = 4096


@dataclass(slots=True)
class SequenceStats:
    """Counts of one sequence model version since load.

    Attributes:
        live: Sequences open now (started, not released).
        waiting_for_slot: Open sequences that hold no slot yet.
        started: Sequences started (a restart counts again).
        ended: Sequences released after their END request ran.
        released_idle: Sequences released after ``max_sequence_idle_us`` without a request.
    """

    live: int = 0
    waiting_for_slot: int = 0
    started: int = 0
    ended: int = 0
    released_idle: int = 0


@dataclass(slots=True, eq=False)
class Live:
    """One open sequence.

    Attributes:
        id: Its sequence id.
        lane / slot: Where it runs; ``lane`` None while it waits for a slot.
        queue: Its requests waiting, in arrival order.
        running: Its request in a batch now, or None.
        state: Implicit state, input name -> the array the model returned last (one row).
        last_s: Its last activity (a request arrived or finished), seconds.
        ending: Its END request has arrived (a later request needs START).
    """

    id: SequenceId
    lane: int | None = None
    slot: int = 0
    queue: deque[Pending] = field(default_factory=deque)
    running: Pending | None = None
    state: dict[str, np.ndarray] = field(default_factory=dict)
    last_s: float = 0.0
    ending: bool = False

    @property
    def idle(self) -> bool:
        """Nothing queued nor running."""
        return self.running is None and not self.queue


class SequenceTable:
    """Open sequences, their slots and the backlog.

    Args:
        slots: Slots per lane.
        lanes: Returns the number of lanes now (the instances; at least 1 is used).
        idle_s: Seconds without activity after which an idle sequence is released.
    """

    def __init__(self, slots: int, lanes: Callable[[], int], idle_s: float) -> None:
        self.slots = slots
        self.lane_count = lanes
        self.idle_s = idle_s
        self.stats = SequenceStats()
        self.live: dict[SequenceId, Live] = {}
        self.lanes: dict[int, list[Live | None]] = {}  # lane -> its slots
        self.backlog: deque[Live] = deque()
        self.released: OrderedDict[SequenceId, str] = OrderedDict()
        self.idle_at = float("inf")  # no open sequence can be idle before this

    def open(self, sequence_id: SequenceId) -> Live:
        """A new open sequence, placed on a slot or queued in the backlog."""
        live = Live(sequence_id)
        self.live[sequence_id] = live
        self.released.pop(sequence_id, None)
        if not self._place(live):
            self.backlog.append(live)
        return live

    def _place(self, live: Live) -> bool:
        """Give ``live`` a free slot on the lane with the fewest open sequences."""
        best: tuple[int, int] | None = None
        for lane in range(max(1, self.lane_count())):
            slots = self.lanes.get(lane)
            used = 0 if slots is None else sum(s is not None for s in slots)
            if used < self.slots and (best is None or used < best[1]):
                best = (lane, used)
        if best is None:
            return False
        lane = best[0]
        slots = self.lanes.setdefault(lane, [None] * self.slots)
        slot = slots.index(None)
        slots[slot] = live
        live.lane, live.slot = lane, slot
        return True

    def release(self, live: Live, why: str) -> None:
        """Close ``live`` (``why`` is remembered for a later request's error); its slot goes
        to the oldest sequence of the backlog."""
        self.live.pop(live.id, None)
        self.released[live.id] = why
        self.released.move_to_end(live.id)
        while len(self.released) > REMEMBERED:
            self.released.popitem(last=False)
        if live.lane is None:
            if live in self.backlog:
                self.backlog.remove(live)
            return
        self.lanes[live.lane][live.slot] = None
        live.lane = None
        while self.backlog and self._place(self.backlog[0]):
            self.backlog.popleft()

    def not_live(self, sequence_id: SequenceId) -> str:
        """Why ``sequence_id`` takes no request without START (it is not open, or ending)."""
        if sequence_id in self.live:
            return "has ended (its END request is queued)"
        return self.released.get(sequence_id, "was never started")

    def maybe_idle(self, live: Live) -> None:
        """Note that ``live`` may have become idle (its release time bounds ``idle_at``)."""
        if live.idle:
            self.idle_at = min(self.idle_at, live.last_s + self.idle_s)

    def release_idle(self, now: float) -> None:
        """Release the sequences idle for ``idle_s`` at ``now``; ``idle_at`` becomes the next
        release time."""
        soonest = float("inf")
        for live in list(self.live.values()):
            if not live.idle:
                continue
            due = live.last_s + self.idle_s
            if due <= now:
                idle_ms = (now - live.last_s) * 1e3
                self.release(live, f"was released after {idle_ms:.0f} ms idle")
                self.stats.released_idle += 1
            elif due < soonest:
                soonest = due
        self.idle_at = soonest

    def snapshot(self) -> SequenceStats:
        """The counts now (``live`` and ``waiting_for_slot`` filled in)."""
        self.stats.live = len(self.live)
        self.stats.waiting_for_slot = len(self.backlog)
        return self.stats
