"""Decoupled-model response series, read from the versions' statistics at scrape time.

For every loaded version of a decoupled model (``model_transaction_policy.decoupled``):

* ``gpuserve_responses_total`` (counter, label ``outcome``): responses of its streams by what
  became of them: ``success`` (outputs), ``fail`` (an error), ``empty`` (a final mark without
  a response), ``cancel`` (a stream cancelled while its model ran: one per stream);
* ``gpuserve_response_interval_seconds`` (histogram): per delivered response (success or
  fail), the time from the previous response of its stream (from the start of execution for
  the first) until it was in the stream's buffer: time to first response and the time
  between responses together.

The engine counts these in :class:`~gpuserve.engine.response_stats.ResponseStats` on the
event loop (a few integers and a bucket list per response); a scrape reads them under the
GIL, as :mod:`gpuserve.metrics.sequences` reads the sequence batcher. The series start at 0
when a decoupled version loads, and restart with a reloaded version's statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuserve.engine.response_stats import INTERVAL_BUCKETS_S, ResponseOutcome

_MV = ("model", "version")


def _bound(value: float) -> str:
    return repr(float(value))


class ResponseCollector(Collector):
    """The series of the module docstring.

    Args:
        schedulers: Returns the schedulers of the loaded versions (called per scrape).
    """

    def __init__(self, schedulers: Callable[[], Iterable[Any]]) -> None:
        self.schedulers = schedulers

    def describe(self) -> list[Metric]:
        return [
            CounterMetricFamily("gpuserve_responses", "", labels=(*_MV, "outcome")),
            HistogramMetricFamily("gpuserve_response_interval_seconds", "", labels=_MV),
        ]

    def collect(self) -> Iterator[Metric]:
        responses = CounterMetricFamily(
            "gpuserve_responses",
            "Responses of decoupled models' streams, by outcome: success, fail, empty (a "
            "final mark without a response) or cancel (a stream cancelled while it ran).",
            labels=(*_MV, "outcome"),
        )
        intervals = HistogramMetricFamily(
            "gpuserve_response_interval_seconds",
            "Decoupled models: time from the previous response of a stream (or the start of "
            "its execution) to each delivered response.",
            labels=_MV,
        )
        for _ in range(3):  # a version loading mid-scrape changes the dicts; try again
            try:
                rows = [
                    (
                        s.name,
                        s.version,
                        dict(s.stats.responses.totals),
                        list(s.stats.responses.intervals.counts),
                        s.stats.responses.intervals.sum_s,
                    )
                    for s in self.schedulers()
                    if s.config.model_transaction_policy.decoupled
                ]
                break
            except RuntimeError:
                continue
        else:
            rows = []
        for name, version, totals, counts, sum_s in rows:
            labels = (name, version)
            for outcome in ResponseOutcome:
                responses.add_metric((*labels, outcome.value), totals.get(outcome, 0))
            buckets: list[tuple[str, float]] = []
            cumulative = 0
            for bound, count in zip((*INTERVAL_BUCKETS_S, float("inf")), counts, strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else _bound(bound), cumulative))
            intervals.add_metric(labels, buckets, sum_s)
        yield responses
        yield intervals
