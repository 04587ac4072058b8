"""Metrics by Triton's names (``nv_*``), beside the ``gpuserve_*`` series.

Dashboards and alerts written for Triton, and ``perf_analyzer --collect-metrics``, read these
names, so names, types, labels and units are Triton's (its ``docs/user_guide/metrics.md``).
They are derived at scrape time, so they cost nothing per request:

* the per-model counters from the :class:`~gpuserve.engine.stats.ModelStats` the engine
  already keeps for the statistics extension (counts and cumulative nanoseconds);
* the pending-request gauge from the runner's queue;
* the GPU gauges from :class:`~gpuserve.metrics.gpu.NvmlCollector`'s NVML handle;
* the CPU gauges from ``/proc/stat`` and ``/proc/meminfo`` (Linux), see
  :mod:`gpuserve.metrics.cpu`.

==========================================  =======  ===========================================
series (labels ``model``, ``version``)      type     meaning (ModelStats field)
==========================================  =======  ===========================================
nv_inference_request_success                counter  successful requests (``success.count``)
nv_inference_request_failure{reason}        counter  failed requests by Triton's reason
                                                     (REJECTED, CANCELED, BACKEND, OTHER)
nv_inference_count                          counter  inferences: batch rows of successful
                                                     requests (``inference_count``)
nv_inference_exec_count                     counter  batches executed (``execution_count``)
nv_inference_pending_request_count          gauge    requests admitted, not yet executing
nv_inference_request_duration_us            counter  successful requests, admission to result,
                                                     cumulative microseconds (``success.ns``)
nv_inference_queue_duration_us              counter  successful requests, time queued, us
nv_inference_compute_input_duration_us      counter  per batch: preprocess, cumulative us
nv_inference_compute_infer_duration_us      counter  per batch: forward, cumulative us
nv_inference_compute_output_duration_us     counter  per batch: postprocess, cumulative us
==========================================  =======  ===========================================

Triton's counters carry no ``_total`` suffix; prometheus_client's counter families always add
one, so the ``nv_*`` counters are :class:`TritonFamily` objects that
:mod:`gpuserve.metrics.exposition` writes itself, exactly as Triton does.

As in Triton, a version's ``nv_inference_*`` series start at 0 when it loads and disappear when
it unloads (the ``gpuserve_*`` counters, by contrast, never go backwards within a process).
One difference: Triton adds a batch's compute time once per request in it, gpuserve once per
batch (the compute counters are batch time, as in gpuserve's statistics extension).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from gpuserve.engine.stats import ModelStats

if TYPE_CHECKING:
    from gpuserve.engine.runners.base import VersionRunner
    from gpuserve.metrics.gpu import NvmlCollector

_MV = ("model", "version")
_GPU = ("gpu_uuid",)

#: gpuserve's failure reasons (:mod:`gpuserve.errors`) -> Triton's ``reason`` label.
#: Triton: REJECTED = timed out (or refused) in the scheduler, CANCELED = cancelled,
#: BACKEND = failed in the model, OTHER = anything else (bad input included).
TRITON_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")
_REASON = {
    "rejected": "REJECTED",
    "timeout": "REJECTED",
    "cancelled": "CANCELED",
    "backend_error": "BACKEND",
    "out_of_memory": "BACKEND",
}


class TritonFamily(Metric):
    """An ``nv_*`` family, written by the exposition module as Triton writes it: a counter's
    samples named as the family (no ``_total``; prometheus_client's encoders always add one),
    integral values as integers (``85899345920``, not ``8.589934592e+10``: perf_analyzer
    reads the digits before the first non-digit).

    Args:
        name / documentation: The family's name and help.
        labels: Label names, in the order :meth:`add_metric` takes values.
        typ: ``counter`` or ``gauge``.
    """

    def __init__(
        self, name: str, documentation: str, labels: Sequence[str] = (), typ: str = "counter"
    ) -> None:
        super().__init__(name, documentation, typ)
        self.labelnames = tuple(labels)

    def add_metric(self, labels: Sequence[str], value: float) -> None:
        """One sample: ``labels`` in the order of the family's label names."""
        self.add_sample(self.name, dict(zip(self.labelnames, labels, strict=True)), value)


@dataclass(frozen=True, slots=True)
class _Counter:
    """One ``nv_inference_*`` counter: its name, help and reader."""

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
FAILURE = "nv_inference_request_failure"
PENDING = "nv_inference_pending_request_count"


def failures_by_reason(stats: ModelStats) -> dict[str, int]:
    """``stats.fail_reasons`` folded into Triton's four reasons (all four present)."""
    out = dict.fromkeys(TRITON_REASONS, 0)
    for reason, count in list(stats.fail_reasons.items()):
        out[_REASON.get(reason, "OTHER")] += count
    return out


def _read(what: Callable[[], Iterable[Any]]) -> list[Any]:
    for _ in range(3):  # a version loading mid-scrape changes the dicts; try again
        try:
            return list(what())
        except RuntimeError:
            continue
    return []


class TritonModelCollector(Collector):
    """The ``nv_inference_*`` series of every loaded version.

    Args:
        runners: Returns the runners of the loaded versions (called once per scrape); each
            gives its ``stats`` (ModelStats) and ``queued`` (requests not yet executing).
    """

    def __init__(self, runners: Callable[[], Iterable[VersionRunner]]) -> None:
        self.runners = runners

    def describe(self) -> list[Metric]:
        return []  # the nv_* names clash with nothing; registering must not scrape

    def collect(self) -> Iterator[Metric]:
        rows = _read(lambda: ((r.stats, r.queued) for r in self.runners()))
        for counter in COUNTERS:
            family = TritonFamily(counter.name, counter.help, _MV)
            for stats, _ in rows:
                family.add_metric((stats.name, stats.version), float(counter.read(stats)))
            yield family
        failure = TritonFamily(
            FAILURE,
            "Number of failed inference requests, all batch sizes",
            ("model", "reason", "version"),
        )
        for stats, _ in rows:
            for reason, count in failures_by_reason(stats).items():
                failure.add_metric((stats.name, reason, stats.version), float(count))
        yield failure
        pending = TritonFamily(
            PENDING,
            "Instantaneous number of pending requests awaiting execution per-model.",
            _MV,
            "gauge",
        )
        for stats, queued in rows:
            pending.add_metric((stats.name, stats.version), float(queued))
        yield pending


class TritonGpuCollector(Collector):
    """Triton's GPU series labelled ``gpu_uuid`` (NVML's ``GPU-...`` UUID), read through the
    NVML collector's handles: ``nv_gpu_utilization`` (0..1), ``nv_gpu_memory_total_bytes``,
    ``nv_gpu_memory_used_bytes``, ``nv_gpu_power_usage`` and ``nv_gpu_power_limit`` (watts),
    and the counter ``nv_energy_consumption`` (joules since the server started). A reading a
    board does not support is left out for that board.

    Args:
        nvml: The collector of ``gpuserve_gpu_*`` series; nothing is yielded when it is off.
    """

    def __init__(self, nvml: NvmlCollector) -> None:
        self.nvml = nvml
        self._lock = threading.Lock()
        #: Each board's NVML energy counter (mJ since the driver loaded) at start-up.
        self._energy_start_mj: dict[str, float] = {}
        if nvml.enabled:
            for gpu in nvml.gpus:
                mj = _call(nvml.nvml.nvmlDeviceGetTotalEnergyConsumption, gpu.handle)
                if mj is not None:
                    self._energy_start_mj[gpu.uuid] = float(mj)

    def describe(self) -> list[Metric]:
        return []  # registering must not call NVML

    def collect(self) -> Iterator[Metric]:
        nvml = self.nvml.nvml
        if not self.nvml.enabled or nvml is None:
            return
        gauges = {
            key: TritonFamily(name, doc, _GPU, "gauge")
            for key, name, doc in (
                ("util", "nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)"),
                ("total", "nv_gpu_memory_total_bytes", "GPU total memory, in bytes"),
                ("used", "nv_gpu_memory_used_bytes", "GPU used memory, in bytes"),
                ("power", "nv_gpu_power_usage", "GPU power usage in watts"),
                ("limit", "nv_gpu_power_limit", "GPU power management limit in watts"),
            )
        }
        energy = TritonFamily(
            "nv_energy_consumption",
            "GPU energy consumption in joules since the Triton Server started",
            _GPU,
        )
        with self._lock:
            for gpu in self.nvml.gpus:
                h, label = gpu.handle, (gpu.uuid,)
                rates = _call(nvml.nvmlDeviceGetUtilizationRates, h)
                memory = _call(nvml.nvmlDeviceGetMemoryInfo, h)
                power_mw = _call(nvml.nvmlDeviceGetPowerUsage, h)
                limit_mw = _call(nvml.nvmlDeviceGetEnforcedPowerLimit, h)
                total_mj = _call(nvml.nvmlDeviceGetTotalEnergyConsumption, h)
                if rates is not None:
                    gauges["util"].add_metric(label, rates.gpu / 100)
                for key, mw in (("power", power_mw), ("limit", limit_mw)):
                    if mw is not None:
                        gauges[key].add_metric(label, mw / 1000)
                if memory is not None:
                    gauges["total"].add_metric(label, float(memory.total))
                    gauges["used"].add_metric(label, float(memory.used))
                if total_mj is not None:
                    start = self._energy_start_mj.setdefault(gpu.uuid, float(total_mj))
                    energy.add_metric(label, max(0.0, total_mj - start) / 1000)
        yield from (g for g in gauges.values() if g.samples)
        if energy.samples:
            yield energy


def _call(read: Callable[..., Any], *args: Any) -> Any:
    try:
        return read(*args)
    except Exception:  # NVMLError_NotSupported, a fake without the call: leave it out
        return None
