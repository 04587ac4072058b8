"""ServerMetrics from engine stats events, without sockets: exact series values, BC-20
(failures never count as successes), bounded labels, and the scrape-time queue gauges."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuserve.engine.stats import BatchStats, ModelStats, RequestStats
from gpuserve.metrics import UNKNOWN, ServerMetrics, render
from gpuserve.metrics.series import KNOWN_REASONS


def samples(metrics: ServerMetrics) -> dict[tuple[str, frozenset], float]:
    body, _ = render(metrics.registry)
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def get(metrics: ServerMetrics, name: str, **labels: str) -> float | None:
    return samples(metrics).get((name, frozenset(labels.items())))


def fake_scheduler(name: str = "m", version: str = "1", queued: int = 0, in_flight: int = 0):
    return SimpleNamespace(
        name=name,
        version=version,
        stats=ModelStats(name, version),
        queued=queued,
        in_flight_requests=in_flight,
        lane_queued=lambda: (queued, 0),
    )


def fake_manager(*schedulers) -> SimpleNamespace:
    models: dict[str, SimpleNamespace] = {}
    for s in schedulers:
        model = models.setdefault(s.name, SimpleNamespace(versions={}))
        model.versions[int(s.version)] = SimpleNamespace(runner=s)
    return SimpleNamespace(models=models)


@pytest.fixture()
def metrics() -> ServerMetrics:
    return ServerMetrics(gpu=False, process=False)


def test_watch_creates_every_series_at_zero(metrics):
    scheduler = fake_scheduler()
    metrics.watch(scheduler)
    metrics.watch(scheduler)  # idempotent: one listener
    assert scheduler.stats.listeners == [metrics.on_event]
    mv = {"model": "m", "version": "1"}
    assert get(metrics, "gpuserve_requests_total", outcome="success", reason="", **mv) == 0
    for reason in KNOWN_REASONS:
        labels = {"outcome": "failure", "reason": reason, **mv}
        assert get(metrics, "gpuserve_requests_total", **labels) == 0
    assert get(metrics, "gpuserve_request_duration_seconds_count", **mv) == 0
    assert get(metrics, "gpuserve_batch_size_count", **mv) == 0


def test_stats_events_become_exact_series(metrics):
    scheduler = fake_scheduler()
    metrics.watch(scheduler)
    stats = scheduler.stats
    for rows in (1, 2, 3):
        stats.record_request(RequestStats("m", "1", rows, 0.010, 0.002, 0.0125, None))
    stats.record_request(RequestStats("m", "1", 4, 0.0, 0.0, 0.0, "invalid"))
    stats.record_request(RequestStats("m", "1", 2, 0.3, 0.0, 0.3, "timeout"))
    stats.record_request(RequestStats("m", "1", 1, 0.001, 0.004, 0.006, "backend_error"))
    stats.record_request(RequestStats("m", "1", 1, 0.0, 0.0, 0.0, "brand_new_reason"))
    stats.record_batch(BatchStats("m", "1", 6, 3, 0.001, 0.002, 0.0005, True))
    stats.record_batch(BatchStats("m", "1", 5, 2, 0.001, 0.040, 0.0005, False))
    mv = {"model": "m", "version": "1"}

    def failures(reason: str) -> float | None:
        labels = {"outcome": "failure", "reason": reason, **mv}
        return get(metrics, "gpuserve_requests_total", **labels)

    assert get(metrics, "gpuserve_requests_total", outcome="success", reason="", **mv) == 3
    assert failures("invalid") == failures("timeout") == failures("backend_error") == 1
    assert failures("brand_new_reason") == 1
    assert failures("rejected") == 0
    # Rows and latency histograms count successes only (BC-20: a failure is never a success).
    assert get(metrics, "gpuserve_inference_rows_total", **mv) == 6
    assert get(metrics, "gpuserve_request_duration_seconds_count", **mv) == 3
    assert get(metrics, "gpuserve_request_duration_seconds_sum", **mv) == pytest.approx(0.0375)
    assert get(metrics, "gpuserve_request_duration_seconds_bucket", le="0.01", **mv) == 0
    assert get(metrics, "gpuserve_request_duration_seconds_bucket", le="0.02", **mv) == 3
    assert get(metrics, "gpuserve_queue_duration_seconds_sum", **mv) == pytest.approx(0.03)
    # Batches, their sizes and their stages.
    assert get(metrics, "gpuserve_batches_total", **mv) == 2
    assert get(metrics, "gpuserve_batch_size_sum", **mv) == 11
    assert get(metrics, "gpuserve_batch_size_bucket", le="4.0", **mv) == 0
    assert get(metrics, "gpuserve_batch_size_bucket", le="8.0", **mv) == 2
    forward = {"stage": "forward", **mv}
    assert get(metrics, "gpuserve_compute_duration_seconds_count", **forward) == 2
    assert get(metrics, "gpuserve_compute_duration_seconds_bucket", le="0.03", **forward) == 1
    for stage in ("preprocess", "postprocess"):
        labels = {"stage": stage, **mv}
        assert get(metrics, "gpuserve_compute_duration_seconds_sum", **labels) > 0


def test_counters_survive_a_reload_of_the_same_version(metrics):
    first = fake_scheduler()
    metrics.watch(first)
    first.stats.record_request(RequestStats("m", "1", 1, 0.0, 0.0, 0.001, None))
    second = fake_scheduler()  # the version unloaded and loaded again: fresh ModelStats
    metrics.watch(second)
    second.stats.record_request(RequestStats("m", "1", 1, 0.0, 0.0, 0.001, None))
    mv = {"model": "m", "version": "1"}
    assert get(metrics, "gpuserve_requests_total", outcome="success", reason="", **mv) == 2


def test_unrouted_failures_use_bounded_labels():
    known = fake_scheduler("known", "3")
    metrics = ServerMetrics(fake_manager(known), gpu=False, process=False)
    metrics.watch(known)
    metrics.record_unrouted("nobody_has_this", None, "not_found")
    metrics.record_unrouted("nobody_has_this_either", "2", "not_found")
    metrics.record_unrouted("known", "99", "not_found")
    metrics.record_unrouted("known", "abc", "not_found")
    metrics.record_unrouted("known", None, "not_ready")
    metrics.record_unrouted("known", "3", "not_ready")
    failure = {"outcome": "failure"}
    unknown = {"model": UNKNOWN, "version": UNKNOWN, **failure}
    assert get(metrics, "gpuserve_requests_total", reason="not_found", **unknown) == 2
    known_unknown = {"model": "known", "version": UNKNOWN, **failure}
    assert get(metrics, "gpuserve_requests_total", reason="not_found", **known_unknown) == 2
    assert get(metrics, "gpuserve_requests_total", reason="not_ready", **known_unknown) == 1
    exact = {"model": "known", "version": "3", **failure}
    assert get(metrics, "gpuserve_requests_total", reason="not_ready", **exact) == 1
    text = render(metrics.registry)[0].decode()
    assert "nobody_has_this" not in text
    # No histograms for label sets that are not loaded versions.
    assert 'gpuserve_request_duration_seconds_count{model="_unknown"' not in text


def test_queue_gauges_are_read_at_scrape_time():
    busy = fake_scheduler("busy", "1", queued=3, in_flight=5)
    idle = fake_scheduler("idle", "2")
    manager = fake_manager(busy, idle)
    metrics = ServerMetrics(manager, gpu=False, process=False)
    assert get(metrics, "gpuserve_queue_depth", model="busy", version="1") == 3
    assert get(metrics, "gpuserve_inflight_requests", model="busy", version="1") == 5
    assert get(metrics, "gpuserve_queue_depth", model="idle", version="2") == 0
    busy.queued = 0
    busy.in_flight_requests = 0
    assert get(metrics, "gpuserve_queue_depth", model="busy", version="1") == 0
    assert get(metrics, "gpuserve_inflight_requests", model="busy", version="1") == 0
    del manager.models["idle"]  # unloaded: its gauges go
    assert get(metrics, "gpuserve_queue_depth", model="idle", version="2") is None


def test_process_series_and_exposition_formats():
    metrics = ServerMetrics(gpu=False)
    body, content_type = render(metrics.registry)
    assert content_type.startswith("text/plain")
    text = body.decode()
    assert "process_cpu_seconds_total" in text
    assert "process_resident_memory_bytes" in text
    assert 'gpuserve_build_info{version="' in text
    assert "_created" not in text
    body, content_type = render(metrics.registry, "application/openmetrics-text")
    assert content_type.startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")


REPO = Path(__file__).resolve().parents[2]


def exposed_names() -> set[str]:
    from tests.unit.test_metrics_gpu import FakeNvml

    scheduler = fake_scheduler("m", "1", queued=1, in_flight=1)
    metrics = ServerMetrics(fake_manager(scheduler), nvml=FakeNvml())
    metrics.watch(scheduler)
    text = render(metrics.registry)[0].decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}


def test_dashboard_and_autoscaler_only_query_series_that_exist():
    names = exposed_names()
    sources = [REPO / "deploy/grafana/dashboards/gpuserve.json"]
    sources += [p for p in [REPO / "deploy/k8s/prometheus-adapter/rules.yaml"] if p.exists()]
    dashboard = json.loads(sources[0].read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    text = "\n".join(exprs) + "\n".join(p.read_text() for p in sources[1:])
    used = set(re.findall(r"\b(?:gpuserve|process)_[a-z_]+\b", text))
    used -= {"gpuserve_queue_duration_seconds_avg", "gpuserve_requests_per_second"}  # adapter
    assert used, "no series found in the dashboard"
    assert sorted(used - names) == []
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("throughput", "p99", "queue", "batch", "errors", "gpu utilisation", "memory"):
        assert topic in titles


def test_prometheus_scrapes_the_metrics_port():
    config = (REPO / "deploy/prometheus/prometheus.yml").read_text()
    assert '"gpuserve:8002"' in config and "metrics_path: /metrics" in config
