"""Gauges read from the schedulers at scrape time.

Queue depth and in-flight requests describe the present, so they are read when Prometheus
scrapes rather than updated on every arrival: no engine change and no cost per request. A
scrape on the metrics-port thread reads two integers that the event loop writes; under the
GIL each read is atomic, and a value one request stale is fine for a gauge.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from gpuserve.engine.runners.base import VersionRunner


_LANE = ("model", "version", "lane")


class SchedulerCollector(Collector):
    """``gpuserve_queue_depth`` and ``gpuserve_inflight_requests`` per model and version.

    Args:
        schedulers: Returns the schedulers of the loaded versions (called per scrape).
    """

    def __init__(self, schedulers: Callable[[], Iterable[VersionRunner]]) -> None:
        self.schedulers = schedulers

    def describe(self) -> list[Metric]:
        # Names only (registering must not call collect()).
        return [
            GaugeMetricFamily("gpuserve_queue_depth", "", labels=("model", "version")),
            GaugeMetricFamily("gpuserve_inflight_requests", "", labels=("model", "version")),
            GaugeMetricFamily("gpuserve_lane_queued_rows", "", labels=_LANE),
        ]

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            "gpuserve_queue_depth",
            "Requests waiting in the model's queue for a batch (read at scrape time).",
            labels=("model", "version"),
        )
        inflight = GaugeMetricFamily(
            "gpuserve_inflight_requests",
            "Requests admitted to the model and not yet answered: queued plus executing "
            "(read at scrape time).",
            labels=("model", "version"),
        )
        lane_queued = GaugeMetricFamily(
            "gpuserve_lane_queued_rows",
            "Rows waiting in each lane of the model's queue (interactive, bulk).",
            labels=_LANE,
        )
        for _ in range(3):  # a version loading mid-scrape changes the dicts; try again
            try:
                runners = list(self.schedulers())
                rows = [
                    (s.name, s.version, s.queued, s.in_flight_requests, s.lane_queued())
                    for s in runners
                ]
                break
            except RuntimeError:
                continue
        else:
            rows = []
        for name, version, queued, admitted, lanes in rows:
            depth.add_metric((name, version), queued)
            inflight.add_metric((name, version), admitted)
            for lane, waiting in zip(("interactive", "bulk"), lanes, strict=True):
                lane_queued.add_metric((name, version, lane), waiting)
        yield depth
        yield inflight
        yield lane_queued
