"""Sequence batcher series, read from the schedulers at scrape time.

For every loaded version of a sequence model (``sequence_batching``):

* ``gpuserve_sequences_live`` (gauge): sequences open now;
* ``gpuserve_sequences_waiting_for_slot`` (gauge): open sequences that hold no slot yet;
* ``gpuserve_sequences_started_total`` (counter): sequences started (a restart counts);
* ``gpuserve_sequences_released_total`` (counter, label ``reason``): ``ended`` (the END
  request ran) or ``idle`` (no request for ``max_sequence_idle_us``).

Read like the queue-depth gauges (:mod:`gpuserve.metrics.collectors`): a few integers the
event loop writes, read under the GIL, no cost per request. Versions of other models are
skipped (their batcher has no ``sequence_stats``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_MV = ("model", "version")


class SequenceCollector(Collector):
    """The series of the module docstring.

    Args:
        schedulers: Returns the schedulers of the loaded versions (called per scrape).
    """

    def __init__(self, schedulers: Callable[[], Iterable[Any]]) -> None:
        self.schedulers = schedulers

    def describe(self) -> list[Metric]:
        return [
            GaugeMetricFamily("gpuserve_sequences_live", "", labels=_MV),
            GaugeMetricFamily("gpuserve_sequences_waiting_for_slot", "", labels=_MV),
            CounterMetricFamily("gpuserve_sequences_started", "", labels=_MV),
            CounterMetricFamily("gpuserve_sequences_released", "", labels=(*_MV, "reason")),
        ]

    def collect(self) -> Iterator[Metric]:
        live = GaugeMetricFamily(
            "gpuserve_sequences_live",
            "Sequences open on a sequence model (started, not yet released).",
            labels=_MV,
        )
        waiting = GaugeMetricFamily(
            "gpuserve_sequences_waiting_for_slot",
            "Open sequences waiting for a free slot on an instance.",
            labels=_MV,
        )
        started = CounterMetricFamily(
            "gpuserve_sequences_started",
            "Sequences started (sequence_start), restarts included.",
            labels=_MV,
        )
        released = CounterMetricFamily(
            "gpuserve_sequences_released",
            "Sequences released: reason 'ended' (their END request ran) or 'idle' (no "
            "request for max_sequence_idle_us).",
            labels=(*_MV, "reason"),
        )
        for _ in range(3):  # a version loading mid-scrape changes the dicts; try again
            try:
                rows = [
                    (s.name, s.version, read())
                    for s in self.schedulers()
                    if (read := getattr(getattr(s, "batcher", None), "sequence_stats", None))
                    is not None
                ]
                break
            except RuntimeError:
                continue
        else:
            rows = []
        for name, version, stats in rows:
            labels = (name, version)
            live.add_metric(labels, stats.live)
            waiting.add_metric(labels, stats.waiting_for_slot)
            started.add_metric(labels, stats.started)
            released.add_metric((*labels, "ended"), stats.ended)
            released.add_metric((*labels, "idle"), stats.released_idle)
        yield live
        yield waiting
        yield started
        yield released


def manager_schedulers(manager: Any) -> Callable[[], Iterable[Any]]:
    """The schedulers of every loaded version of ``manager``'s models, per call (copied under
    the GIL: a scrape must not iterate dicts the event loop changes)."""

    def schedulers() -> Iterator[Any]:
        for model in list(manager.models.values()):
            for mv in list(model.versions.values()):
                if mv.runner is not None:
                    yield mv.runner

    return schedulers
