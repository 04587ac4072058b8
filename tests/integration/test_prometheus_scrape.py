"""A real Prometheus scrapes a running gpuserve under traffic; the dashboards' queries answer.

Prometheus (Debian's ``prometheus`` package; ``.ci/run`` installs it) is started with a
generated config that scrapes the server's metrics port every 0.5 s, while a thread sends
requests (good ones, and ones that fail in the model). Then, through Prometheus's HTTP API:

* every panel query of ``deploy/grafana/dashboards/gpuserve.json`` (``$job`` and ``$model`` as
  the dashboard's "All", ``$__rate_interval`` as 3 s) returns series with plausible values
  (the GPU panels return nothing on a machine without a GPU, and must then be empty);
* the queries of a Triton dashboard written on the ``nv_*`` names of Triton's metrics docs
  return series with plausible values;
* Prometheus's metadata knows the ``nv_*`` counters as counters under Triton's exact names.

Skipped, saying so, only when no ``prometheus`` binary can be found.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import FIXTURE_REPOSITORY
from tests.helpers import InProcessServer, free_port

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy/grafana/dashboards/gpuserve.json"
RATE = "3s"
ROW = [float(v) for v in range(16)]

#: A Triton dashboard on the nv_* names (Triton's docs/user_guide/metrics.md), query -> the
#: plausible range of every value it returns.
TRITON_QUERIES: dict[str, tuple[float, float]] = {
    # requests / s per model
    f"sum by (model) (rate(nv_inference_request_success{{model='double_fp32'}}[{RATE}]))": (
        1e-3,
        1e6,
    ),
    # failures / s by Triton's reason
    f"sum by (model, reason) (rate(nv_inference_request_failure{{model='marker_fail'}}[{RATE}]))": (
        0.0,
        1e6,
    ),
    # average batch size: inferences per execution
    f"sum by (model) (rate(nv_inference_count{{model='double_fp32'}}[{RATE}])) / "
    f"sum by (model) (rate(nv_inference_exec_count{{model='double_fp32'}}[{RATE}]))": (1.0, 8.0),
    # average request latency, microseconds
    f"sum by (model) (rate(nv_inference_request_duration_us{{model='double_fp32'}}[{RATE}])) / "
    f"sum by (model) (rate(nv_inference_request_success{{model='double_fp32'}}[{RATE}]))": (
        1.0,
        10e6,
    ),
    # average queue time, microseconds
    f"sum by (model) (rate(nv_inference_queue_duration_us{{model='double_fp32'}}[{RATE}])) / "
    f"sum by (model) (rate(nv_inference_request_success{{model='double_fp32'}}[{RATE}]))": (
        0.0,
        10e6,
    ),
    # compute time per execution, microseconds, by stage
    **{
        f"sum by (model) (rate(nv_inference_compute_{stage}_duration_us{{model='double_fp32'}}"
        f"[{RATE}])) / sum by (model) (rate(nv_inference_exec_count{{model='double_fp32'}}"
        f"[{RATE}]))": (0.0, 10e6)
        for stage in ("input", "infer", "output")
    },
    "sum by (model) (nv_inference_pending_request_count)": (0.0, 1e4),
    "nv_cpu_utilization": (0.0, 1.0),
    "nv_cpu_memory_used_bytes / nv_cpu_memory_total_bytes": (1e-6, 1.0),
}
TRITON_GPU_QUERIES = [
    "nv_gpu_utilization",
    "nv_gpu_memory_used_bytes / nv_gpu_memory_total_bytes",
    "nv_gpu_power_usage",
]


def prometheus_binary() -> str | None:
    return shutil.which("prometheus") or next(
        (p for p in ("/usr/bin/prometheus", "/usr/local/bin/prometheus") if Path(p).exists()), None
    )


def dashboard_queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    out = []
    for panel in panels:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", RATE)
            out.append((panel["title"], expr.replace("$job", ".*").replace("$model", ".*")))
    return out


class Traffic:
    """Requests on a thread until stopped: double_fp32 rows of 1..3, and every tenth request
    one to marker_fail that fails in the model."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.sent = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30.0) as http:
            while not self.stop.is_set():
                rows = 1 + self.sent % 3
                body = {"inputs": [{"name": "INPUT0", "shape": [rows, 16], "datatype": "FP32"}]}
                body["inputs"][0]["data"] = ROW * rows
                model = "double_fp32"
                if self.sent % 10 == 9:
                    model = "marker_fail"
                    body["inputs"][0]["data"] = [-999.0] * 16 * rows
                http.post(f"/v2/models/{model}/infer", json=body)
                self.sent += 1


