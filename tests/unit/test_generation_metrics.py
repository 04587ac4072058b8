"""Generation series from fake generative runners holding GenerationStats (no model): counters
and gauges summed over engines, histograms kept across scrapes (each drained sample counted
once), series gone with their version, vLLM's names."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse
from prometheus_client.parser import text_string_to_metric_families

from gpuserve.engine.generate.stats import GenerationStats
from gpuserve.metrics import ServerMetrics, render
from gpuserve.metrics.generation import GenerationCollector
from gpuserve.metrics.responses import ResponseCollector
from gpuserve.metrics.sequences import SequenceCollector


class FakeGenerateRunner:
    """What the collector reads of a GenerateRunner."""

    kind = "generate"

    def __init__(self, name: str, version: str, engines: int = 1) -> None:
        self.name = name
        self.version = version
        self.engines = [GenerationStats(kv_blocks=100, block_size=16) for _ in range(engines)]

    @property
    def stats_of_engines(self) -> list[GenerationStats]:
        return list(self.engines)


class FakeBatchingRunner:
    kind = "batching"

    def __init__(self, name: str, version: str) -> None:
        self.name = name
        self.version = version


def registry_of(runners: list[Any]) -> tuple[CollectorRegistry, GenerationCollector]:
    collector = GenerationCollector(lambda: list(runners))
    registry = CollectorRegistry()
    registry.register(collector)
    return registry, collector


def scrape(registry: CollectorRegistry) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """One scrape through the server's encoder, parsed back: (sample, labels) -> value."""
    body, _ = render(registry)
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def mv(model: str = "llm", version: str = "1", **more: str) -> frozenset[tuple[str, str]]:
    return frozenset({"model": model, "version": version, **more}.items())


def test_counters_and_gauges_sum_over_engines() -> None:
    runner = FakeGenerateRunner("llm", "1", engines=2)
    a, b = runner.engines
    a.prompt_tokens, b.prompt_tokens = 100, 50
    a.generation_tokens, b.generation_tokens = 30, 12
    a.prefix_query_tokens, b.prefix_query_tokens = 80, 40
    a.prefix_hit_tokens, b.prefix_hit_tokens = 32, 16
    a.preemptions, b.preemptions = 1, 2
    a.steps, b.steps = 40, 20
    a.finished = {"stop": 3, "length": 1}
    b.finished = {"stop": 2, "abort": 1}
    a.running, b.running = 4, 3
    a.waiting, b.waiting = 2, 0
    a.kv_usage, b.kv_usage = 0.5, 0.25
    b.kv_blocks = 300  # engines of unequal caches: usage is held blocks over blocks
    registry, _ = registry_of([runner])
    got = scrape(registry)
    assert got[("gpuserve_generation_prompt_tokens_total", mv())] == 150
    assert got[("gpuserve_generation_tokens_total", mv())] == 42
    assert got[("gpuserve_generation_prefix_cache_queries_total", mv())] == 120
    assert got[("gpuserve_generation_prefix_cache_hits_total", mv())] == 48
    assert got[("gpuserve_generation_preemptions_total", mv())] == 3
    assert got[("gpuserve_generation_steps_total", mv())] == 60
    finished = "gpuserve_generation_requests_finished_total"
    assert got[(finished, mv(reason="stop"))] == 5
    assert got[(finished, mv(reason="length"))] == 1
    assert got[(finished, mv(reason="abort"))] == 1
    assert got[(finished, mv(reason="timeout"))] == 0  # every reason exists from load
    assert got[(finished, mv(reason="error"))] == 0
    assert got[("gpuserve_generation_running", mv())] == 7
    assert got[("gpuserve_generation_waiting", mv())] == 2
    assert got[("gpuserve_generation_kv_cache_blocks", mv())] == 400
    assert got[("gpuserve_generation_kv_cache_usage", mv())] == pytest.approx(
        (0.5 * 100 + 0.25 * 300) / 400
    )


