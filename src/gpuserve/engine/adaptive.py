"""Adaptive batching: the batcher sets its own queue delay and batch-size cap from a latency
target, so users need not tune ``max_queue_delay_us`` by hand.

A pure policy object, driven by the scheduler once per finished batch::

    policy.observe(batch, service_s)   # what the batch cost and how long it took to gather
    policy.apply(batcher)              # sets batcher.max_queue_delay_s and batcher.row_cap

Batch service time is fitted as ``c(rows) = a + b * rows`` by exponentially weighted least
squares over recent batches (:class:`~gpuserve.engine.cost_fit.LinearCost`); ``a`` is what
each batch costs whatever its size, ``b`` what each row adds. With
``L = headroom * target_p99`` (the rest is left for the protocol layers and noise):

* **row cap** ``B*``: the largest batch with ``c(B*) <= L``. A batch that big already spends
  the budget, so the batcher stops waiting and sends it as soon as ``B*`` rows are queued.
* **queue delay**: waiting ``d`` for ``k`` more requests costs each of them ``d`` but saves
  one batch overhead ``a`` (one batch instead of two), so it pays only while company arrives
  within ``a``. The delay follows how long recent batches took to gather (the spread of their
  members' arrival times) with a margin, within what the budget leaves after a batch of the
  recent typical size ``n``: ``min(1.5 * spread, a, L - c(n))``. A lone client (nobody
  joins) gets no delay.
* **backlog**: when more rows are queued than ``B*``, the target is out of reach for this
  load; the cap and the delay are lifted (largest batches at once), because that drains the
  queue fastest, which is the least latency left to have.

Before the first batch has been measured the configured delay is kept and there is no cap.
Times are seconds on the scheduler's monotonic clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gpuserve.engine.batcher import Batch
from gpuserve.engine.cost_fit import LinearCost


class _Tunable(Protocol):
    max_queue_delay_s: float
    row_cap: int | None

    @property
    def queued_rows(self) -> int: ...


@dataclass(slots=True, frozen=True)
class AdaptiveDecision:
    """What the batcher is told: the queue delay (seconds) and the row cap (None = none)."""

    max_queue_delay_s: float
    row_cap: int | None


class AdaptiveBatching:
    """Queue-delay and batch-size policy for a p99 latency target.

    Args:
        target_p99_s: Latency target, seconds.
        max_batch_size: The model's ``max_batch_size`` (rows); the cap never exceeds it.
        initial_delay_s: Delay used until the first batch is measured (the configured one).
        headroom: Share of the target the batcher plans with (0-1].
        decay: Weight kept by older batches at each new one in the cost fit (0-1).
        spread_margin: Factor on the measured gathering time when setting the delay.
    """

    def __init__(
        self,
        target_p99_s: float,
        max_batch_size: int,
        initial_delay_s: float = 0.0,
        headroom: float = 0.8,
        decay: float = 0.95,
        spread_margin: float = 1.5,
    ) -> None:
        if target_p99_s <= 0:
            raise ValueError(f"target_p99_s must be > 0, got {target_p99_s}")
        if not 0 < headroom <= 1 or not 0 < decay < 1:
            raise ValueError(
                f"headroom must be in (0, 1] and decay in (0, 1), got {headroom} and {decay}"
            )
        self.target_p99_s = target_p99_s
        self.max_batch_size = max_batch_size
        self.initial_delay_s = initial_delay_s
        self.budget_s = headroom * target_p99_s
        self.decay = decay
        self.spread_margin = spread_margin
        self.batches = 0
        self._fit = LinearCost(decay)  # service seconds in rows
        self._spread_s = 0.0
        self._rows = 0.0  # recent typical batch rows (moving average)

    # -- measurements --------------------------------------------------------------------------

    def observe(self, batch: Batch, service_s: float) -> None:
        """Record one finished batch: its rows, how long its members took to gather, and
        ``service_s``, the seconds it took to execute (preprocess to postprocess)."""
        arrivals = [item.arrival_s for item in batch.items]
        spread = max(arrivals) - min(arrivals) if arrivals else 0.0
        self.observe_values(batch.rows, spread, service_s)

    def observe_values(self, rows: int, spread_s: float, service_s: float) -> None:
        """:meth:`observe` with plain numbers (rows, gathering seconds, service seconds)."""
        x = float(max(rows, 1))
        self._fit.observe(x, service_s)
        alpha = 0.2 if self.batches else 1.0
        self._spread_s += alpha * (max(spread_s, 0.0) - self._spread_s)
        self._rows += alpha * (x - self._rows)
        self.batches += 1

    def cost(self) -> tuple[float, float]:
        """The fitted ``(a, b)`` of ``c(rows) = a + b * rows``, seconds; both >= 0."""
        return self._fit.coefficients()

    def predict_s(self, rows: int) -> float:
        """Predicted service time of a batch of ``rows`` rows, seconds."""
        a, b = self.cost()
        return a + b * rows

    # -- decisions -----------------------------------------------------------------------------

    def best_cap(self) -> int:
        """The largest batch with ``c(rows) <= budget`` (at least 1, at most max)."""
        limit = self.max_batch_size or 1
        a, b = self.cost()
        if b <= 0:
            return limit
        rows = int((self.budget_s - a) / b)
        return max(1, min(limit, rows))

    def decide(self, queued_rows: int) -> AdaptiveDecision:
        """Delay and cap for a queue now holding ``queued_rows`` rows."""
        if self.batches == 0 or not self.max_batch_size:
            return AdaptiveDecision(self.initial_delay_s, None)
        cap = self.best_cap()
        if queued_rows > cap:
            return AdaptiveDecision(0.0, None)  # backlog: drain with the largest batches
        a, b = self.cost()
        room = max(0.0, self.budget_s - a - b * min(self._rows, cap))
        delay = min(room, a, self.spread_margin * self._spread_s)
        return AdaptiveDecision(delay, cap if cap < self.max_batch_size else None)

    def apply(self, batcher: _Tunable) -> AdaptiveDecision:
        """Decide for ``batcher``'s current queue and set its delay and cap."""
        decision = self.decide(batcher.queued_rows)
        batcher.max_queue_delay_s = decision.max_queue_delay_s
        batcher.row_cap = decision.row_cap
        return decision
