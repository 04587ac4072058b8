"""The Prometheus series of gpuserve, fed from engine statistics.

Every per-model series carries the labels ``model`` and ``version``. Names follow
``gpuserve_<what>_<unit>``:

==========================================  =========  ====================================
series                                      type       meaning
==========================================  =========  ====================================
gpuserve_requests_total{outcome,reason}     counter    inference requests answered;
                                                       ``outcome`` success|failure, ``reason``
                                                       "" on success, else the error's reason
gpuserve_inference_rows_total               counter    batch rows of successful requests
gpuserve_batches_total                      counter    batches executed (a failed batch that is
                                                       retried in parts counts each part)
gpuserve_request_duration_seconds           histogram  successful requests, admission into the
                                                       model queue to result ready
gpuserve_queue_duration_seconds             histogram  successful requests, time queued
gpuserve_compute_duration_seconds{stage}    histogram  per batch: preprocess|forward|postprocess
gpuserve_batch_size                         histogram  rows per executed batch
gpuserve_batch_tokens                       histogram  real tokens per executed batch (models
                                                       whose requests carry a cost: text)
gpuserve_batch_padding_ratio                histogram  padded tokens / real tokens per batch
                                                       (1 = no padding)
gpuserve_queue_depth                        gauge      requests waiting in the queue (scrape time)
gpuserve_inflight_requests                  gauge      requests admitted, not yet answered
==========================================  =========  ====================================

Loads on demand, evictions and what is resident: see :mod:`gpuserve.metrics.residency`.

Triton's names (``nv_inference_*``, ``nv_gpu_*``, ``nv_cpu_*``) are exposed beside these,
derived at scrape time by :mod:`gpuserve.metrics.triton` and :mod:`gpuserve.metrics.cpu`.

Failure reasons are the ``reason`` of :mod:`gpuserve.errors` (``invalid``, ``not_found``,
``not_ready``, ``rejected``, ``timeout``, ``cancelled``, ``backend_error``,
``out_of_memory``, ``unavailable``); a failed request is never counted as a success (BC-20).
Requests refused before they reach a model version (unknown model 404, model not ready 503,
body too large 413) are counted through :meth:`ServerMetrics.record_unrouted`. To keep the
number of series bounded, a model name that is not in the repository, and a version that the
model does not have, are both labelled ``_unknown``.

Counters live here, not in the engine's :class:`~gpuserve.engine.stats.ModelStats`, so they
never go backwards within one process while the model is in the repository, a version
unloaded and loaded again included. Every series of a model leaves ``/metrics`` when the model
leaves the repository (:meth:`ServerMetrics.model_removed`), so the exposition stays bounded
by what the repository holds, however many models come and go.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Gauge,
    ProcessCollector,
    disable_created_metrics,
)

import gpuserve
from gpuserve.engine.stats import BatchStats, RequestStats
from gpuserve.metrics.collectors import SchedulerCollector
from gpuserve.metrics.cpu import CpuCollector
from gpuserve.metrics.gpu import NvmlCollector
from gpuserve.metrics.loop_series import CounterChild, LoopCounter, LoopHistogram
from gpuserve.metrics.residency import ResidencySeries, ResidentCollector
from gpuserve.metrics.triton import TritonGpuCollector, TritonModelCollector

if TYPE_CHECKING:
    from gpuserve.engine.runners.base import VersionRunner
    from gpuserve.repository.manager import ModelManager
    from gpuserve.repository.ondemand.loader import ResidencyEvent

logger = logging.getLogger(__name__)

#: Label value for a model or version that the repository does not have.
UNKNOWN = "_unknown"

#: Failure reasons whose series exist (at 0) as soon as a version loads, so that ``rate()``
#: and ``increase()`` see the first failure. Other reasons appear when first counted.
KNOWN_REASONS = (
    "invalid",
    "rejected",
    "timeout",
    "cancelled",
    "backend_error",
    "out_of_memory",
    "not_ready",
    "unavailable",
)

#: Latency buckets, seconds: densest between 1 ms and 100 ms, where served models live.
LATENCY_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.2,
    0.3,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

#: Batch-size buckets, rows: 1, 2, 4, ..., 4096.
BATCH_SIZE_BUCKETS = tuple(float(2**i) for i in range(13))
#: Tokens-per-batch buckets: 16, 32, ..., 131072.
BATCH_TOKEN_BUCKETS = tuple(float(2**i) for i in range(4, 18))
#: Padding-ratio buckets (padded / real tokens).
PADDING_RATIO_BUCKETS = (1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0, 8.0, 16.0)

_MV = ("model", "version")
STAGES = ("preprocess", "forward", "postprocess")


class _VersionSeries:
    """The label children of one (model, version), resolved once: ``labels()`` is a dict
    lookup, more than the per-request path needs (the children are lock-free: see
    :mod:`gpuserve.metrics.loop_series`)."""

    __slots__ = (
        "batch_size",
        "batch_tokens",
        "batches",
        "failures",
        "lanes",
        "owner",
        "padding",
        "queue",
        "request",
        "rows",
        "stages",
        "success",
    )

    def __init__(self, owner: ServerMetrics, model: str, version: str) -> None:
        self.owner = owner
        self.success = owner.requests.labels(model, version, "success", "")
        self.failures = {
            reason: owner.requests.labels(model, version, "failure", reason)
            for reason in KNOWN_REASONS
        }
        self.rows = owner.rows.labels(model, version)
        self.batches = owner.batches.labels(model, version)
        self.request = owner.request_duration.labels(model, version)
        self.queue = owner.queue_duration.labels(model, version)
        self.stages = tuple(owner.compute_duration.labels(model, version, s) for s in STAGES)
        self.batch_size = owner.batch_size.labels(model, version)
        self.batch_tokens = owner.batch_tokens.labels(model, version)
        self.padding = owner.padding_ratio.labels(model, version)
        #: lane -> (requests, rows, queue seconds) children
        self.lanes = {
            lane: (
                owner.lane_requests.labels(model, version, lane),
                owner.lane_rows.labels(model, version, lane),
                owner.lane_queue.labels(model, version, lane),
            )
            for lane in ("interactive", "bulk")
        }

    def failure(self, model: str, version: str, reason: str) -> CounterChild:
        child = self.failures.get(reason)
        if child is None:
            child = self.failures[reason] = self.owner.requests.labels(
                model, version, "failure", reason
            )
        return child


class ServerMetrics:
    """gpuserve's registry of series and the listener that feeds it from engine stats.

    Args:
        manager: The model manager; its repository bounds the ``model`` and ``version``
            label values and its schedulers are read for the queue gauges. None for a
            registry without scheduler gauges (tests).
        nvml: An NVML module to read GPU telemetry from (dependency injection for tests);
            None imports ``pynvml`` (nvidia-ml-py) when it is installed.
        gpu: Whether to register the GPU collector at all.
        process: Whether to register process CPU and memory (``process_*`` series).

    All listener methods run on the event loop thread (the engine records stats there);
    scrapes may come from any thread.
    """

    def __init__(
        self,
        manager: ModelManager | None = None,
        *,
        nvml: Any = None,
        gpu: bool = True,
        process: bool = True,
    ) -> None:
        self.manager = manager
        # No ``*_created`` samples: they double the exposition and no dashboard reads them.
        # (prometheus_client keeps this switch process-wide.)
        disable_created_metrics()
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = LoopCounter(
            "gpuserve_requests",
            "Inference requests answered, by outcome (success|failure) and failure reason.",
            (*_MV, "outcome", "reason"),
            r,
        )
        self.rows = LoopCounter(
            "gpuserve_inference_rows",
            "Batch rows (inferences) of successful requests.",
            _MV,
            r,
        )
        self.batches = LoopCounter(
            "gpuserve_batches", "Batches executed by the model's instances.", _MV, r
        )
        lane = (*_MV, "lane")
        self.lane_requests = LoopCounter(
            "gpuserve_lane_requests", "Requests finished, by lane (interactive, bulk).", lane, r
        )
        self.lane_rows = LoopCounter(
            "gpuserve_lane_rows", "Rows of the successful requests, by lane.", lane, r
        )
        self.lane_queue = LoopCounter(
            "gpuserve_lane_queue_seconds",
            "Seconds the finished requests waited in the queue, summed, by lane.",
            lane,
            r,
        )
        self.request_duration = LoopHistogram(
            "gpuserve_request_duration_seconds",
            "Successful requests: from admission into the model's queue until the result "
            "is ready (queue + compute; protocol decode/encode is in x-total-time-us).",
            _MV,
            LATENCY_BUCKETS_S,
            r,
        )
        self.queue_duration = LoopHistogram(
            "gpuserve_queue_duration_seconds",
            "Successful requests: time from admission until their batch started.",
            _MV,
            LATENCY_BUCKETS_S,
            r,
        )
        self.compute_duration = LoopHistogram(
            "gpuserve_compute_duration_seconds",
            "Per executed batch: time of each stage (preprocess, forward, postprocess).",
            (*_MV, "stage"),
            LATENCY_BUCKETS_S,
            r,
        )
        self.batch_size = LoopHistogram(
            "gpuserve_batch_size",
            "Rows per executed batch.",
            _MV,
            BATCH_SIZE_BUCKETS,
            r,
        )
        self.batch_tokens = LoopHistogram(
            "gpuserve_batch_tokens",
            "Real tokens per executed batch, for models whose requests carry a cost (text "
            "models: tokens after truncation).",
            _MV,
            BATCH_TOKEN_BUCKETS,
            r,
        )
        self.padding_ratio = LoopHistogram(
            "gpuserve_batch_padding_ratio",
            "Padded tokens (rows x longest row) / real tokens per executed batch, for models "
            "whose requests carry a cost; 1 means no padding.",
            _MV,
            PADDING_RATIO_BUCKETS,
            r,
        )
        Gauge(
            "gpuserve_build_info", "gpuserve version (value is always 1).", ["version"], registry=r
        ).labels(gpuserve.__version__).set(1)
        self._series: dict[tuple[str, str], _VersionSeries] = {}
        self.residency = ResidencySeries(r)
        if manager is not None:
            r.register(SchedulerCollector(lambda: _schedulers(manager)))
            r.register(ResidentCollector(manager))
            r.register(TritonModelCollector(lambda: _schedulers(manager)))
        self.gpu: NvmlCollector | None = None
        if gpu:
            self.gpu = NvmlCollector(nvml)
            r.register(self.gpu)
            r.register(TritonGpuCollector(self.gpu))
        if process:
            ProcessCollector(registry=r)
            r.register(CpuCollector())

    # -- subscription ----------------------------------------------------------------------

    def watch(self, scheduler: VersionRunner) -> None:
        """Subscribe to the stats events of ``scheduler`` (idempotent) and create its
        series at zero, so a version shows in ``/metrics`` as soon as it is loaded."""
        if self.on_event in scheduler.stats.listeners:
            return
        self._version_series(scheduler.name, scheduler.version)
        scheduler.stats.listeners.append(self.on_event)

    def watch_version(self, model_version: Any) -> None:
        """:class:`~gpuserve.repository.manager.ModelManager` hook: a version was loaded."""
        if model_version.runner is not None:
            self.watch(model_version.runner)

    def version_stopped(self, model_version: Any, runner: VersionRunner) -> None:
        """:class:`~gpuserve.repository.manager.ModelManager` hook: ``runner``, the runner of
        ``model_version``, stopped (the version unloaded, was replaced, or loaded for a
        change that did not happen). Its events stop counting; its series stay while the
        model is in the repository, so a version unloaded and loaded again counts on from
        where it was (they leave with the model: :meth:`model_removed`)."""
        if self.on_event in runner.stats.listeners:
            runner.stats.listeners.remove(self.on_event)

    def model_removed(self, name: str) -> None:
        """:class:`~gpuserve.repository.manager.ModelManager` hook: model ``name`` left the
        repository. Every series labelled with it leaves ``/metrics`` (its load on demand
        and eviction counters, and those of its versions and of requests that named no
        loaded version)."""
        self.forget(name)
        for family in self.residency.families():
            family.remove(name)

    def forget(self, model: str, version: str | None = None) -> None:
        """Drop the request and batch series of ``model`` (of one ``version`` only, when
        given): they leave the exposition, and counting starts from zero if it comes back.
        A model or version that is not loaded keeps no series, so ``/metrics`` stays bounded
        by what the repository holds, however many names and versions come and go."""
        prefix = (model,) if version is None else (model, version)
        for key in [k for k in self._series if k[: len(prefix)] == prefix]:
            del self._series[key]
        for family in self._families():
            family.remove(*prefix)

    def _families(self) -> tuple[LoopCounter | LoopHistogram, ...]:
        """The families labelled ``model`` and ``version`` first."""
        return (
            self.requests,
            self.rows,
            self.batches,
            self.lane_requests,
            self.lane_rows,
            self.lane_queue,
            self.request_duration,
            self.queue_duration,
            self.compute_duration,
            self.batch_size,
            self.batch_tokens,
            self.padding_ratio,
        )

    def on_residency(self, event: ResidencyEvent) -> None:
        """:class:`~gpuserve.repository.ondemand.loader.OnDemand` hook: a model loaded on demand or
        was evicted."""
        self.residency.on_event(event)

    def _version_series(self, model: str, version: str) -> _VersionSeries:
        key = (model, version)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _VersionSeries(self, model, version)
        return series

    # -- events ----------------------------------------------------------------------------

    def on_event(self, event: BatchStats | RequestStats) -> None:
        """Stats listener: count one finished request or one executed batch."""
        series = self._version_series(event.model, event.version)
        if isinstance(event, RequestStats):
            requests, rows, queued = series.lanes[event.lane]
            requests.inc()
            queued.inc(event.queue_s)
            if event.reason is None:
                series.success.inc()
                series.rows.inc(event.rows)
                rows.inc(event.rows)
                series.request.observe(event.total_s)
                series.queue.observe(event.queue_s)
            else:
                series.failure(event.model, event.version, event.reason).inc()
            return
        series.batches.inc()
        series.batch_size.observe(event.batch_size)
        if event.tokens:
            series.batch_tokens.observe(event.tokens)
            series.padding.observe(event.padded_tokens / event.tokens)
        pre, fwd, post = series.stages
        pre.observe(event.preprocess_s)
        fwd.observe(event.forward_s)
        post.observe(event.postprocess_s)

    def record_unrouted(self, model: str, version: str | None, reason: str) -> None:
        """Count a request that failed before it reached a model version's scheduler
        (unknown model or version, model not ready, body too large, bad path).

        Args:
            model: The model name the client asked for.
            version: The version it asked for, or None for the default one.
            reason: The error's ``reason``.
        """
        model_label, version_label = self.labels_for(model, version)
        series = self._series.get((model_label, version_label))
        if series is not None:
            series.failure(model_label, version_label, reason).inc()
        else:  # rare, and no histogram series are wanted for it
            self.requests.labels(model_label, version_label, "failure", reason).inc()

    def labels_for(self, model: str, version: str | None) -> tuple[str, str]:
        """Bounded ``(model, version)`` label values for a name and version a client sent."""
        known = self.manager.models.get(model) if self.manager is not None else None
        if known is None:
            return UNKNOWN, UNKNOWN
        if version and version.isascii() and version.isdigit() and int(version) in known.versions:
            return model, str(int(version))
        return model, UNKNOWN

    def close(self) -> None:
        """Release NVML."""
        if self.gpu is not None:
            self.gpu.close()


def _schedulers(manager: ModelManager) -> Iterable[VersionRunner]:
    # list() copies in one step under the GIL: a scrape from the metrics-port thread must not
    # iterate dicts that the event loop may be changing (a version loading or unloading).
    for model in list(manager.models.values()):
        for mv in list(model.versions.values()):
            if mv.runner is not None:
                yield mv.runner