def test_histograms_accumulate_across_scrapes_and_count_each_sample_once() -> None:
    runner = FakeGenerateRunner("llm", "1", engines=2)
    a, b = runner.engines
    a.ttft_s += [0.001, 0.05]  # 0.001 lies in its own bound's bucket (le)
    b.ttft_s += [20.0]  # above every bound: +Inf only
    a.itl_s += [0.02, 0.02, 0.02]
    a.e2e_s += [1.2]
    a.prompt_lengths += [5]
    a.output_lengths += [8192]
    registry, _ = registry_of([runner])
    ttft = "gpuserve_generation_time_to_first_token_seconds"

    first = scrape(registry)
    assert a.ttft_s == [] and b.ttft_s == []  # drained
    assert first[(f"{ttft}_bucket", mv(le="0.001"))] == 1
    assert first[(f"{ttft}_bucket", mv(le="0.06"))] == 2
    assert first[(f"{ttft}_bucket", mv(le="10.0"))] == 2
    assert first[(f"{ttft}_bucket", mv(le="+Inf"))] == 3
    assert first[(f"{ttft}_count", mv())] == 3
    assert first[(f"{ttft}_sum", mv())] == pytest.approx(20.051)
    itl = "gpuserve_generation_inter_token_latency_seconds"
    assert first[(f"{itl}_bucket", mv(le="0.01"))] == 0
    assert first[(f"{itl}_bucket", mv(le="0.025"))] == 3
    e2e = "gpuserve_generation_e2e_latency_seconds"
    assert first[(f"{e2e}_bucket", mv(le="1.0"))] == 0
    assert first[(f"{e2e}_bucket", mv(le="1.5"))] == 1
    prompt = "gpuserve_generation_prompt_length_tokens"
    assert first[(f"{prompt}_bucket", mv(le="4.0"))] == 0
    assert first[(f"{prompt}_bucket", mv(le="8.0"))] == 1
    output = "gpuserve_generation_output_length_tokens"
    assert first[(f"{output}_bucket", mv(le="4096.0"))] == 0
    assert first[(f"{output}_bucket", mv(le="8192.0"))] == 1

    assert scrape(registry) == first  # nothing new: the same cumulative values

    b.ttft_s += [0.003]
    third = scrape(registry)
    assert third[(f"{ttft}_bucket", mv(le="0.001"))] == 1
    assert third[(f"{ttft}_bucket", mv(le="0.005"))] == 2
    assert third[(f"{ttft}_bucket", mv(le="+Inf"))] == 4
    assert third[(f"{ttft}_count", mv())] == 4
    assert third[(f"{ttft}_sum", mv())] == pytest.approx(20.054)
    assert third[(f"{itl}_count", mv())] == 3  # the others keep their counts


def test_versions_that_are_not_generative_are_skipped() -> None:
    registry, _ = registry_of([FakeBatchingRunner("bert", "1"), FakeGenerateRunner("llm", "2")])
    got = scrape(registry)
    models = {dict(labels).get("model") for _, labels in got} - {None}
    assert models == {"llm"}
    assert ("gpuserve_generation_running", mv(version="2")) in got


def test_series_leave_with_their_version_and_restart_on_reload() -> None:
    old = FakeGenerateRunner("llm", "1")
    other = FakeGenerateRunner("llm", "2")
    runners: list[Any] = [old, other]
    registry, collector = registry_of(runners)
    old.engines[0].ttft_s += [0.1, 0.2]
    old.engines[0].prompt_tokens = 7
    ttft_count = "gpuserve_generation_time_to_first_token_seconds_count"
    assert scrape(registry)[(ttft_count, mv())] == 2

    runners.remove(old)
    got = scrape(registry)
    assert not any(dict(labels).get("version") == "1" for _, labels in got)
    assert ("gpuserve_generation_running", mv(version="2")) in got
    assert set(collector._versions) == {("llm", "2")}  # its accumulators went too

    runners.append(FakeGenerateRunner("llm", "1"))  # loaded again: from 0
    got = scrape(registry)
    assert got[(ttft_count, mv())] == 0
    assert got[("gpuserve_generation_prompt_tokens_total", mv())] == 0

    runners.clear()
    assert scrape(registry) == {}
    assert collector._versions == {}


