"""Generation series, read from the generative versions' engines at scrape time.

For every loaded version of a generative model (runner kind ``generate``), labels ``model``
and ``version``, summed over the version's engines (one per instance):

* counters ``gpuserve_generation_prompt_tokens_total``, ``gpuserve_generation_tokens_total``
  (generated), ``gpuserve_generation_prefix_cache_queries_total`` and
  ``gpuserve_generation_prefix_cache_hits_total`` (prompt tokens looked up in the prefix cache,
  and found), ``gpuserve_generation_preemptions_total``,
  ``gpuserve_generation_requests_finished_total`` (label ``reason``),
  ``gpuserve_generation_steps_total``;
* gauges ``gpuserve_generation_running``, ``gpuserve_generation_waiting``,
  ``gpuserve_generation_kv_cache_usage`` (0..1: blocks held over blocks, across the engines),
  ``gpuserve_generation_kv_cache_blocks`` and ``gpuserve_generation_kv_cache_empty_slots``
  (token slots in held blocks that hold no token);
* histograms ``gpuserve_generation_time_to_first_token_seconds``,
  ``gpuserve_generation_inter_token_latency_seconds``,
  ``gpuserve_generation_e2e_latency_seconds``, ``gpuserve_generation_prompt_length_tokens``
  and ``gpuserve_generation_output_length_tokens`` (bucket bounds like vLLM's).

vLLM's names, for gateways and dashboards written for vLLM, label ``model_name`` (summed over
the model's loaded versions): gauges ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (0..1, as vLLM's) and counters
``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``.

The engine thread writes :class:`~gpuserve.engine.generate.stats.GenerationStats`; counters
and gauges are read as they are. Latency samples are *drained* (each handed out once), so
this collector keeps each version's histograms itself: every scrape drains the engines into
them and writes the cumulative buckets. A version's series, its histograms included, go when
it unloads, and start again from 0 when it loads again.
"""

from __future__ import annotations

import threading
import weakref
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from gpuserve.engine.generate.stats import GenerationStats, LatencySamples

_MV = ("model", "version")
_MODEL_NAME = ("model_name",)

#: Reasons a sequence ends (the engine's); each is written from load, 0 until it happens.
FINISH_REASONS = ("stop", "length", "abort", "timeout", "error")

#: Bucket upper bounds, as vLLM's (``vllm/engine/metrics.py``), cut where noted.
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
ITL_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
E2E_BUCKETS_S = (
    0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 300.0,
)  # fmt: skip
#: Token counts: powers of two, 1 to 8192.
LENGTH_BUCKETS_TOKENS = tuple(float(2**i) for i in range(14))


@dataclass(frozen=True, slots=True)
class _HistogramSpec:
    name: str
    documentation: str
    bounds: tuple[float, ...]
    samples: Callable[[LatencySamples], Sequence[float]]


_HISTOGRAMS = (
    _HistogramSpec(
        "gpuserve_generation_time_to_first_token_seconds",
        "Generative models: time from a sequence's admission to its first generated token.",
        TTFT_BUCKETS_S,
        lambda s: s.ttft_s,
    ),
    _HistogramSpec(
        "gpuserve_generation_inter_token_latency_seconds",
        "Generative models: time between consecutive generated tokens of a sequence.",
        ITL_BUCKETS_S,
        lambda s: s.itl_s,
    ),
    _HistogramSpec(
        "gpuserve_generation_e2e_latency_seconds",
        "Generative models: time from a sequence's admission to its end (finished sequences).",
        E2E_BUCKETS_S,
        lambda s: s.e2e_s,
    ),
    _HistogramSpec(
        "gpuserve_generation_prompt_length_tokens",
        "Generative models: prompt tokens of finished sequences.",
        LENGTH_BUCKETS_TOKENS,
        lambda s: s.prompt_lengths,
    ),
    _HistogramSpec(
        "gpuserve_generation_output_length_tokens",
        "Generative models: generated tokens of finished sequences.",
        LENGTH_BUCKETS_TOKENS,
        lambda s: s.output_lengths,
    ),
)

