"""The dynamic batcher: a pure state machine that decides which requests run together.

It owns the queue of one model version and nothing else: no threads, no timers, no clock of its
own. The scheduling core (``scheduling.py``) drives it::

    batcher.add(item)                 # admission (may raise OverloadedError)
    batch = batcher.next_batch(now)   # when an instance is free: a Batch or None
    expired = batcher.expire(now)     # items whose queue deadline passed
    t = batcher.next_wakeup(...)      # when to call again if nothing else happens

Batch formation (the rules of Triton's dynamic batcher, with shape grouping added):

* Only requests with the same *shape key* (the non-batch dimensions of every input) share a
  batch, so requests of different sequence lengths are never stacked into one wrong tensor.
  The oldest request of the highest priority level leads; compatible requests join in priority
  then arrival order while their rows fit in ``max_batch_size``.
* A batch is sent at once when it is full, when it reaches a preferred batch size, when
  ``max_queue_delay_s`` is 0, or (``early_dispatch``) when as many rows are queued as the
  previous batch carried; otherwise once the leading request has waited ``max_queue_delay_s``.
* With ``early_dispatch``, requests that waited out their delay only because every instance
  was busy do not leave the moment an instance frees: the scheduler calls
  :meth:`DynamicBatcher.instance_freed`, and for a short regather window (the smaller of
  ``max_queue_delay_s`` and a tenth of the batch that just finished) the batch waits for the
  rows queued then plus the rows of the finished batch, whose clients have just been answered
  and, in a closed loop, send again at once. Without it a closed loop of 8 clients settles
  into batches of 7 and 1 (the straggler that arrived during a batch runs alone next) or 4
  and 4, well below batches of 8 on a CPU; with two instances 4 and 4 stays 4 and 4 (the other
  instance's rows are not coming back yet). The window costs at most a tenth of a batch's
  time when nobody comes, and is skipped when it would be shorter than 1 ms (a timer tick).
  With ``regather_beyond_delay`` (one CPU instance that fills the cores), once answered
  clients are seen coming back within a tenth of a batch (a closed loop), the window may last
  that whole tenth, beyond ``max_queue_delay_s``: where the HTTP layer shares the CPU with the
  model, the answers and the returning requests take longer than the delay
  (:mod:`gpuserve.engine.regather`). A window only holds a batch of the finished batch's
  shape, the one its clients come back with.
* **Length-aware batches**: when requests carry a cost (tokens per row, from their model's
  admission step), the leader is joined by the compatible requests of the nearest lengths only
  while the batch stays homogeneous in length and its padded tokens (rows x longest row) fit
  in ``max_batch_tokens``; a batch that can take no more is sent at once (see
  :mod:`gpuserve.engine.lengths`). The leader is still the oldest request of the highest level,
  so a long request never waits behind shorter ones that arrived later.
* **Two lanes**: requests marked bulk wait in a level of their own below every priority
  level, with their own queue limit (``bulk_max_queue_size``). A batch is led by an
  interactive request whenever one is queued, and bulk rows fill the rest of its row and
  token budget; a batch led by a bulk request forms only for an instance with nothing in
  flight (the core sets :attr:`DynamicBatcher.bulk_may_lead`), and no batch carries more than
  ``bulk_max_batch_size`` bulk rows. While interactive requests are about, the bulk lane's
  policy (:mod:`gpuserve.engine.bulk_policy`) bounds the bulk work further by estimated
  compute: a bulk-led batch to ``bulk_max_compute_s``, the fill of an interactive-led one to
  half of it; so a bulk backlog holds an interactive request back by at most the short bulk
  batch running when it arrives, plus a little fill in its own batch. With no interactive
  arrival for ``bulk_quiet_s``, bulk-led batches are as large as the limits allow.
* Every time value is seconds on the caller's monotonic clock, so tests use a fake clock.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Hashable
from typing import TYPE_CHECKING

from gpuserve.engine.batch import Batch, BatchResult, Pending
from gpuserve.engine.bulk_policy import BulkPolicy
from gpuserve.engine.lengths import extend_group, select_group
from gpuserve.engine.regather import ReturnProbe
from gpuserve.errors import OverloadedError

if TYPE_CHECKING:
    from gpuserve.config import ModelConfig

# Batch and Pending live in engine/batch.py, with the Batcher protocol this fulfils
__all__ = ["Batch", "DynamicBatcher", "Pending", "batches_streams"]


def batches_streams(config: ModelConfig) -> bool:
    """Whether ``config`` asks for batches of decoupled requests: decoupled, batching
    (``max_batch_size > 0``) and ``dynamic_batching`` given in its configuration (as in
    Triton, where a model without it runs one request per ``execute``). Its batches run in
    one call only when its backend also declares ``Capabilities.streams_batches``."""
    return (
        config.model_transaction_policy.decoupled
        and config.max_batch_size > 0
        and "dynamic_batching" in config.model_fields_set
    )


def _gone(item: Pending) -> bool:
    probe = item.request.is_cancelled
    return probe is not None and probe()


class DynamicBatcher:
    """Queue and batch-formation policy of one model version.

    Args:
        max_batch_size: Most rows per batch; 0 means the model does not batch (one request per
            batch, whatever its size).
        max_queue_delay_s: Longest the leading request waits for company, seconds.
        preferred_batch_sizes: Row counts that are sent without waiting.
        max_queue_size: Most queued interactive requests; ``add`` raises OverloadedError
            beyond it.
        priority_levels: Number of levels; level 1 is served first. Bulk requests
            (``priority`` :attr:`bulk_level`) wait in one more level below them.
        early_dispatch: Also send a batch, before the delay runs out, once as many rows are
            queued as the previous batch carried.
        max_batch_tokens: Most padded tokens (rows x longest row) in a batch of requests that
            carry costs; None = no token budget (rows only).
        unpadded: The model runs batches without padding: requests with costs join in
            arrival order whatever their lengths and the budget counts real tokens.
        bulk_max_queue_size: Most queued bulk requests.
        bulk_max_batch_size: Most bulk rows in one batch (an interactive request arriving
            while a bulk-led one runs waits for it to finish); None: ``max_batch_size``.
        bulk_max_compute_s: While interactive traffic is about, most estimated compute of a
            bulk-led batch, and most that bulk rows add to an interactive-led one, seconds
            (:class:`~gpuserve.engine.bulk_policy.BulkPolicy`).
        bulk_quiet_s: How long after the last interactive arrival that bound holds, seconds.
        regather_beyond_delay: Let the regather window pass ``max_queue_delay_s`` in a closed
            loop (:mod:`gpuserve.engine.regather`: where waiting costs the model nothing).
    """

    @classmethod
    def for_config(
        cls,
        config: ModelConfig,
        max_batch_tokens: int | None = None,
        unpadded: bool = False,
        streams_batches: bool = False,
        regather_beyond_delay: bool = False,
    ) -> DynamicBatcher:
        """The batcher of a version's ``max_batch_size`` and ``dynamic_batching`` settings
        (``max_batch_tokens``: the token budget, None for none; ``unpadded``: the instances
        run variable-length rows without padding; ``streams_batches``: a decoupled model's
        backend runs several streams in one call, see :func:`batches_streams`; without it a
        decoupled model's batches hold one request each; ``regather_beyond_delay``: see
        :mod:`gpuserve.engine.regather`, never with adaptive batching)."""
        db = config.dynamic_batching
        one_each = config.model_transaction_policy.decoupled and not (
            streams_batches and batches_streams(config)
        )
        return cls(
            max_batch_size=0 if one_each else config.max_batch_size,
            max_queue_delay_s=db.max_queue_delay_us / 1e6,
            preferred_batch_sizes=db.preferred_batch_sizes,
            max_queue_size=db.max_queue_size,
            priority_levels=db.priority_levels,
            early_dispatch=db.early_dispatch,
            max_batch_tokens=max_batch_tokens,
            unpadded=unpadded,
            bulk_max_queue_size=db.bulk_max_queue_size,
            bulk_max_batch_size=db.bulk_max_batch_size or config.max_batch_size or 1,
            bulk_max_compute_s=db.bulk_max_compute_us / 1e6,
            bulk_quiet_s=db.bulk_quiet_us / 1e6,
            regather_beyond_delay=regather_beyond_delay and db.adaptive is None,
        )

    def __init__(
        self,
        max_batch_size: int,
        max_queue_delay_s: float = 0.0,
        preferred_batch_sizes: list[int] | None = None,
        max_queue_size: int = 1024,
        priority_levels: int = 1,
        early_dispatch: bool = False,
        max_batch_tokens: int | None = None,
        unpadded: bool = False,
        bulk_max_queue_size: int = 4096,
        bulk_max_batch_size: int | None = None,
        bulk_max_compute_s: float = 0.005,
        bulk_quiet_s: float = 1.0,
        regather_beyond_delay: bool = False,
    ) -> None:
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.unpadded = unpadded
        self.max_queue_delay_s = max_queue_delay_s
        # Rows cap below max_batch_size, set by an adaptive policy (engine/adaptive.py);
        # a batch dispatches without waiting once it can reach the cap. None = no cap.
        self.row_cap: int | None = None
        self.early_dispatch = early_dispatch
        self._last_rows = 0
        self._regather_until = float("-inf")  # see instance_freed
        self._regather_rows = 0
        self._regather_key: Hashable = None  # the shape of the batch whose clients return
        self._last_key: Hashable = None  # the shape of the last batch formed
        self._returns = ReturnProbe(regather_beyond_delay)
        self.preferred = sorted(set(preferred_batch_sizes or []))
        self.max_queue_size = max_queue_size
        # the priority levels, then the bulk lane's level
        self._levels: list[deque[Pending]] = [deque() for _ in range(priority_levels + 1)]
        #: The level of bulk requests (below every priority level).
        self.bulk_level = priority_levels + 1
        self.bulk_max_queue_size = bulk_max_queue_size
        self.bulk_max_batch_size = max(1, bulk_max_batch_size or max_batch_size or 1)
        self.bulk_may_lead = True
        #: How much bulk work a batch may carry while interactive traffic is about.
        self.bulk_policy = BulkPolicy(bulk_max_compute_s, bulk_quiet_s)
        self._size = 0
        self._rows = 0
        self._bulk_size = 0
        self._bulk_rows = 0
        self._deadlines: list[tuple[float, int, Pending]] = []
        self._seq = itertools.count()
        self._cancelled: list[Pending] = []

    def __len__(self) -> int:
        """Number of queued requests."""
        return self._size

    @property
    def queued_rows(self) -> int:
        """Sum of the rows of the queued requests."""
        return self._rows

    def lane_queued(self) -> tuple[int, int]:
        """Rows queued in each lane: (interactive, bulk)."""
        return self._rows - self._bulk_rows, self._bulk_rows

    def add(self, item: Pending) -> None:
        """Queue ``item``.

        Raises:
            OverloadedError: the queue already holds ``max_queue_size`` requests.
            ValueError: the item's rows exceed ``max_batch_size`` or its priority is unknown
                (the protocol layer refuses such requests before they get here).
        """
        bulk = item.priority == self.bulk_level
        if bulk and self._bulk_size >= self.bulk_max_queue_size:
            raise OverloadedError(
                f"bulk queue of model '{item.request.model_name}' is full "
                f"({self.bulk_max_queue_size} requests waiting, "
                "dynamic_batching.bulk_max_queue_size); retry later"
            )
        if not bulk and self._size - self._bulk_size >= self.max_queue_size:
            raise OverloadedError(
                f"queue of model '{item.request.model_name}' is full "
                f"({self.max_queue_size} requests waiting); retry later"
            )
        if self.max_batch_size and item.rows > self.max_batch_size:
            raise ValueError(f"request of {item.rows} rows exceeds max_batch_size")
        if not 1 <= item.priority <= len(self._levels):
            raise ValueError(f"priority {item.priority} not in 1..{len(self._levels)}")
        self._levels[item.priority - 1].append(item)
        self._returns.arrived(item.arrival_s, item.rows)
        item.queued = True
        self._size += 1
        self._rows += item.rows
        if bulk:
            self._bulk_size += 1
            self._bulk_rows += item.rows
        else:
            self.bulk_policy.interactive_arrived(item.arrival_s)
        if item.deadline_s is not None:
            heapq.heappush(self._deadlines, (item.deadline_s, next(self._seq), item))

    def remove(self, item: Pending) -> bool:
        """Take ``item`` out of the queue (client cancelled). Returns False if not queued."""
        if not item.queued:
            return False
        self._levels[item.priority - 1].remove(item)
        self._forget(item)
        return True

    def _forget(self, item: Pending) -> None:
        item.queued = False
        self._size -= 1
        self._rows -= item.rows
        if item.priority == self.bulk_level:
            self._bulk_size -= 1
            self._bulk_rows -= item.rows

    def _head(self) -> Pending | None:
        """The request that leads the next batch: the oldest of the highest level; a bulk
        one only while :attr:`bulk_may_lead`."""
        levels = self._levels if self.bulk_may_lead else self._levels[:-1]
        for level in levels:
            while level and _gone(level[0]):
                self._drop(level.popleft())
            if level:
                return level[0]
        return None

    def _drop(self, item: Pending) -> None:
        self._forget(item)
        self._cancelled.append(item)

    @property
    def has_deadlines(self) -> bool:
        """Whether any queued item may have a deadline (cheap check before :meth:`expire`)."""
        return bool(self._deadlines)

    @property
    def has_cancelled(self) -> bool:
        """Whether items were found cancelled since the last :meth:`take_cancelled`."""
        return bool(self._cancelled)

    def take_cancelled(self) -> list[Pending]:
        """Remove and return the items found cancelled (client gone) since the last call.

        Cancelled items are noticed lazily, while batches form; they are never batched.
        """
        items, self._cancelled = self._cancelled, []
        return items

    def expire(self, now: float) -> list[Pending]:
        """Remove and return queued items whose deadline is at or before ``now``."""
        expired: list[Pending] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, _, item = heapq.heappop(heap)
            if item.queued:
                self._levels[item.priority - 1].remove(item)
                self._forget(item)
                expired.append(item)
        return expired

    def _target_rows(self, available: int) -> int:
        """Rows to aim for given ``available`` compatible rows."""
        if not self.max_batch_size:
            return 1
        if available >= self.max_batch_size:
            return self.max_batch_size
        for size in reversed(self.preferred):
            if size <= available:
                return size
        return available

    def _compatible_rows(self, key: Hashable, limit: int) -> int:
        total = 0
        for level in self._levels:
            for item in level:
                if item.shape_key == key:
                    total += item.rows
                    if total >= limit:
                        return total
        return total

    def next_batch(self, now: float) -> Batch | None:
        """Form the next batch if one is due at ``now``; None means wait.

        Call when an instance can take work. A due batch is removed from the queue.
        """
        head = self._head()
        if head is None:
            return None
        if not self.max_batch_size:
            self._levels[head.priority - 1].popleft()
            self._forget(head)
            return Batch([head], head.rows, now)
        limit = self.max_batch_size
        if self.row_cap is not None:
            limit = max(1, min(limit, self.row_cap))
        if head.priority == self.bulk_level:  # short bulk batches: little for others to wait
            limit = min(limit, self.bulk_max_batch_size)
        if head.length:
            return self._next_group(head, limit, now)
        if head.priority == self.bulk_level:
            lead = self.bulk_policy.lead_work(now)  # rows, for requests without costs
            if lead is not None:
                limit = max(head.rows, min(limit, lead))
        available = self._compatible_rows(head.shape_key, limit)
        regathering = self._regathering(head, now)
        # the same sum as next_wakeup's, so a timer fired at that time finds the batch due
        waited_out = now >= head.arrival_s + self.max_queue_delay_s and not regathering
        full = available >= limit
        preferred_hit = bool(self.preferred) and available >= self.preferred[0]
        # As many rows as the last batch carried (or, while regathering, as are expected
        # back): under a steady closed loop that is all that is coming, and waiting out the
        # delay would only idle the instance.
        expected = min(self._regather_rows, limit) if regathering else self._last_rows
        expected_hit = self.early_dispatch and 0 < expected <= available
        if not (waited_out or full or preferred_hit or expected_hit):
            return None
        take_all = waited_out or expected_hit
        target = min(available, limit) if take_all else self._target_rows(available)
        target = max(min(target, limit), head.rows)
        fill = None if head.priority == self.bulk_level else self.bulk_policy.fill_work(now)
        batch = self._take(head.shape_key, target, now, fill)
        if not batch.items:
            return None
        self._last_rows = batch.rows
        self._last_key = head.shape_key
        self._regather_until = float("-inf")  # a window serves one batch
        return batch

    def _next_group(self, head: Pending, limit: int, now: float) -> Batch | None:
        """:meth:`next_batch` for a leader with a cost: a length-homogeneous group within the
        token budget. Due on the same signals as a plain batch, with the group's rows."""
        key = head.shape_key
        candidates: list[Pending] = []  # interactive rows
        bulk_rows: list[Pending] = []
        gone: list[Pending] = []
        available = head.rows
        bulk_room = self.bulk_max_batch_size  # bulk rows this batch may carry
        for index, level in enumerate(self._levels):
            bulk = index == self.bulk_level - 1
            for item in level:
                if item is head or item.shape_key != key:
                    continue
                if _gone(item):
                    gone.append(item)
                    continue
                if bulk:
                    if item.rows > bulk_room:
                        break
                    bulk_room -= item.rows
                    bulk_rows.append(item)
                else:
                    candidates.append(item)
                available += item.rows
        tokens = self.max_batch_tokens
        policy = self.bulk_policy
        if head.priority == self.bulk_level:  # sized to the policy's compute budget
            lead = policy.lead_work(now)
            if lead is not None:
                tokens = lead if tokens is None else min(tokens, lead)
            group = select_group(head, bulk_rows, limit, tokens, self.unpadded)
        else:  # interactive rows first, then bulk fill within the policy's budget
            group = select_group(head, candidates, limit, tokens, self.unpadded)
            fill = policy.fill_work(now)
            if bulk_rows and fill != 0:
                if fill is not None:
                    work = self._work(group.items, group.rows, group.longest)
                    tokens = work + fill if tokens is None else min(tokens, work + fill)
                group = extend_group(group, bulk_rows, limit, tokens, self.unpadded)
        regathering = self._regathering(head, now)
        waited_out = now >= head.arrival_s + self.max_queue_delay_s and not regathering
        preferred_hit = bool(self.preferred) and group.rows >= self.preferred[0]
        # as in next_batch: as many rows queued (of any length) as are expected back
        expected = min(self._regather_rows, limit) if regathering else self._last_rows
        expected_hit = self.early_dispatch and 0 < expected <= available
        if gone:
            self._remove(gone)
            for item in gone:
                self._drop(item)
        if not (waited_out or group.full or preferred_hit or expected_hit):
            return None
        items = group.items
        if not (waited_out or group.full or expected_hit):  # a preferred size was reached
            target = self._target_rows(group.rows)
            rows = 0
            kept: list[Pending] = []
            for item in items:
                if rows + item.rows <= target or not kept:
                    kept.append(item)
                    rows += item.rows
            items = kept
        self._remove(items)
        rows = 0
        tokens = 0
        longest = 0
        for item in items:
            self._forget(item)
            rows += item.rows
            tokens += item.tokens
            longest = max(longest, item.length)
        self._last_rows = rows
        self._last_key = key
        self._regather_until = float("-inf")
        padded = tokens if self.unpadded else rows * longest  # what the model computes on
        return Batch(items, rows, now, tokens=tokens, padded_tokens=padded)

    def _remove(self, items: list[Pending]) -> None:
        """Take ``items`` (queued) out of their levels' deques; the counts are the caller's."""
        chosen = {id(item) for item in items}
        for index in {item.priority - 1 for item in items}:
            self._levels[index] = deque(
                item for item in self._levels[index] if id(item) not in chosen
            )

    def instance_freed(self, now: float, service_s: float, rows: int) -> None:
        """An instance finished a batch of ``rows`` rows that took ``service_s`` seconds, at
        ``now``: open the regather window (see the module docstring and
        :mod:`gpuserve.engine.regather`). No window without ``early_dispatch``; with an empty
        queue the window waits for the finished batch's rows alone."""
        window = self._returns.window(now, service_s, rows, self.max_queue_delay_s)
        if self.early_dispatch and window > 0:
            key = self._last_key
            self._regather_until = now + window
            self._regather_key = key
            self._regather_rows = self._compatible_rows(key, self.max_batch_size or 1) + rows

    def _regathering(self, head: Pending, now: float) -> bool:
        """Whether ``head``'s batch is in a regather window: one is open and the returning
        rows (of the finished batch's shape) can join it."""
        return now < self._regather_until and head.shape_key == self._regather_key

    def _take(self, key: Hashable, target: int, now: float, fill: int | None = None) -> Batch:
        """Up to ``target`` rows of shape ``key``, by level; at most ``fill`` bulk rows after
        interactive ones (None: as many as fit)."""
        items: list[Pending] = []
        rows = 0
        for index, level in enumerate(self._levels):
            if rows >= target or not level:
                continue
            # bulk rows: at most bulk_max_batch_size of them in any batch, and at most the
            # policy's fill after interactive rows
            cap = target
            if index == self.bulk_level - 1:
                room = self.bulk_max_batch_size
                if rows and fill is not None:
                    room = min(room, fill)
                cap = min(target, rows + room)
            keep: deque[Pending] = deque()
            for item in level:
                if rows < cap and item.shape_key == key and rows + item.rows <= cap:
                    if _gone(item):
                        self._drop(item)
                        continue
                    items.append(item)
                    rows += item.rows
                    self._forget(item)
                else:
                    keep.append(item)
            self._levels[index] = keep
        return Batch(items, rows, now)

    def next_wakeup(self, can_dispatch: bool) -> float | None:
        """The earliest time at which ``next_batch`` or ``expire`` could change its answer
        without a new arrival, or None.

        Args:
            can_dispatch: Whether an instance is free; if not, only deadlines matter.
        """
        wake: float | None = None
        heap = self._deadlines
        while heap and not heap[0][2].queued:
            heapq.heappop(heap)
        if heap:
            wake = heap[0][0]
        if can_dispatch:
            head = self._head()
            if head is not None:
                due = max(head.arrival_s + self.max_queue_delay_s, self._regather_until)
                if wake is None or due < wake:
                    wake = due
        return wake

    def ran(self, result: BatchResult, now: float) -> None:
        """A batch finished: its compute time feeds the bulk policy's cost estimate (nothing
        is kept per request)."""
        batch = result.batch
        if result.error is None and result.finished_s > result.started_s:
            work = batch.padded_tokens or batch.rows
            self.bulk_policy.observe(work, result.finished_s - result.started_s)

    def _work(self, items: list[Pending], rows: int, longest: int) -> int:
        """Work units of a batch of ``items`` (the bulk policy's): tokens it computes on
        (padded, or real when unpadded)."""
        if self.unpadded:
            return sum(item.tokens for item in items)
        return rows * longest

    def drain(self) -> list[Pending]:
        """Remove and return every queued item (shutdown/unload)."""
        items: list[Pending] = []
        for level in self._levels:
            items.extend(level)
            level.clear()
        for item in items:
            item.queued = False
        self._size = self._rows = self._bulk_size = self._bulk_rows = 0
        self._deadlines.clear()
        return items
