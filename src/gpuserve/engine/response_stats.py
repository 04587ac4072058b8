"""Per-response statistics of decoupled models (Triton's ``response_stats``).

A decoupled request answers with a stream of responses; Triton's statistics extension counts
them per *response index* across requests: key ``"0"`` aggregates every stream's first
response, ``"1"`` every second one, and so on. Each index holds an
:class:`ResponseIndexStats` (Triton's ``InferResponseStatistics``):

* ``compute_infer``: time to produce the response, from the previous response's send (the
  start of execution for index 0) until the model handed it to the server;
* ``compute_output``: time to send it: from that hand-off until the response sat in the
  stream's buffer (output conversion and checks, plus any wait for a slow client:
  back-pressure);
* ``success`` / ``fail``: responses with outputs / with an error; duration infer + output;
* ``empty_response``: a final mark with neither outputs nor error (a generator's end, a
  Triton ``send(flags=FINAL)`` without a response); duration infer, no ``compute_output``;
* ``cancel``: the stream was cancelled (client gone, or the server stopped it) while its model
  ran, counted at the index of the response it never delivered; duration from the cancel until
  the model's call returned (its clean-up), 0 when the call had already returned.

Everything is recorded on the event loop thread (no locks); the durations come from the
stream's injected clock (:class:`~gpuserve.engine.streaming.buffer.ResponseChannel`), so this
module is pure and tested with fake times. The metrics layer reads :attr:`ResponseStats.totals`
and the interval histogram at scrape time.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from enum import StrEnum

from gpuserve.engine.stats import Duration

#: Upper bounds (seconds) of the response-interval histogram's buckets (``+Inf`` implied):
#: generation streams live between a millisecond and a second per response.
INTERVAL_BUCKETS_S: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class ResponseOutcome(StrEnum):
    """What became of one response (the ``outcome`` label of ``gpuserve_responses_total``)."""

    SUCCESS = "success"
    FAIL = "fail"
    EMPTY = "empty"
    CANCEL = "cancel"


# Module-level names: an Enum class attribute lookup costs several times a global's.
_SUCCESS = ResponseOutcome.SUCCESS
_FAIL = ResponseOutcome.FAIL
_EMPTY = ResponseOutcome.EMPTY


@dataclass(slots=True)
class ResponseIndexStats:
    """The aggregate of every stream's response at one index (Triton's
    ``InferResponseStatistics``; see the module docstring for each field)."""

    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    empty_response: Duration = field(default_factory=Duration)
    cancel: Duration = field(default_factory=Duration)

    def as_dict(self) -> dict[str, dict[str, int]]:
        """The statistics extension's ``$response_stats`` object."""
        return {
            "compute_infer": self.compute_infer.as_dict(),
            "compute_output": self.compute_output.as_dict(),
            "success": self.success.as_dict(),
            "fail": self.fail.as_dict(),
            "empty_response": self.empty_response.as_dict(),
            "cancel": self.cancel.as_dict(),
        }


@dataclass(slots=True)
class IntervalHistogram:
    """Cumulative-free bucket counts of response intervals (seconds), for a Prometheus
    histogram rendered at scrape time.

    Attributes:
        counts: Per bucket of :data:`INTERVAL_BUCKETS_S`, then one for ``+Inf``: observations
            that fell in it (not cumulative).
        sum_s: Sum of the observations, seconds.
    """

    counts: list[int] = field(default_factory=lambda: [0] * (len(INTERVAL_BUCKETS_S) + 1))
    sum_s: float = 0.0

    def observe(self, seconds: float) -> None:
        """Count one interval of ``seconds``."""
        self.counts[bisect_left(INTERVAL_BUCKETS_S, seconds)] += 1
        self.sum_s += seconds


@dataclass
class ResponseStats:
    """The response statistics of one model version.

    Attributes:
        by_index: Response index -> its aggregate (indices appear as streams reach them).
        success / fail / empty / cancelled: Responses per outcome, every index together
            (never reset; see :attr:`totals`).
        intervals: Time per delivered response (success or fail): ``compute_infer +
            compute_output``, i.e. from the previous response (or the start of execution) to
            this one.
    """

    by_index: dict[int, ResponseIndexStats] = field(default_factory=dict)
    success: int = 0
    fail: int = 0
    empty: int = 0
    cancelled: int = 0
    intervals: IntervalHistogram = field(default_factory=IntervalHistogram)

    @property
    def totals(self) -> dict[ResponseOutcome, int]:
        """Responses per outcome, every index together."""
        return {
            ResponseOutcome.SUCCESS: self.success,
            ResponseOutcome.FAIL: self.fail,
            ResponseOutcome.EMPTY: self.empty,
            ResponseOutcome.CANCEL: self.cancelled,
        }

    def _at(self, index: int) -> ResponseIndexStats:
        entry = self.by_index.get(index)
        if entry is None:
            entry = self.by_index[index] = ResponseIndexStats()
        return entry

    def record_response(
        self, index: int, outcome: ResponseOutcome, infer_s: float, output_s: float
    ) -> None:
        """Count the response at ``index`` of one stream (once per response: kept cheap).

        Args:
            index: 0-based position in its stream.
            outcome: SUCCESS (outputs), FAIL (an error) or EMPTY (a final mark alone).
            infer_s: Seconds to produce it (``compute_infer``).
            output_s: Seconds to send it (``compute_output``; ignored for EMPTY).

        Raises:
            ValueError: ``outcome`` is CANCEL (see :meth:`record_cancel`).
        """
        entry = self.by_index.get(index)
        if entry is None:
            entry = self.by_index[index] = ResponseIndexStats()
        infer_ns = int(infer_s * 1e9) if infer_s > 0.0 else 0
        infer = entry.compute_infer
        infer.count += 1
        infer.ns += infer_ns
        if outcome is _EMPTY:
            target = entry.empty_response
            target.count += 1
            target.ns += infer_ns
            self.empty += 1
            return
        if outcome is _SUCCESS:
            target = entry.success
            self.success += 1
        elif outcome is _FAIL:
            target = entry.fail
            self.fail += 1
        else:
            infer.count -= 1  # undo: nothing is counted for a bad outcome
            infer.ns -= infer_ns
            raise ValueError("a cancel is counted with record_cancel")
        output_ns = int(output_s * 1e9) if output_s > 0.0 else 0
        output = entry.compute_output
        output.count += 1
        output.ns += output_ns
        target.count += 1
        target.ns += infer_ns + output_ns
        histogram = self.intervals
        histogram.counts[bisect_left(INTERVAL_BUCKETS_S, (infer_ns + output_ns) * 1e-9)] += 1
        histogram.sum_s += (infer_ns + output_ns) * 1e-9

    def record_cancel(self, index: int, cleanup_s: float) -> None:
        """Count a stream cancelled before its response at ``index``.

        Args:
            index: Responses the stream had produced when it was cancelled.
            cleanup_s: Seconds from the cancel until the model's call returned (0 when it had
                returned already).
        """
        self._at(index).cancel.add(max(0.0, cleanup_s))
        self.cancelled += 1

    def as_dict(self) -> dict[str, dict[str, dict[str, int]]]:
        """The statistics extension's ``response_stats`` map: index (a string) -> stats."""
        return {str(index): entry.as_dict() for index, entry in sorted(self.by_index.items())}
