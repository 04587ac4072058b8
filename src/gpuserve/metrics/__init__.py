"""Prometheus metrics: the only place where engine statistics become Prometheus series.

The engine records :class:`~gpuserve.engine.stats.RequestStats` and
:class:`~gpuserve.engine.stats.BatchStats` events on one monotonic clock and never imports
prometheus_client; :class:`ServerMetrics` subscribes to those events and turns them into
counters and histograms on its own :class:`~prometheus_client.CollectorRegistry` (never the
global one). Gauges that describe the present (queue depth, in-flight requests, GPU telemetry)
are read at scrape time by custom collectors, so they cost nothing between scrapes.

Modules:
    series: :class:`ServerMetrics`, the metric families and the stats listener.
    collectors: queue-depth and in-flight gauges read from the schedulers.
    gpu: GPU telemetry through NVML (nvidia-ml-py), absent when there is no GPU.
    exposition: rendering ``/metrics`` and the separate metrics-port HTTP server.
"""

from gpuserve.metrics.exposition import MetricsHttpServer, render
from gpuserve.metrics.series import UNKNOWN, ServerMetrics

__all__ = ["UNKNOWN", "MetricsHttpServer", "ServerMetrics", "render"]
