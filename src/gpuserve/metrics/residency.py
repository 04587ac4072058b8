"""Series of models loaded on demand: loads, evictions, load time, what is resident.

==========================================  =========  ====================================
series                                      type       meaning
==========================================  =========  ====================================
gpuserve_model_loads_total{model,outcome}   counter    load attempts on demand;
                                                       ``outcome`` success|failure
gpuserve_model_load_refusals_total{model,   counter    requests for a model not loaded
reason}                                                answered at once with no attempt
                                                       (``backoff``: its last load failed
                                                       and the back-off lasts;
                                                       ``no_room``: pinned models leave no
                                                       room under the limits)
gpuserve_model_evictions_total{model,       counter    models unloaded to make room
reason}                                                (``lru``: count limit, ``memory``:
                                                       memory limit) or ``idle``
gpuserve_model_load_seconds{model}          histogram  load and warm-up time of a load on
                                                       demand
gpuserve_loaded_models                      gauge      models with a READY version (scrape
                                                       time)
gpuserve_model_memory_bytes{model,device}   gauge      memory a loaded model gained while it
                                                       loaded (approximate; ``cpu`` = host
                                                       RSS, ``cuda:<n>`` = GPU)
==========================================  =========  ====================================

The counters are fed by the repository's :class:`~gpuserve.repository.ondemand.loader.ResidencyEvent`
listener (on the event loop, so they are :mod:`~gpuserve.metrics.loop_series` families); the
gauges are read from the model manager at scrape time. A model's series stay while it is in
the repository (an evicted model keeps its counts) and go when it leaves.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuserve.metrics.loop_series import LoopCounter, LoopHistogram

if TYPE_CHECKING:
    from gpuserve.repository.manager import ModelManager
    from gpuserve.repository.ondemand.loader import ResidencyEvent

#: Load-time buckets, seconds: from a small Python model to a large model on a GPU.
LOAD_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

#: Eviction reasons whose series exist (at 0) once a model has loaded on demand.
EVICTION_REASONS = ("lru", "memory", "idle")


class ResidencySeries:
    """The counters and histogram of loads on demand and evictions.

    Args:
        registry: Where the series are registered.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.loads = LoopCounter(
            "gpuserve_model_loads",
            "Models loaded on demand (at a request), by outcome (success|failure).",
            ("model", "outcome"),
            registry,
        )
        self.refusals = LoopCounter(
            "gpuserve_model_load_refusals",
            "Loads on demand refused at once, with no attempt (reason backoff: the last "
            "load failed and its back-off lasts; no_room: pinned models leave no room).",
            ("model", "reason"),
            registry,
        )
        self.evictions = LoopCounter(
            "gpuserve_model_evictions",
            "Models unloaded to make room (reason lru: model count limit, memory: memory "
            "limit) or after their idle time (idle).",
            ("model", "reason"),
            registry,
        )
        self.load_seconds = LoopHistogram(
            "gpuserve_model_load_seconds",
            "Load and warm-up time of models loaded on demand.",
            ("model",),
            LOAD_BUCKETS_S,
            registry,
        )

    def families(self) -> tuple[LoopCounter | LoopHistogram, ...]:
        """Every family, each labelled ``model`` first."""
        return (self.loads, self.refusals, self.evictions, self.load_seconds)

    def on_event(self, event: ResidencyEvent) -> None:
        """Count one load or eviction."""
        if event.kind == "load":
            self.loads.labels(event.model, "success" if event.ok else "failure").inc()
            self.load_seconds.labels(event.model).observe(event.seconds)
            for reason in EVICTION_REASONS:
                self.evictions.labels(event.model, reason)  # present at 0
        elif event.kind == "refuse":
            self.refusals.labels(event.model, event.reason).inc()
        else:
            self.evictions.labels(event.model, event.reason).inc()


class ResidentCollector(Collector):
    """``gpuserve_loaded_models`` and ``gpuserve_model_memory_bytes``, read per scrape.

    Args:
        manager: The model manager.
    """

    def __init__(self, manager: ModelManager) -> None:
        self.manager = manager

    def describe(self) -> list[Metric]:
        return [
            GaugeMetricFamily("gpuserve_loaded_models", ""),
            GaugeMetricFamily("gpuserve_model_memory_bytes", "", labels=("model", "device")),
        ]

    def collect(self) -> Iterator[Metric]:
        loaded = GaugeMetricFamily(
            "gpuserve_loaded_models", "Models with a READY version (read at scrape time)."
        )
        memory = GaugeMetricFamily(
            "gpuserve_model_memory_bytes",
            "Memory each loaded model gained while loading and warming up, by device (cpu: "
            "resident host memory, cuda:<n>: GPU memory; approximate).",
            labels=("model", "device"),
        )
        count = 0
        for model in list(self.manager.models.values()):
            route = getattr(model, "route", None)  # stand-in managers of tests have none
            if route is None or route.default is None:
                continue
            count += 1
            for device, size in list(getattr(model, "memory_bytes", {}).items()):
                memory.add_metric((model.name, device), size)
        loaded.add_metric((), count)
        yield loaded
        yield memory
