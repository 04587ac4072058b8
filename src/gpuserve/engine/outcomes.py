"""What the scheduling core hands back, and how a request's outcome and statistics are made.

The core (``scheduling.py``) returns typed records, never bare tuples: :class:`Schedule` from
``schedule``, :class:`Completion` from ``complete``, :class:`Hung` from ``hung``. Each lists the
requests it finished, each with ``Pending.outcome`` set by :class:`Outcomes`, which also records
one :class:`~gpuserve.engine.stats.RequestStats` per finished request and one
:class:`~gpuserve.engine.stats.BatchStats` per executed batch. Times are seconds on the
scheduler's monotonic clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic

from gpuserve.engine.batch import Batch, BatchResult, Pending
from gpuserve.engine.inflight import InFlight, W
from gpuserve.engine.request import InferenceResponse, RequestTiming
from gpuserve.engine.stats import BatchStats, ModelStats, RequestStats
from gpuserve.errors import CancelledRequestError, GpuserveError


def _gone() -> CancelledRequestError:
    """The outcome of a request whose caller went away while its batch ran."""
    return CancelledRequestError("client went away while the request ran")


@dataclass(slots=True)
class Schedule(Generic[W]):
    """What one ``SchedulerCore.schedule`` call decided (the same empty one may be returned
    each time nothing happens: read it, do not change it).

    Attributes:
        dispatched: Batches to hand to their instances now, in order.
        finished: Requests that left the queue without running (queue timeout, or their
            ``is_cancelled`` probe said the client is gone), with ``outcome`` set.
    """

    dispatched: Sequence[InFlight[W]]
    finished: Sequence[Pending]


@dataclass(slots=True)
class Completion:
    """What ``SchedulerCore.complete`` made of one batch result.

    Attributes:
        finished: Requests answered, with ``outcome`` set (empty when the batch is retried).
        retried: The halves queued to run again ahead of new work (empty unless the batch
            failed with a retryable error and had several requests).
        late: The batch's instance had been declared hung; the result was ignored.
    """

    finished: Sequence[Pending]
    retried: Sequence[Batch] = ()
    late: bool = False


@dataclass(slots=True)
class Hung(Generic[W]):
    """An instance declared hung by ``SchedulerCore.hung``.

    Attributes:
        instance: The instance, already dropped from the core's ``instances``.
        batches: Its in-flight batches, now failed.
        finished: The failed requests, ``outcome`` set: the batches' members and, when no
            replacement is coming and no instance is left, every queued request too.
    """

    instance: W
    batches: list[InFlight[W]]
    finished: list[Pending]


class Outcomes:
    """Sets the outcomes of one model version's requests and records their statistics.

    Args:
        name / version: The model version, as responses and statistics name it.
        stats: Where events are recorded (and passed on to its listeners).
    """

    __slots__ = ("name", "stats", "version")

    def __init__(self, name: str, version: str, stats: ModelStats) -> None:
        self.name = name
        self.version = version
        self.stats = stats

    def batch_ran(self, result: BatchResult) -> None:
        """Record the execution of ``result.batch`` (``ok`` False when it failed as a whole)."""
        batch = result.batch
        self.stats.record_batch(
            BatchStats(
                self.name,
                self.version,
                batch.rows,
                len(batch.items),
                result.preprocess_s,
                result.forward_s,
                result.postprocess_s,
                result.error is None,
                batch.tokens,
                batch.padded_tokens,
            )
        )

    def answered(self, result: BatchResult, now: float) -> None:
        """Give every request of a batch that ran its outcome at ``now``: an
        :class:`InferenceResponse` of its own rows, or its own error (a row error).

        Timing per request: queue = admission to ``result.started_s``; compute = the batch's
        ``finished_s - started_s``; total = admission to ``now``.
        """
        name, version, started_s = self.name, self.version, result.started_s
        compute_s = result.finished_s - started_s
        batch_rows = result.batch.rows
        record_request = self.stats.record_request
        for item, outcome in zip(result.batch.items, result.results, strict=True):
            queue_s = started_s - item.arrival_s
            total_s = now - item.arrival_s
            if item.cancelled:  # ran for a caller that had gone: never a success
                outcome = _gone()
            if isinstance(outcome, GpuserveError):
                item.outcome = outcome
                reason: str | None = outcome.reason
            else:
                timing = RequestTiming(queue_s, compute_s, total_s, batch_rows)
                item.outcome = InferenceResponse(
                    name, version, item.request.id, outcome, timing, item.rows
                )
                reason = None
            record_request(
                RequestStats(
                    name,
                    version,
                    item.rows,
                    queue_s,
                    compute_s,
                    total_s,
                    reason,
                    item.request.lane,
                )
            )

    def failed(
        self, item: Pending, error: GpuserveError, queue_s: float, compute_s: float, now: float
    ) -> None:
        """Fail ``item`` with ``error`` at ``now`` (its total time: admission to ``now``);
        an item whose caller had gone while it ran is counted cancelled whatever the error."""
        if item.cancelled:
            error = _gone()
        item.outcome = error
        total_s = now - item.arrival_s
        self.stats.record_request(
            RequestStats(
                self.name,
                self.version,
                item.rows,
                queue_s,
                compute_s,
                total_s,
                error.reason,
                item.request.lane,
            )
        )

    def streamed(self, item: Pending, error: GpuserveError | None, now: float) -> None:
        """Finish ``item``, a decoupled request whose stream ended at ``now`` (``error``:
        what it ended with, None on success). Its outcome is that error, or a response
        without outputs (they went out through its stream) carrying its timing: queue =
        admission to its batch's dispatch (``started_s``), compute = dispatch to ``now``."""
        started_s = item.started_s or now
        queue_s = started_s - item.arrival_s
        compute_s = now - started_s
        if error is not None:
            self.failed(item, error, queue_s, compute_s, now)
            return
        total_s = now - item.arrival_s
        timing = RequestTiming(queue_s, compute_s, total_s, item.rows)
        item.outcome = InferenceResponse(self.name, self.version, item.request.id, {}, timing)
        self.stats.record_request(
            RequestStats(
                self.name,
                self.version,
                item.rows,
                queue_s,
                compute_s,
                total_s,
                None,
                item.request.lane,
            )
        )

    def refused(self, error: GpuserveError, rows: int = 0) -> GpuserveError:
        """Record a request refused at admission (so a failure is never uncounted); returns
        ``error`` for the caller to raise."""
        self.stats.record_request(
            RequestStats(self.name, self.version, rows, 0.0, 0.0, 0.0, error.reason)
        )
        return error