@pytest.fixture(scope="module")
def prometheus() -> Iterator[tuple[httpx.Client, InProcessServer]]:
    binary = prometheus_binary()
    if binary is None:
        pytest.skip("no prometheus binary (install Debian's 'prometheus' package, as .ci/run does)")
    server = InProcessServer(FIXTURE_REPOSITORY)
    traffic = Traffic(server.url)
    work = Path(tempfile.mkdtemp(prefix="gpuserve-prometheus-"))
    metrics_port = server.server.metrics_server.port
    (work / "prometheus.yml").write_text(
        "global: {scrape_interval: 500ms, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: gpuserve\n"
        "    scrape_timeout: 400ms\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]\n"
    )
    port = free_port()
    log = (work / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10.0)
    try:
        # Ready, then at least 6 scrapes of the server under traffic (3 s of rate window).
        wait_for(lambda: _ready(api), 60.0, proc, work)
        samples = "count_over_time(nv_inference_request_success{model='double_fp32'}[10s])"
        wait_for(lambda: _value(api, samples) >= 6, 60.0, proc, work)
        yield api, server
    finally:
        traffic.stop.set()
        traffic.thread.join(30)
        api.close()
        proc.terminate()
        proc.wait(30)
        log.close()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def wait_for(check: Any, timeout_s: float, proc: subprocess.Popen, work: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"prometheus exited: {(work / 'prometheus.log').read_text()[-3000:]}")
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)  # a poll with a deadline: Prometheus scrapes on its own clock
    pytest.fail(f"timed out; prometheus log: {(work / 'prometheus.log').read_text()[-3000:]}")


def _ready(api: httpx.Client) -> bool:
    return api.get("/-/ready").status_code == 200


def query(api: httpx.Client, expr: str) -> list[dict[str, Any]]:
    response = api.get("/api/v1/query", params={"query": expr})
    body = response.json()
    assert response.status_code == 200 and body["status"] == "success", (expr, body)
    assert body["data"]["resultType"] == "vector", expr
    return list(body["data"]["result"])


def _value(api: httpx.Client, expr: str) -> float:
    result = query(api, expr)
    return float(result[0]["value"][1]) if result else 0.0


def values(result: list[dict[str, Any]]) -> list[float]:
    return [float(series["value"][1]) for series in result]


def test_every_dashboard_panel_query_returns_plausible_series(prometheus):
    api, server = prometheus
    gpu = server.server.metrics.gpu
    has_gpu = bool(gpu is not None and gpu.enabled)
    checked = 0
    for title, expr in dashboard_queries():
        result = query(api, expr)
        if title.startswith("GPU") and not has_gpu:
            assert result == [], (title, expr)
            continue
        assert result, f"{title}: {expr} returned no series"
        for series in result:
            value = float(series["value"][1])
            # A quantile or ratio of a model that had no traffic in the window is NaN (Grafana
            # draws no point); the model under traffic, and every sum over all, are numbers.
            if series["metric"].get("model", "double_fp32") == "double_fp32":
                assert math.isfinite(value), (title, expr, series)
            assert math.isnan(value) or value >= 0, (title, expr, series)
        checked += 1
    assert checked >= 20
    # A few exact expectations: traffic flows, some of it fails, latencies are seconds.
    by_title = dict(dashboard_queries())
    assert _value(api, by_title["Requests / s"]) > 0
    assert 0 < _value(api, by_title["Error ratio"]) < 1
    assert 0 < _value(api, by_title["p99 latency"]) < 10


def test_triton_dashboard_queries_on_nv_names_return_plausible_series(prometheus):
    api, server = prometheus
    for expr, (low, high) in TRITON_QUERIES.items():
        result = query(api, expr)
        assert result, f"{expr} returned no series"
        for value in values(result):
            assert low <= value <= high, (expr, value)
    failures = query(
        api, "sum by (reason) (increase(nv_inference_request_failure{model='marker_fail'}[10s]))"
    )
    by_reason = {s["metric"]["reason"]: float(s["value"][1]) for s in failures}
    assert set(by_reason) == {"REJECTED", "CANCELED", "BACKEND", "OTHER"}
    assert by_reason["BACKEND"] > 0  # the model raised
    gpu = server.server.metrics.gpu
    for expr in TRITON_GPU_QUERIES:
        assert bool(query(api, expr)) == bool(gpu is not None and gpu.enabled), expr


def test_prometheus_knows_the_nv_counters_by_triton_names_and_types(prometheus):
    api, _ = prometheus
    metadata = api.get("/api/v1/metadata").json()["data"]
    for name in (
        "nv_inference_request_success",
        "nv_inference_request_failure",
        "nv_inference_count",
        "nv_inference_exec_count",
        "nv_inference_request_duration_us",
        "nv_inference_queue_duration_us",
        "nv_inference_compute_infer_duration_us",
    ):
        assert metadata[name][0]["type"] == "counter", name
        assert f"{name}_total" not in metadata
    assert metadata["nv_inference_pending_request_count"][0]["type"] == "gauge"
    assert metadata["gpuserve_requests_total"][0]["type"] == "counter"
