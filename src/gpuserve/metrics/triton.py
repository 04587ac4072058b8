"""Metrics by Triton's names (``nv_*``), beside the ``gpuserve_*`` series.

Dashboards written for Triton and ``perf_analyzer --collect-metrics`` read these names. They
are derived at scrape time, so they cost nothing per request:

* the per-model counters from the :class:`~gpuserve.engine.stats.ModelStats` the engine
  already keeps for the statistics extension (counts and cumulative nanoseconds);
* the GPU gauges from the samples of :class:`~gpuserve.metrics.gpu.NvmlCollector`.

==========================================  =======  ===========================================
series (labels ``model``, ``version``)      type     meaning (ModelStats field)
==========================================  =======  ===========================================
nv_inference_request_success                counter  successful requests (``success.count``)
nv_inference_request_failure                counter  failed requests (``fail.count``)
nv_inference_count                          counter  inferences: batch rows of successful
                                                     requests (``inference_count``)
nv_inference_exec_count                     counter  batches executed (``execution_count``)
nv_inference_request_duration_us            counter  successful requests, admission to result,
                                                     cumulative microseconds (``success.ns``)
nv_inference_queue_duration_us              counter  successful requests, time queued, us
nv_inference_compute_input_duration_us      counter  per batch: preprocess, cumulative us
nv_inference_compute_infer_duration_us      counter  per batch: forward, cumulative us
nv_inference_compute_output_duration_us     counter  per batch: postprocess, cumulative us
==========================================  =======  ===========================================

GPU gauges, labelled ``gpu_uuid`` (NVML's ``GPU-...`` UUID), present only when NVML is:
``nv_gpu_utilization`` (0..1), ``nv_gpu_memory_total_bytes``, ``nv_gpu_memory_used_bytes``,
``nv_gpu_power_usage`` (watts).

As in Triton, a version's ``nv_inference_*`` series start at 0 when it loads and disappear when
it unloads (the ``gpuserve_*`` counters, by contrast, never go backwards within a process).
One difference: Triton adds a batch's compute time once per request in it, gpuserve once per
batch (the compute counters are batch time, as in gpuserve's statistics extension).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuserve.engine.stats import ModelStats

if TYPE_CHECKING:
    from gpuserve.metrics.gpu import NvmlCollector

_MV = ("model", "version")


@dataclass(frozen=True, slots=True)
class _Counter:
    """One ``nv_inference_*`` counter: its name without ``_total``, help and reader."""

    name: str
    help: str
    read: Callable[[ModelStats], float]


def _us(ns: int) -> float:
    return max(0, ns) / 1000.0


COUNTERS = (
    _Counter(
        "nv_inference_request_success",
        "Number of successful inference requests, all batch sizes",
        lambda s: s.success.count,
    ),
    _Counter(
        "nv_inference_request_failure",
        "Number of failed inference requests, all batch sizes",
        lambda s: s.fail.count,
    ),
    _Counter(
        "nv_inference_count",
        "Number of inferences performed (batch rows of successful requests)",
        lambda s: s.inference_count,
    ),
    _Counter(
        "nv_inference_exec_count",
        "Number of model executions performed (batches)",
        lambda s: s.execution_count,
    ),
    _Counter(
        "nv_inference_request_duration_us",
        "Cumulative inference request duration in microseconds (successful requests)",
        lambda s: _us(s.success.ns),
    ),
    _Counter(
        "nv_inference_queue_duration_us",
        "Cumulative inference queuing duration in microseconds (successful requests)",
        lambda s: _us(s.queue.ns),
    ),
    _Counter(
        "nv_inference_compute_input_duration_us",
        "Cumulative compute input duration in microseconds (per batch)",
        lambda s: _us(s.compute_input.ns),
    ),
    _Counter(
        "nv_inference_compute_infer_duration_us",
        "Cumulative compute inference duration in microseconds (per batch)",
        lambda s: _us(s.compute_infer.ns),
    ),
    _Counter(
        "nv_inference_compute_output_duration_us",
        "Cumulative inference compute output duration in microseconds (per batch)",
        lambda s: _us(s.compute_output.ns),
    ),
)

#: gpuserve's NVML family -> (Triton's name, help).
GPU_GAUGES = {
    "gpuserve_gpu_utilization_ratio": ("nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)"),
    "gpuserve_gpu_memory_total_bytes": (
        "nv_gpu_memory_total_bytes",
        "GPU total memory, in bytes",
    ),
    "gpuserve_gpu_memory_used_bytes": ("nv_gpu_memory_used_bytes", "GPU used memory, in bytes"),
    "gpuserve_gpu_power_watts": ("nv_gpu_power_usage", "GPU power usage in watts"),
}


class TritonModelCollector(Collector):
    """The ``nv_inference_*`` counters of every loaded version, read from its ModelStats.

    Args:
        stats: Returns the statistics of the loaded versions (called once per scrape).
    """

    def __init__(self, stats: Callable[[], Iterable[ModelStats]]) -> None:
        self.stats = stats

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(c.name, c.help, labels=_MV) for c in COUNTERS]

    def collect(self) -> Iterator[Metric]:
        for _ in range(3):  # a version loading mid-scrape changes the dicts; try again
            try:
                versions = list(self.stats())
                break
            except RuntimeError:
                continue
        else:
            versions = []
        for counter in COUNTERS:
            family = CounterMetricFamily(counter.name, counter.help, labels=_MV)
            for stats in versions:
                family.add_metric((stats.name, stats.version), float(counter.read(stats)))
            yield family


class TritonGpuCollector(Collector):
    """``nv_gpu_*`` gauges labelled ``gpu_uuid``, from the NVML collector's readings.

    Args:
        nvml: The collector of ``gpuserve_gpu_*`` series; yields nothing when it is off.
    """

    def __init__(self, nvml: NvmlCollector) -> None:
        self.nvml = nvml

    def describe(self) -> list[Metric]:
        return []  # registering must not call NVML

    def collect(self) -> Iterator[Metric]:
        if not self.nvml.enabled:
            return
        for family in self.nvml.collect():
            triton = GPU_GAUGES.get(family.name)
            if triton is None:
                continue
            gauge = GaugeMetricFamily(triton[0], triton[1], labels=("gpu_uuid",))
            for sample in family.samples:
                gauge.add_metric((sample.labels.get("uuid", ""),), sample.value)
            yield gauge
