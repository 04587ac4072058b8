"""The sequence batcher: a pure state machine that batches the requests of stateful models.

It takes the dynamic batcher's place in the scheduling core (same interface: ``add``,
``next_batch``, ``expire``, ``next_wakeup``, ``remove``, ``drain``, ``take_cancelled``,
``instance_freed``, ``len()``, ``queued_rows``) for a model with ``sequence_batching``
(:mod:`gpuserve.config.sequence`), plus :meth:`SequenceBatcher.ran`, which the core calls
with every batch result before it answers the requests. No threads, no clock of its own:
every time is seconds on the caller's monotonic clock, so tests use a fake clock.

Rules (Triton's sequence batcher):

* **Sequences**: a request names its sequence (``sequence_id``, ``sequence_start``,
  ``sequence_end``; see :mod:`gpuserve.engine.sequence.tensors`). A START opens the sequence
  (a START for a live id restarts it: its state is reset when that request runs); a request
  without START for an id that is not live is refused (400 naming the id), as is a request
  with no id. After END has run the sequence is released.
* **Slots**: a sequence holds a slot on one instance (a *lane*) for its life, the lane with
  the fewest live sequences when it started; every batch of a lane goes to that instance.
  A lane has ``max_batch_size`` slots (``direct``; one when the model does not batch) or
  ``max_candidate_sequences`` (``oldest``). A sequence that finds no free slot waits, with its
  requests, until one is released.
* **Order**: a sequence's requests run one at a time, in arrival order: its next request
  joins a batch only after the previous one has finished (the state it needs is the previous
  request's result). A batch holds at most one request per sequence, one row each.
* **Batches**: ``direct`` takes the lane's ready slots, sent at once or after
  ``max_queue_delay_us`` unless ``minimum_slot_utilization`` of the slots are ready, and lays
  the batch out by slot (a model that batches): row ``i`` is slot ``i``, rows ``0..`` the
  highest ready slot, a slot without a request in this execution being a filler row with
  READY false (:mod:`gpuserve.engine.sequence.layout`; its outputs are dropped, its state is
  a dummy). ``oldest`` packs the oldest ready requests of up to ``max_batch_size`` sequences,
  sent when full, at a preferred batch size, or once the oldest waited
  ``max_queue_delay_us``. Only requests whose tensors have equal non-batch shapes share a
  batch (a ready slot of other shapes is a filler row this time and runs in a later batch).
* **Control inputs and state**: when a request joins a batch its inputs gain the model's
  control tensors (START, END, READY, CORRID) and its implicit state (zeros at START, else
  what the model returned for the previous request); :meth:`SequenceBatcher.ran` keeps the
  state outputs and removes them from the answer. A request that fails leaves the state as
  it was. A ``direct`` batch that fails as a whole fails all its requests, as in Triton: it
  is not rerun in halves (a model that keeps per-slot state may have advanced it);
  ``oldest`` batches are (the scheduling core's rule). A request's own error (a row error)
  fails only that request either way.
* **Idle sequences**: a live sequence with nothing queued or running for
  ``max_sequence_idle_us`` is released (counted in ``released_idle``).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuserve.config import ModelConfig
from gpuserve.config.sequence import SequenceBatchingConfig
from gpuserve.engine.batch import Batch, BatchResult, Pending
from gpuserve.engine.inflight import Worker
from gpuserve.engine.sequence.layout import FillerRows, drop_fillers, slot_rows
from gpuserve.engine.sequence.slots import Live, SequenceStats, SequenceTable
from gpuserve.engine.sequence.tensors import (
    SequenceFlags,
    SequenceId,
    check_corrid,
    control_array,
    initial_state,
    sequence_flags,
    state_shape,
)
from gpuserve.errors import BackendError, InvalidInputError, OverloadedError

__all__ = ["SequenceBatch", "SequenceBatcher", "SequenceStats"]  # stats: sequence_slots.py


@dataclass(slots=True)
class SequenceBatch(Batch):
    """A batch of one lane: it must run on ``instance``.

    A ``direct`` batch's ``items`` are its rows in slot order, a
    :class:`~gpuserve.engine.sequence.layout.FillerRow` at each slot below the highest that
    has no request in it; :meth:`SequenceBatcher.ran` removes them once it has run.

    Attributes:
        instance: The instance that holds the batch's sequences.
        lane: Its lane number.
    """

    instance: Any = None
    lane: int = 0


@dataclass(slots=True)
class _Step:
    """A queued or running request's sequence and flags."""

    seq: Live
    flags: SequenceFlags