#: (name, help, the value of one engine) of the counters summed over engines.
_COUNTERS: tuple[tuple[str, str, Callable[[GenerationStats], int]], ...] = (
    (
        "gpuserve_generation_prompt_tokens",
        "Generative models: prompt tokens.",
        lambda s: s.prompt_tokens,
    ),
    (
        "gpuserve_generation_tokens",
        "Generative models: tokens generated.",
        lambda s: s.generation_tokens,
    ),
    (
        "gpuserve_generation_prefix_cache_queries",
        "Generative models: prompt tokens looked up in the prefix cache.",
        lambda s: s.prefix_query_tokens,
    ),
    (
        "gpuserve_generation_prefix_cache_hits",
        "Generative models: prompt tokens found in the prefix cache (their KV reused).",
        lambda s: s.prefix_hit_tokens,
    ),
    (
        "gpuserve_generation_preemptions",
        "Generative models: sequences preempted (KV freed, recomputed later).",
        lambda s: s.preemptions,
    ),
    ("gpuserve_generation_steps", "Generative models: engine steps run.", lambda s: s.steps),
)


class _Histogram:
    """Cumulative buckets, sum and count of one series (what a drained sample adds)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf only)
        self.sum = 0.0

    def observe(self, values: Iterable[float]) -> None:
        for value in values:
            self.counts[bisect_left(self.bounds, value)] += 1  # le: value <= bound
            self.sum += value

    def buckets(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        cumulative = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            cumulative += count
            out.append((repr(float(bound)), cumulative))
        out.append(("+Inf", cumulative + self.counts[-1]))
        return out


class _Version:
    """What the collector keeps of one version: its histograms, and which runner fed them
    (weakly: an unloaded runner holds its model's weights)."""

    def __init__(self, runner: Any) -> None:
        self.runner = weakref.ref(runner)
        self.histograms = [_Histogram(spec.bounds) for spec in _HISTOGRAMS]


def _kv_usage(engines: Sequence[GenerationStats]) -> float:
    """Blocks held over blocks across ``engines`` (0..1); the plain mean where no engine
    reports its block count."""
    blocks = sum(s.kv_blocks for s in engines)
    if blocks > 0:
        return sum(s.kv_usage * s.kv_blocks for s in engines) / blocks
    return sum(s.kv_usage for s in engines) / len(engines) if engines else 0.0


class GenerationCollector(Collector):
    """The series of the module docstring.

    Args:
        runners: Returns the runners of the loaded versions (called per scrape); those whose
            ``kind`` is not ``"generate"`` are skipped.
    """

    def __init__(self, runners: Callable[[], Iterable[Any]]) -> None:
        self.runners = runners
        self._versions: dict[tuple[str, str], _Version] = {}
        # The HTTP port and the metrics port may scrape at once; each drains, one at a time.
        self._lock = threading.Lock()

    def describe(self) -> list[Metric]:
        return [
            *(CounterMetricFamily(name, "", labels=_MV) for name, _, _ in _COUNTERS),
            CounterMetricFamily(
                "gpuserve_generation_requests_finished", "", labels=(*_MV, "reason")
            ),
            GaugeMetricFamily("gpuserve_generation_running", "", labels=_MV),
            GaugeMetricFamily("gpuserve_generation_waiting", "", labels=_MV),
            GaugeMetricFamily("gpuserve_generation_kv_cache_usage", "", labels=_MV),
            GaugeMetricFamily("gpuserve_generation_kv_cache_blocks", "", labels=_MV),
            GaugeMetricFamily("gpuserve_generation_kv_cache_empty_slots", "", labels=_MV),
            *(HistogramMetricFamily(spec.name, "", labels=_MV) for spec in _HISTOGRAMS),
            GaugeMetricFamily("vllm:num_requests_running", "", labels=_MODEL_NAME),
            GaugeMetricFamily("vllm:num_requests_waiting", "", labels=_MODEL_NAME),
            GaugeMetricFamily("vllm:kv_cache_usage_perc", "", labels=_MODEL_NAME),
            CounterMetricFamily("vllm:prompt_tokens", "", labels=_MODEL_NAME),
            CounterMetricFamily("vllm:generation_tokens", "", labels=_MODEL_NAME),
        ]

    def collect(self) -> Iterator[Metric]:
        for _ in range(3):  # a version loading mid-scrape changes the dicts; try again
            try:
                rows = [
                    (r.name, r.version, r, list(r.stats_of_engines))
                    for r in self.runners()
                    if r.kind == "generate"
                ]
                break
            except RuntimeError:
                continue
        else:
            rows = []
        with self._lock:
            families = self._families(rows)
        yield from families

    def _families(self, rows: list[tuple[str, str, Any, list[GenerationStats]]]) -> list[Metric]:
        counters = [
            (CounterMetricFamily(name, doc, labels=_MV), value) for name, doc, value in _COUNTERS
        ]
        finished = CounterMetricFamily(
            "gpuserve_generation_requests_finished",
            "Generative models: sequences ended, by reason (stop, length, abort, timeout, error).",
            labels=(*_MV, "reason"),
        )
        running = GaugeMetricFamily(
            "gpuserve_generation_running",
            "Generative models: sequences in the running batch.",
            labels=_MV,
        )
        waiting = GaugeMetricFamily(
            "gpuserve_generation_waiting",
            "Generative models: sequences waiting for a slot.",
            labels=_MV,
        )
        kv_usage = GaugeMetricFamily(
            "gpuserve_generation_kv_cache_usage",
            "Generative models: fraction of KV cache blocks held by sequences, 0 to 1.",
            labels=_MV,
        )
        kv_blocks = GaugeMetricFamily(
            "gpuserve_generation_kv_cache_blocks",
            "Generative models: blocks of the KV cache.",
            labels=_MV,
        )
        kv_empty = GaugeMetricFamily(
            "gpuserve_generation_kv_cache_empty_slots",
            "Generative models: token slots in KV cache blocks held by sequences that hold no "
            "token.",
            labels=_MV,
        )
        histograms = [
            HistogramMetricFamily(spec.name, spec.documentation, labels=_MV) for spec in _HISTOGRAMS
        ]
        per_model: dict[str, list[GenerationStats]] = {}
        present: set[tuple[str, str]] = set()
        for name, version, runner, engines in rows:
            labels = (name, version)
            present.add(labels)
            per_model.setdefault(name, []).extend(engines)
            for family, value in counters:
                family.add_metric(labels, sum(value(s) for s in engines))
            reasons: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
            for s in engines:
                for reason, n in dict(s.finished).items():
                    reasons[reason] = reasons.get(reason, 0) + n
            for reason, n in reasons.items():
                finished.add_metric((*labels, reason), n)
            running.add_metric(labels, sum(s.running for s in engines))
            waiting.add_metric(labels, sum(s.waiting for s in engines))
            kv_usage.add_metric(labels, _kv_usage(engines))
            kv_blocks.add_metric(labels, sum(s.kv_blocks for s in engines))
            kv_empty.add_metric(labels, sum(s.kv_empty_slots for s in engines))
            kept = self._versions.get(labels)
            if kept is None or kept.runner() is not runner:  # new, or reloaded: from 0
                kept = self._versions[labels] = _Version(runner)
            for s in engines:
                samples = s.drain()
                for spec, histogram in zip(_HISTOGRAMS, kept.histograms, strict=True):
                    histogram.observe(spec.samples(samples))
            for histogram_family, histogram in zip(histograms, kept.histograms, strict=True):
                histogram_family.add_metric(labels, histogram.buckets(), histogram.sum)
        for gone in self._versions.keys() - present:
            del self._versions[gone]
        return [
            *(family for family, _ in counters),
            finished,
            running,
            waiting,
            kv_usage,
            kv_blocks,
            kv_empty,
            *histograms,
            *_vllm_families(per_model),
        ]


def _vllm_families(per_model: dict[str, list[GenerationStats]]) -> list[Metric]:
    """vLLM's names over each model's engines (all its loaded versions), label
    ``model_name``."""
    running = GaugeMetricFamily(
        "vllm:num_requests_running",
        "Requests in the running batch (vLLM's name; gpuserve_generation_running).",
        labels=_MODEL_NAME,
    )
    waiting = GaugeMetricFamily(
        "vllm:num_requests_waiting",
        "Requests waiting (vLLM's name; gpuserve_generation_waiting).",
        labels=_MODEL_NAME,
    )
    kv_usage = GaugeMetricFamily(
        "vllm:kv_cache_usage_perc",
        "KV cache usage, 0 to 1 (vLLM's name; gpuserve_generation_kv_cache_usage).",
        labels=_MODEL_NAME,
    )
    prompt = CounterMetricFamily(
        "vllm:prompt_tokens",
        "Prompt tokens (vLLM's name; gpuserve_generation_prompt_tokens_total).",
        labels=_MODEL_NAME,
    )
    generated = CounterMetricFamily(
        "vllm:generation_tokens",
        "Generated tokens (vLLM's name; gpuserve_generation_tokens_total).",
        labels=_MODEL_NAME,
    )
    for name, engines in per_model.items():
        labels = (name,)
        running.add_metric(labels, sum(s.running for s in engines))
        waiting.add_metric(labels, sum(s.waiting for s in engines))
        kv_usage.add_metric(labels, _kv_usage(engines))
        prompt.add_metric(labels, sum(s.prompt_tokens for s in engines))
        generated.add_metric(labels, sum(s.generation_tokens for s in engines))
    return [running, waiting, kv_usage, prompt, generated]


__all__ = ["GenerationCollector"]
