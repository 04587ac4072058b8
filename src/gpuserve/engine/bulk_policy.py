"""How much bulk work a batch may carry: the bulk lane's sizing policy, pure, on the
scheduler's clock.

The dynamic batcher (:mod:`gpuserve.engine.batcher`) keeps bulk requests in a level below
every priority level and asks this policy two questions when it forms a batch, in *work
units*: padded tokens (rows x longest row, or real tokens for an unpadded model) when the
requests carry costs, rows otherwise.

* :meth:`BulkPolicy.lead_work`: the most work of a batch led by a bulk request;
* :meth:`BulkPolicy.fill_work`: the most work bulk rows may add to a batch led by an
  interactive request.

Rules:

* **Interactive traffic is about** while the last interactive request arrived less than
  ``quiet_s`` ago. Then a bulk-led batch is sized so that its estimated compute is at most
  ``max_compute_s`` (an interactive request that arrives while it runs waits for at most
  that), and bulk rows fill an interactive-led batch only as far as they add at most half
  of ``max_compute_s`` to its estimated compute: the bulk lane delays an interactive row by
  at most 1.5 x ``max_compute_s`` (the rest of the running batch, then the fill). The
  leading bulk request always runs, however large (a request is never split): bulk calls
  are cut into chunks small enough for the budget (``dynamic_batching.bulk_chunk_rows``).
* **Quiet**: with no interactive arrival for ``quiet_s``, bulk-led batches take the whole row
  and token budget: the most efficient batches, so a job alone runs as fast as ordinary calls.
* **Estimated compute** is ``a + b * work``, fitted over the model's recent batches
  (:class:`~gpuserve.engine.cost_fit.LinearCost`). Before a batch has been measured no
  estimate exists: a bulk-led batch is its leader alone and an interactive batch gets no
  bulk fill while interactive traffic is about.

Every time is seconds on the caller's monotonic clock, so tests use a fake clock.
"""

from __future__ import annotations

from gpuserve.engine.cost_fit import LinearCost

#: Share of the compute budget bulk fill may add to an interactive-led batch.
FILL_SHARE = 0.5


class BulkPolicy:
    """Sizes of bulk work in batches while interactive traffic is about (see the module
    docstring).

    Args:
        max_compute_s: Most estimated compute of a bulk-led batch, and twice the most that
            bulk fill adds to an interactive-led one, while interactive traffic is about,
            seconds.
        quiet_s: How long after the last interactive arrival that lasts, seconds; 0: never
            (bulk batches are always as large as the limits allow).
        decay: Weight kept by older batches at each new one in the cost fit (0-1).
    """

    def __init__(self, max_compute_s: float, quiet_s: float, decay: float = 0.9) -> None:
        if max_compute_s < 0 or quiet_s < 0:
            raise ValueError(
                f"max_compute_s and quiet_s must be >= 0, got {max_compute_s} and {quiet_s}"
            )
        self.max_compute_s = max_compute_s
        self.quiet_s = quiet_s
        self.cost = LinearCost(decay)
        self._last_interactive_s = float("-inf")

    def interactive_arrived(self, at_s: float) -> None:
        """An interactive request was queued at ``at_s``."""
        self._last_interactive_s = max(self._last_interactive_s, at_s)

    def observe(self, work: int, service_s: float) -> None:
        """A batch of ``work`` units finished after ``service_s`` seconds of compute."""
        self.cost.observe(work, service_s)

    def interactive_about(self, now: float) -> bool:
        """Whether an interactive request arrived less than ``quiet_s`` before ``now``."""
        return now - self._last_interactive_s < self.quiet_s

    def lead_work(self, now: float) -> int | None:
        """Most work units of a batch led by a bulk request formed at ``now`` (its leader
        runs whatever its size); None: no bound but the batch's row and token limits."""
        if not self.interactive_about(now):
            return None
        if not self.cost.samples:
            return 0
        a, b = self.cost.coefficients()
        if b <= 0:
            return None if a <= self.max_compute_s else 0
        return max(0, int((self.max_compute_s - a) / b))

    def fill_work(self, now: float) -> int | None:
        """Most work units bulk rows may add to a batch led by an interactive request formed
        at ``now``; None: no bound but the batch's row and token limits."""
        if not self.interactive_about(now):
            return None
        if not self.cost.samples:
            return 0
        _, b = self.cost.coefficients()
        if b <= 0:
            return None
        return max(0, int(FILL_SHARE * self.max_compute_s / b))


__all__ = ["BulkPolicy"]