def _waiting(live: Live) -> bool:
    """Whether ``live`` has a request queued and none running (no side effects; a cancelled
    head counts: the batch formation that finds it drops it)."""
    running = live.running
    return bool(live.queue) and (running is None or running.outcome is not None)


def _gone(item: Pending) -> bool:
    probe = item.request.is_cancelled
    return probe is not None and probe()


class SequenceBatcher:
    """Queue, slots, state and batch formation of one sequence model version.

    A :class:`~gpuserve.engine.batcher.Batcher`, as the dynamic batcher is (the scheduling
    core drives either).

    Args:
        config: The model's configuration (``sequence_batching`` set).
        instances: Returns the instances batches may go to, lane ``i`` being
            ``instances()[i % len]`` (the core's list, read at each call).
        max_batch_tokens: Most padded tokens (rows x longest row) in a batch of requests
            that carry costs (an admission step measured them); None = rows only. The
            sequence that leads a batch always runs, however long.
    """

    def __init__(
        self,
        config: ModelConfig,
        instances: Callable[[], Seq[Worker]],
        max_batch_tokens: int | None = None,
    ) -> None:
        seq = config.sequence_batching
        assert seq is not None
        self.max_batch_tokens = max_batch_tokens
        self.row_cap: int | None = None  # the adaptive policy's control (unused here)
        #: A sequence's requests keep their order: no bulk lane here (all interactive).
        self.bulk_may_lead = True
        self.config: SequenceBatchingConfig = seq
        self.model = config.name or ""
        self.instances = instances
        self.batched = config.max_batch_size > 0
        self.max_batch_size = max(1, config.max_batch_size)
        self.max_queue_size = seq.max_queue_size
        self.idle_s = seq.max_sequence_idle_us / 1e6
        if seq.oldest is not None:
            self.slots = seq.oldest.max_candidate_sequences
            self.delay_s = seq.oldest.max_queue_delay_us / 1e6
            self.preferred = sorted(seq.oldest.preferred_batch_sizes)
            self.min_ready = 1
        else:
            direct = seq.direct
            self.slots = self.max_batch_size
            self.delay_s = direct.max_queue_delay_us / 1e6 if direct is not None else 0.0
            self.preferred = []
            share = direct.minimum_slot_utilization if direct is not None else 0.0
            self.min_ready = max(1, int(np.ceil(share * self.slots)))
        self.max_queue_delay_s = self.delay_s
        self.oldest = seq.oldest is not None
        #: ``direct`` batches are laid out by slot, with filler rows (a batching model).
        self.slot_layout = self.batched and not self.oldest
        self._fillers = FillerRows(self.model, seq.control_inputs)
        self.outputs = [t.name for t in config.outputs]
        self.state_outputs = {s.output_name: s.input_name for s in seq.states}
        self._corrid = next((c for c in seq.control_inputs if c.kind == "corrid"), None)
        self.table = SequenceTable(self.slots, lambda: len(instances()), self.idle_s)
        self.stats = self.table.stats
        self._steps: dict[Pending, _Step] = {}
        self._size = 0
        self._rows = 0
        self._deadlines: list[tuple[float, int, Pending]] = []
        self._tick = itertools.count()
        self._cancelled: list[Pending] = []
        self._next_lane = 0
        self._flag_arrays: dict[tuple[str, bool], np.ndarray] = {}

    # -- the Batcher interface ----------------------------------------------------------

    def __len__(self) -> int:
        """Requests queued (not running)."""
        return self._size

    @property
    def queued_rows(self) -> int:
        """Rows queued (one per request of a batching model)."""
        return self._rows

    def lane_queued(self) -> tuple[int, int]:
        """Rows queued in each lane: all interactive (a sequence has one lane)."""
        return self._rows, 0

    @property
    def has_deadlines(self) -> bool:
        """Whether :meth:`expire` may have work: queue deadlines, or an idle release time
        (possibly stale: then :meth:`expire` recomputes it, so a timer never spins)."""
        return bool(self._deadlines) or self.table.idle_at != float("inf")

    @property
    def has_cancelled(self) -> bool:
        """Whether requests were found cancelled since the last :meth:`take_cancelled`."""
        return bool(self._cancelled)

    def take_cancelled(self) -> list[Pending]:
        """Remove and return the requests found cancelled (client gone) while batches formed."""
        items, self._cancelled = self._cancelled, []
        return items

    def add(self, item: Pending) -> None:
        """Queue ``item`` on its sequence.

        Raises:
            InvalidInputError: no sequence id, bad flags, more than one row, a CORRID that
                does not fit, or no START for a sequence that is not live (names the id).
            OverloadedError: ``max_queue_size`` requests are queued.
        """
        flags = sequence_flags(item.request.parameters, self.model)
        if self.batched and item.rows != 1:
            raise InvalidInputError(
                f"model '{self.model}' is a sequence model: a request carries one row of its "
                f"sequence (batch dimension 1), got {item.rows}"
            )
        if self._corrid is not None:
            check_corrid(self._corrid, flags.id, self.model)
        live = self.table.live.get(flags.id)
        if not flags.start and (live is None or live.ending):
            raise InvalidInputError(self._not_live(flags.id))
        if self._size >= self.max_queue_size:
            raise OverloadedError(
                f"queue of model '{self.model}' is full ({self.max_queue_size} requests)"
            )
        if live is None:
            live = self.table.open(flags.id)
        if flags.start:
            self.stats.started += 1
            live.ending = False
        if flags.end:
            live.ending = True
        live.queue.append(item)
        live.last_s = max(live.last_s, item.arrival_s)
        self._steps[item] = _Step(live, flags)
        item.queued = True
        self._size += 1
        self._rows += item.rows
        if item.deadline_s is not None:
            heapq.heappush(self._deadlines, (item.deadline_s, next(self._tick), item))

    def _not_live(self, sequence_id: SequenceId) -> str:
        why = self.table.not_live(sequence_id)
        return (
            f"sequence id {sequence_id!r} of model '{self.model}' is not active: it {why}; "
            "send parameter 'sequence_start': true to start it"
        )

    def remove(self, item: Pending) -> bool:
        """Take ``item`` out of its sequence's queue (client cancelled). False if not queued."""
        if not item.queued:
            return False
        step = self._steps.pop(item)
        step.seq.queue.remove(item)
        self._forget(item)
        self.table.maybe_idle(step.seq)
        return True

    def _forget(self, item: Pending) -> None:
        item.queued = False
        self._size -= 1
        self._rows -= item.rows

    def expire(self, now: float) -> list[Pending]:
        """Release sequences idle at ``now``; remove and return queued requests whose
        deadline is at or before ``now``."""
        if now >= self.table.idle_at:
            self.table.release_idle(now)
        expired: list[Pending] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, _, item = heapq.heappop(heap)
            if item.queued:
                step = self._steps.pop(item)
                step.seq.queue.remove(item)
                self._forget(item)
                self.table.maybe_idle(step.seq)
                expired.append(item)
        return expired

    def next_batch(self, now: float) -> SequenceBatch | None:
        """The next due batch of a lane whose instance has room, or None (wait).

        A due batch's requests leave the queue and become their sequences' running requests;
        their inputs gain the control and state tensors.
        """
        workers = self.instances()
        if not workers or not self.table.lanes:
            return None
        lanes = sorted(self.table.lanes)
        start = self._next_lane
        order = [lane for lane in lanes if lane >= start] + [lane for lane in lanes if lane < start]
        for lane in order:
            worker = workers[lane % len(workers)]
            if worker.in_flight >= worker.capacity:
                continue
            batch = self._lane_batch(lane, now, worker)
            if batch is not None:
                self._next_lane = lane + 1
                return batch
        return None

    def next_wakeup(self, can_dispatch: bool) -> float | None:
        """The earliest time :meth:`next_batch` or :meth:`expire` could change its answer
        without an arrival or a completion, seconds, or None."""
        idle_at = self.table.idle_at
        wake = idle_at if idle_at != float("inf") else None
        heap = self._deadlines
        while heap and not heap[0][2].queued:
            heapq.heappop(heap)
        if heap and (wake is None or heap[0][0] < wake):
            wake = heap[0][0]
        if can_dispatch and self.delay_s > 0:
            workers = self.instances()
            for lane, slots in self.table.lanes.items():
                if not workers:
                    break
                worker = workers[lane % len(workers)]
                if worker.in_flight >= worker.capacity:
                    continue
                ready = [s.queue[0].arrival_s for s in slots if s is not None and _waiting(s)]
                if ready:
                    due = min(ready) + self.delay_s
                    if wake is None or due < wake:
                        wake = due
        return wake

    def instance_freed(self, now: float, service_s: float, rows: int) -> None:
        """An instance finished a batch (nothing to do: a sequence's next request is ready
        once :meth:`ran` has settled its previous one)."""

    def drain(self) -> list[Pending]:
        """Remove and return every queued request (shutdown/unload)."""
        items: list[Pending] = []
        for live in self.table.live.values():
            items.extend(live.queue)
            live.queue.clear()
        for item in items:
            item.queued = False
            self._steps.pop(item, None)
        self._size = self._rows = 0
        self._deadlines.clear()
        return items

    # -- completion --------------------------------------------------------------------------

    def ran(self, result: BatchResult, now: float) -> None:
        """Account for a finished batch before the core answers it: keep each request's state
        outputs (and drop them from its outputs), settle the sequences, release the ended.

        A ``direct`` batch loses its filler rows here (their outputs go to nobody; the
        batch's ``rows`` stays the executed size). A sequence batch that failed as a whole is
        never retried in halves, with either strategy (as Triton: a model that keeps state
        per slot or per correlation id in its instance may have advanced it, and halves would
        run on whichever instance is free): its requests fail. A request whose answer lacks
        a state output gets a BackendError naming it instead.
        """
        if self.slot_layout:
            drop_fillers(result)
        if result.error is not None:
            result.retryable = False
        items = result.batch.items
        for index, item in enumerate(items):
            step = self._steps.get(item)
            if step is None:
                continue
            outputs = result.results[index] if index < len(result.results) else None
            if result.error is None and isinstance(outputs, dict) and self.state_outputs:
                problem = self._keep_state(step.seq, outputs)
                if problem is not None:
                    result.results[index] = problem
            self._settle(step.seq, item, now)

    def _keep_state(self, live: Live, outputs: dict[str, np.ndarray]) -> BackendError | None:
        missing = [name for name in self.state_outputs if name not in outputs]
        if missing:
            return BackendError(
                f"model '{self.model}' did not return state output(s) {missing} "
                f"(sequence_batching.states); it returned {sorted(outputs)}"
            )
        for output_name, input_name in self.state_outputs.items():
            live.state[input_name] = np.array(outputs.pop(output_name), copy=True)
        return None

    def _settle(self, live: Live, item: Pending, now: float) -> None:
        """``item``, the running request of ``live``, has finished."""
        step = self._steps.pop(item, None)
        if live.running is item:
            live.running = None
        live.last_s = max(live.last_s, now)
        if step is not None and step.flags.end and not live.queue:
            self.table.release(live, "ended (its END request ran)")
            self.stats.ended += 1
            return
        self.table.maybe_idle(live)

    # -- sequences and slots -----------------------------------------------------------------

    def sequence_stats(self) -> SequenceStats:
        """The counts now (see :class:`~gpuserve.engine.sequence.slots.SequenceStats`)."""
        return self.table.snapshot()

    # -- batch formation ---------------------------------------------------------------------

    def _ready(self, live: Live) -> bool:
        """Whether ``live``'s next request may join a batch (nothing of it running)."""
        running = live.running
        if running is not None:
            if running.outcome is None:
                return False
            self._settle(live, running, live.last_s)  # finished without ran() (instance hung)
        while live.queue and _gone(live.queue[0]):
            item = live.queue.popleft()
            self._steps.pop(item, None)
            self._forget(item)
            self._cancelled.append(item)
        return bool(live.queue)

    def _lane_batch(self, lane: int, now: float, worker: Worker) -> SequenceBatch | None:
        ready = [s for s in self.table.lanes[lane] if s is not None and self._ready(s)]
        if not ready:
            return None
        if self.oldest:
            ready.sort(key=lambda s: s.queue[0].arrival_s)
        lead = min(ready, key=lambda s: s.queue[0].arrival_s)
        key = self._key(lead)
        group = [s for s in ready if self._key(s) == key][: self.max_batch_size]
        if self.max_batch_tokens is not None and lead.queue[0].length:
            group = self._within_budget(group, lead, self.max_batch_tokens)
        if not self._due(group, lead, now):
            return None
        items: list[Pending] = []
        for live in group:
            item = live.queue.popleft()
            self._forget(item)
            live.running = item
            self._join(item, live)
            items.append(item)
        if self.slot_layout and group[-1].slot >= len(group):  # a gap below the last slot
            filler = self._fillers.request(items[0].request, key)
            by_slot = {live.slot: item for live, item in zip(group, items, strict=True)}
            items = slot_rows(by_slot, filler, now)
        return SequenceBatch(items, sum(i.rows for i in items), now, instance=worker, lane=lane)

    def _within_budget(self, group: list[Live], lead: Live, budget: int) -> list[Live]:
        """The sequences of ``group`` whose next requests fit ``budget`` padded tokens
        together (rows x longest row), the lead first and always; slot order kept."""
        kept = [lead]
        rows, longest = lead.queue[0].rows, lead.queue[0].length
        for live in group:
            if live is lead:
                continue
            head = live.queue[0]
            grown, widest = rows + head.rows, max(longest, head.length)
            if grown * widest > budget:
                continue
            kept.append(live)
            rows, longest = grown, widest
        if len(kept) == len(group):
            return group
        order = {id(live): i for i, live in enumerate(group)}
        return sorted(kept, key=lambda live: order[id(live)])

    def _due(self, group: list[Live], lead: Live, now: float) -> bool:
        if self.delay_s == 0 or len(group) >= self.max_batch_size:
            return True
        if now >= lead.queue[0].arrival_s + self.delay_s:
            return True
        if self.oldest:
            return bool(self.preferred) and len(group) >= self.preferred[0]
        return self.min_ready > 1 and len(group) >= self.min_ready

    def _key(self, live: Live) -> Hashable:
        """What must be equal for rows to stack: input shapes, and state shapes."""
        head = live.queue[0]
        start = self._steps[head].flags.start
        shapes = []
        for state in self.config.states:
            value = None if start else live.state.get(state.input_name)
            shapes.append(state.start_shape if value is None else state_shape(value, self.batched))
        return (head.shape_key, tuple(shapes))

    def _join(self, item: Pending, live: Live) -> None:
        """Add the control and state tensors to ``item``'s inputs (it joins a batch now)."""
        step = self._steps[item]
        if step.flags.start:
            live.state.clear()
        request = item.request
        inputs = dict(request.inputs)
        flags = step.flags
        for control in self.config.control_inputs:
            if control.kind == "corrid":
                inputs[control.name] = control_array(control, flags, self.batched)
                continue
            on = control.kind == "ready" or (flags.start if control.kind == "start" else flags.end)
            key = (control.name, on)
            array = self._flag_arrays.get(key)
            if array is None:  # one read-only array per control and value, shared by rows
                array = control_array(control, flags, self.batched)
                array.flags.writeable = False
                self._flag_arrays[key] = array
            inputs[control.name] = array
        for state in self.config.states:
            value = live.state.get(state.input_name)
            inputs[state.input_name] = (
                value if value is not None else initial_state(state, self.batched)
            )
        request.inputs = inputs
        if self.state_outputs:
            names = list(request.requested_outputs or self.outputs)
            request.requested_outputs = names + [
                name for name in self.state_outputs if name not in names
            ]