def test_a_reload_between_scrapes_restarts_the_histograms() -> None:
    runners: list[Any] = [FakeGenerateRunner("llm", "1")]
    registry, _ = registry_of(runners)
    runners[0].engines[0].e2e_s += [3.0]
    e2e_count = "gpuserve_generation_e2e_latency_seconds_count"
    assert scrape(registry)[(e2e_count, mv())] == 1
    runners[0] = FakeGenerateRunner("llm", "1")  # unloaded and loaded again, unseen
    runners[0].engines[0].e2e_s += [4.0]
    got = scrape(registry)
    assert got[(e2e_count, mv())] == 1
    assert got[("gpuserve_generation_e2e_latency_seconds_sum", mv())] == 4.0


def test_vllm_names_sum_each_model_over_its_versions() -> None:
    v1 = FakeGenerateRunner("llm", "1")
    v2 = FakeGenerateRunner("llm", "2", engines=2)
    small = FakeGenerateRunner("tiny", "1")
    for s, running, waiting, usage, prompt, generated in (
        (v1.engines[0], 2, 1, 0.5, 10, 4),
        (v2.engines[0], 3, 0, 0.25, 20, 6),
        (v2.engines[1], 1, 4, 0.0, 30, 8),
        (small.engines[0], 5, 5, 1.0, 1, 1),
    ):
        s.running, s.waiting, s.kv_usage = running, waiting, usage
        s.prompt_tokens, s.generation_tokens = prompt, generated
    registry, _ = registry_of([v1, v2, small])
    got = scrape(registry)
    llm = frozenset({("model_name", "llm")})
    assert got[("vllm:num_requests_running", llm)] == 6
    assert got[("vllm:num_requests_waiting", llm)] == 5
    assert got[("vllm:kv_cache_usage_perc", llm)] == pytest.approx(0.75 / 3)
    assert got[("vllm:prompt_tokens_total", llm)] == 60
    assert got[("vllm:generation_tokens_total", llm)] == 18
    tiny = frozenset({("model_name", "tiny")})
    assert got[("vllm:num_requests_running", tiny)] == 5
    assert got[("vllm:kv_cache_usage_perc", tiny)] == 1.0
    text = render(registry)[0].decode()
    assert "# TYPE vllm:num_requests_running gauge" in text
    assert "# TYPE vllm:prompt_tokens_total counter" in text
    assert 'vllm:generation_tokens_total{model_name="llm"} 18.0' in text


def test_openmetrics_exposition_parses() -> None:
    runner = FakeGenerateRunner("llm", "1")
    runner.engines[0].ttft_s += [0.5]
    runner.engines[0].finished = {"stop": 1}
    registry, _ = registry_of([runner])
    body, content_type = render(registry, "application/openmetrics-text")
    assert content_type.startswith("application/openmetrics-text")
    names = {family.name for family in om_parse(body.decode())}
    assert {
        "gpuserve_generation_time_to_first_token_seconds",
        "gpuserve_generation_requests_finished",
        "vllm:num_requests_running",
        "vllm:prompt_tokens",
    } <= names


def test_no_name_clashes_with_the_server_registry() -> None:
    metrics = ServerMetrics(gpu=False, process=False)

    def runners() -> list[Any]:
        return [FakeGenerateRunner("llm", "1")]

    metrics.registry.register(SequenceCollector(list))
    metrics.registry.register(ResponseCollector(list))
    metrics.registry.register(GenerationCollector(runners))  # raises on a duplicate name
    try:
        assert "gpuserve_generation_running" in render(metrics.registry)[0].decode()
    finally:
        metrics.close()
