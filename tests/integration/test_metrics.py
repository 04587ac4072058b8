"""Prometheus metrics over real HTTP (issue 4 part 2, BC-20 of shared/cases/README.md).

One server on the fixture repository with its own metrics port. The main test sends 50 good
and 10 bad requests and checks the exact counter deltas by outcome and reason, that a failed
request is never counted as a success, and that the p99 read from the latency histogram's
buckets agrees with the latencies the clients measured.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import FIXTURE_REPOSITORY
from tests.helpers import InProcessServer

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

ROW = [float(v) for v in range(16)]


def good(rows: int) -> dict:
    return {
        "inputs": [{"name": "INPUT0", "shape": [rows, 16], "datatype": "FP32", "data": ROW * rows}]
    }


@pytest.fixture(scope="module")
def server():
    running = InProcessServer(FIXTURE_REPOSITORY, access_log=True)
    yield running
    running.stop()


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, timeout=30.0) as http:
        yield http


def scrape(url: str) -> Samples:
    response = httpx.get(url, timeout=10.0)
    assert response.status_code == 200, response.text
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def requests(samples: Samples, model: str, outcome: str, reason: str = "") -> float:
    return value(
        samples,
        "gpuserve_requests_total",
        model=model,
        version="1",
        outcome=outcome,
        reason=reason,
    )


def buckets(before: Samples, after: Samples, name: str, model: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count delta) of one histogram, by bound."""
    rows = []
    for (sample, labels), count in after.items():
        labels_dict = dict(labels)
        if sample == f"{name}_bucket" and labels_dict.get("model") == model:
            bound = float(labels_dict["le"])
            rows.append((bound, count - before.get((sample, labels), 0.0)))
    return sorted(rows)


