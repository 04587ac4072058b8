"""Metrics by Triton's names (issue 15 item 5): ``nv_inference_*`` and ``nv_gpu_*``.

One in-process server on the fixture repository. Good and bad requests over HTTP, then a
scrape of ``/metrics``: the ``nv_*`` counters agree with the statistics extension (they are
read from the same ModelStats) and with what was sent. The GPU gauges are checked against a
fake NVML (no GPU needed).
"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuserve.metrics import ServerMetrics
from tests.conftest import FIXTURE_REPOSITORY
from tests.helpers import InProcessServer
from tests.unit.test_metrics_gpu import FakeNvml

ROW = [float(v) for v in range(16)]
MODEL = "double_fp32"


@pytest.fixture(scope="module")
def server():
    running = InProcessServer(FIXTURE_REPOSITORY)
    yield running
    running.stop()


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    response = httpx.get(url, timeout=10.0)
    assert response.status_code == 200, response.text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def nv(samples, name: str, model: str = MODEL) -> float:
    return samples.get((name, frozenset({("model", model), ("version", "1")})), 0.0)


def test_nv_inference_counters_follow_requests(server):
    url = f"{server.url}/metrics"
    before = scrape(url)
    with httpx.Client(base_url=server.url, timeout=30.0) as http:
        for rows in (1, 2, 3):
            body = {
                "inputs": [
                    {"name": "INPUT0", "shape": [rows, 16], "datatype": "FP32", "data": ROW * rows}
                ]
            }
            assert http.post(f"/v2/models/{MODEL}/infer", json=body).status_code == 200
        bad = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [1]}]}
        assert http.post(f"/v2/models/{MODEL}/infer", json=bad).status_code == 400
        stats = http.get(f"/v2/models/{MODEL}/versions/1/stats").json()["model_stats"][0]
    after = scrape(url)

    def grew(name: str) -> float:
        return nv(after, name + "_total") - nv(before, name + "_total")

    assert grew("nv_inference_request_success") == 3
    assert grew("nv_inference_count") == 6
    assert 1 <= grew("nv_inference_exec_count") <= 3
    assert grew("nv_inference_request_duration_us") > 0
    assert grew("nv_inference_queue_duration_us") >= 0
    assert grew("nv_inference_compute_infer_duration_us") > 0
    # The same ModelStats as the statistics extension, in microseconds.
    success = stats["inference_stats"]["success"]
    assert nv(after, "nv_inference_request_success_total") == success["count"]
    assert nv(after, "nv_inference_request_duration_us_total") == pytest.approx(
        success["ns"] / 1000
    )
    assert nv(after, "nv_inference_count_total") == stats["inference_count"]
    assert nv(after, "nv_inference_exec_count_total") == stats["execution_count"]
    # The gpuserve_* series are still there beside them.
    assert any(name == "gpuserve_requests_total" for name, _ in after)


def test_nv_counters_exist_for_every_loaded_version(server):
    samples = scrape(f"{server.url}/metrics")
    for name in (
        "nv_inference_request_success_total",
        "nv_inference_request_failure_total",
        "nv_inference_compute_input_duration_us_total",
        "nv_inference_compute_output_duration_us_total",
    ):
        assert (name, frozenset({("model", "echo_bytes"), ("version", "1")})) in samples


def test_nv_gpu_gauges_by_uuid_with_nvml():
    metrics = ServerMetrics(nvml=FakeNvml(), process=False)
    text = generate_latest(metrics.registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    util = {s.labels["gpu_uuid"]: s.value for s in families["nv_gpu_utilization"].samples}
    assert util == {"GPU-0000-0": pytest.approx(0.37), "GPU-0000-1": 1.0}
    total = {s.labels["gpu_uuid"]: s.value for s in families["nv_gpu_memory_total_bytes"].samples}
    assert total["GPU-0000-1"] == 160 * 2**30
    assert families["nv_gpu_memory_used_bytes"].samples
    power = {s.labels["gpu_uuid"]: s.value for s in families["nv_gpu_power_usage"].samples}
    assert power == {"GPU-0000-0": 312.5}  # GPU 1 reads no power: left out, as gpuserve_*
    metrics.close()


def test_no_nv_gpu_series_without_nvml():
    metrics = ServerMetrics(nvml=FakeNvml(init_error=True), process=False)
    assert b"nv_gpu_" not in generate_latest(metrics.registry)
    metrics.close()