def quantile_bucket(rows: list[tuple[float, float]], q: float) -> tuple[float, float, float]:
    """histogram_quantile: the bucket (lower, upper] holding rank q*count, and the linear
    estimate inside it."""
    total = rows[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, cumulative in rows:
        if cumulative >= rank:
            if math.isinf(upper):
                return lower, upper, lower
            inside = cumulative - below
            return lower, upper, lower + (upper - lower) * (rank - below) / inside
        lower, below = upper, cumulative
    raise AssertionError("no bucket holds the rank")


def nth(values: list[float], q: float) -> float:
    """The value of rank ceil(q*n): the one the histogram's q-bucket must hold."""
    ordered = sorted(values)
    return ordered[math.ceil(q * len(ordered)) - 1]


def test_exact_counter_deltas_and_p99_within_bucket_bounds(server, client):
    metrics_url = f"{server.url}/metrics"
    stats_before = client.get("/v2/models/double_fp32/stats").json()["model_stats"][0]
    before = scrape(metrics_url)

    # 50 good requests from 5 clients: rows 1 or 2 (75 rows in all).
    latencies: list[float] = []
    lower_bounds: list[float] = []  # queue + compute from the headers: <= the histogram's value
    upper_bounds: list[float] = []  # x-total-time-us: >= the histogram's value
    lock = threading.Lock()

    def run(worker: int) -> None:
        with httpx.Client(base_url=server.url, timeout=30.0) as http:
            for i in range(10):
                rows = 1 + (worker + i) % 2
                started = time.perf_counter()
                response = http.post("/v2/models/double_fp32/infer", json=good(rows))
                elapsed = time.perf_counter() - started
                assert response.status_code == 200, response.text
                h = response.headers
                with lock:
                    latencies.append(elapsed)
                    lower_bounds.append(
                        (int(h["x-queue-time-us"]) + int(h["x-compute-time-us"])) / 1e6
                    )
                    upper_bounds.append((int(h["x-total-time-us"]) + 1) / 1e6)

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        list(pool.map(run, range(5)))

    # 10 bad requests: 7 invalid (3 malformed JSON, 2 wrong datatype, 2 unknown input) to
    # double_fp32, and 3 that make marker_fail raise (backend errors).
    wrong_type = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32"}]}
    wrong_type["inputs"][0]["data"] = list(range(16))
    unknown_input = {"inputs": [{"name": "NOPE", "shape": [1, 16], "datatype": "FP32"}]}
    unknown_input["inputs"][0]["data"] = ROW
    bodies = [b'{"inputs": [', b"", b"[]"] + [json.dumps(wrong_type).encode()] * 2
    bodies += [json.dumps(unknown_input).encode()] * 2
    for body in bodies:
        response = client.post(
            "/v2/models/double_fp32/infer",
            content=body,
            headers={"content-type": "application/json"},
        )
        assert response.status_code == 400, response.text
    marker = {
        "inputs": [
            {"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [-999.0, *ROW[1:]]}
        ]
    }
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        failed = list(
            pool.map(lambda _: client.post("/v2/models/marker_fail/infer", json=marker), range(3))
        )
    assert [r.status_code for r in failed] == [500, 500, 500], [r.text for r in failed]

    after = scrape(metrics_url)
    stats_after = client.get("/v2/models/double_fp32/stats").json()["model_stats"][0]

    # Exact deltas by outcome and reason; a failure is never a success (BC-20).
    d = {
        (model, outcome, reason): requests(after, model, outcome, reason)
        - requests(before, model, outcome, reason)
        for model in ("double_fp32", "marker_fail")
        for outcome, reason in [("success", "")]
        + [("failure", r) for r in ("invalid", "backend_error", "rejected", "timeout")]
        + [("failure", r) for r in ("cancelled", "not_ready", "unavailable", "out_of_memory")]
    }
    expected = dict.fromkeys(d, 0.0)
    expected[("double_fp32", "success", "")] = 50
    expected[("double_fp32", "failure", "invalid")] = 7
    expected[("marker_fail", "failure", "backend_error")] = 3
    assert d == expected

    rows = {"model": "double_fp32", "version": "1"}
    assert delta(before, after, "gpuserve_inference_rows_total", **rows) == 75
    mf = {"model": "marker_fail", "version": "1"}
    assert delta(before, after, "gpuserve_inference_rows_total", **mf) == 0
    assert delta(before, after, "gpuserve_request_duration_seconds_count", **rows) == 50
    assert delta(before, after, "gpuserve_queue_duration_seconds_count", **rows) == 50
    assert delta(before, after, "gpuserve_request_duration_seconds_count", **mf) == 0

    # Batches: the counter, the batch-size histogram and each stage agree with the stats API;
    # every row of the good requests ran in exactly one batch.
    batches = delta(before, after, "gpuserve_batches_total", **rows)
    assert batches == stats_after["execution_count"] - stats_before["execution_count"] > 0
    assert delta(before, after, "gpuserve_batch_size_count", **rows) == batches
    assert delta(before, after, "gpuserve_batch_size_sum", **rows) == 75
    for stage in ("preprocess", "forward", "postprocess"):
        name = "gpuserve_compute_duration_seconds_count"
        assert delta(before, after, name, stage=stage, **rows) == batches

    # _sum agrees with the engine's statistics (same events, nanoseconds there).
    hist_sum = delta(before, after, "gpuserve_request_duration_seconds_sum", **rows)
    stats_sum = (
        stats_after["inference_stats"]["success"]["ns"]
        - stats_before["inference_stats"]["success"]["ns"]
    ) / 1e9
    assert hist_sum == pytest.approx(stats_sum, abs=1e-6 * 50)
    assert hist_sum <= sum(latencies)

    # p99 from the buckets. Per request: queue+compute <= histogram value <= x-total-time-us
    # <= client latency, so the value of the p99 rank lies between the same ranks of the
    # header bounds, and the bucket that histogram_quantile picks must admit them.
    hist = buckets(before, after, "gpuserve_request_duration_seconds", "double_fp32")
    assert hist[-1][1] == 50
    lower, upper, estimate = quantile_bucket(hist, 0.99)
    assert lower < estimate <= upper
    assert lower < nth(upper_bounds, 0.99), (lower, upper, sorted(upper_bounds)[-3:])
    assert nth(lower_bounds, 0.99) <= upper, (lower, upper, sorted(lower_bounds)[-3:])
    client_p99 = nth(latencies, 0.99)
    assert lower < client_p99, (lower, upper, client_p99)
    # p50 too: the same argument holds for any quantile.
    lower50, upper50, _ = quantile_bucket(hist, 0.5)
    assert lower50 < nth(upper_bounds, 0.5) and nth(lower_bounds, 0.5) <= upper50

    # Nothing is left queued or in flight once the load is over.
    for model in ("double_fp32", "marker_fail"):
        labels = {"model": model, "version": "1"}
        assert value(after, "gpuserve_queue_depth", **labels) == 0
        assert value(after, "gpuserve_inflight_requests", **labels) == 0


def test_requests_that_reach_no_model_are_counted_with_bounded_labels(server, client):
    url = f"{server.url}/metrics"
    before = scrape(url)
    for name in ("no_such_model_a", "no_such_model_b"):
        assert client.post(f"/v2/models/{name}/infer", json=good(1)).status_code == 404
    response = client.post("/v2/models/double_fp32/versions/7/infer", json=good(1))
    assert response.status_code == 404
    response = client.post("/v2/models/broken_model/infer", json=good(1))
    assert response.status_code == 503
    after = scrape(url)
    unknown = {"model": "_unknown", "version": "_unknown", "outcome": "failure"}
    assert delta(before, after, "gpuserve_requests_total", reason="not_found", **unknown) == 2
    assert not any("no_such_model" in str(labels) for (_, labels) in after), (
        "unknown names must not become label values"
    )
    known_model_unknown_version = {
        "model": "double_fp32",
        "version": "_unknown",
        "outcome": "failure",
        "reason": "not_found",
    }
    assert delta(before, after, "gpuserve_requests_total", **known_model_unknown_version) == 1
    broken = {"model": "broken_model", "version": "_unknown", "outcome": "failure"}
    assert delta(before, after, "gpuserve_requests_total", reason="not_ready", **broken) == 1


def test_queue_gauges_read_the_queue_under_load_and_return_to_zero(server):
    """slow_fp32 sleeps 0.5 s per batch of at most 8 rows: of 10 requests sent together,
    at least 2 wait in the queue while the first batch runs."""
    url = f"http://127.0.0.1:{server.server.metrics_server.port}/metrics"
    labels = {"model": "slow_fp32", "version": "1"}
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        futures = [
            pool.submit(httpx.post, f"{server.url}/v2/models/slow_fp32/infer", json=good(1))
            for _ in range(10)
        ]
        seen_depth = seen_inflight = 0.0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(f.done() for f in futures):
            samples = scrape(url)
            seen_depth = max(seen_depth, value(samples, "gpuserve_queue_depth", **labels))
            seen_inflight = max(
                seen_inflight, value(samples, "gpuserve_inflight_requests", **labels)
            )
            time.sleep(0.02)
        assert all(f.result().status_code == 200 for f in futures)
    assert seen_depth >= 2
    assert seen_inflight >= seen_depth
    samples = scrape(url)
    assert value(samples, "gpuserve_queue_depth", **labels) == 0
    assert value(samples, "gpuserve_inflight_requests", **labels) == 0


def test_metrics_port_serves_the_same_registry(server, client):
    port = server.server.metrics_server.port
    assert port not in (0, server.port)
    on_http = scrape(f"{server.url}/metrics")
    on_port = scrape(f"http://127.0.0.1:{port}/metrics")

    def gpuserve_counters(samples: Samples) -> Samples:
        return {k: v for k, v in samples.items() if k[0].startswith("gpuserve_requests_total")}

    assert gpuserve_counters(on_http) and gpuserve_counters(on_http) == gpuserve_counters(on_port)
    names = {name for name, _ in on_http}
    assert {name for name, _ in on_port} == names
    assert "process_resident_memory_bytes" in names
    assert "process_cpu_seconds_total" in names


def test_no_gpu_series_without_a_gpu(server, client):
    if server.server.metrics.gpu is not None and server.server.metrics.gpu.enabled:
        pytest.skip("a GPU is present: tests/gpu covers real telemetry")
    text = client.get("/metrics").text
    assert "gpuserve_gpu_" not in text


def test_timing_headers_add_up(client):
    response = client.post("/v2/models/double_fp32/infer", json=good(1))
    assert response.status_code == 200
    queue_us = int(response.headers["x-queue-time-us"])
    compute_us = int(response.headers["x-compute-time-us"])
    total_us = int(response.headers["x-total-time-us"])
    assert queue_us >= 0 and compute_us >= 0
    assert queue_us + compute_us <= total_us


def test_access_log_line_has_sizes_never_contents(client, caplog):
    caplog.set_level(logging.INFO, logger="gpuserve.access")
    payload = good(2)
    payload["inputs"][0]["data"] = [12345.5] * 32
    assert client.post("/v2/models/double_fp32/infer", json=payload).status_code == 200
    assert client.post("/v2/models/double_fp32/infer", content=b"{").status_code == 400
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        records = [r for r in caplog.records if r.name == "gpuserve.access"]
        if len(records) >= 2:
            break
        time.sleep(0.01)
    ok, bad = records[-2], records[-1]
    line = ok.getMessage()
    assert '"POST /v2/models/double_fp32/infer" 200' in line
    assert "model=double_fp32 version=1 rows=2" in line and "'INPUT0': [2, 16]" in line
    assert "12345" not in line
    assert (ok.model, ok.version, ok.rows, ok.status) == ("double_fp32", "1", 2, 200)
    assert ok.total_ms > 0 and ok.client.startswith("127.0.0.1:")
    assert bad.status == 400 and bad.model == "double_fp32"
