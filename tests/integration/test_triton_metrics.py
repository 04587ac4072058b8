"""Metrics by Triton's names: ``nv_inference_*``, ``nv_cpu_*`` and ``nv_gpu_*``.

One in-process server on the fixture repository. Good and bad requests over HTTP, then a
scrape of ``/metrics`` (and of the metrics port): the ``nv_*`` counters agree with the
statistics extension (they are read from the same ModelStats) and with what was sent, and
every ``nv_*`` family has exactly the name, type and labels of Triton's documentation. The GPU
gauges are checked against a fake NVML (no GPU needed).

The exposition is parsed here by hand, not with prometheus_client's parser: that parser
renames counter samples to ``*_total``, which is exactly what must not happen.
"""

from __future__ import annotations

import re

import httpx
import pytest

from gpuserve.metrics import ServerMetrics, render
from tests.conftest import FIXTURE_REPOSITORY
from tests.helpers import InProcessServer
from tests.unit.test_metrics_gpu import FakeNvml

ROW = [float(v) for v in range(16)]
MODEL = "double_fp32"
MV = frozenset({"model", "version"})

#: Triton's documented metrics that are on by default, from
#: triton-inference-server/server docs/user_guide/metrics.md: name -> (type, label names).
#: The doc's words, per table: "Inference Request Metrics / Counts" (Success Count, Failure
#: Count with its "Failure Count Categories" REJECTED/CANCELED/BACKEND/OTHER under the label
#: ``reason``, Inference Count, Execution Count, Pending Request Count), "Latencies /
#: Counters" ("By default, the following Counter metrics are used for latencies"), "GPU
#: Metrics" (Per GPU) and "CPU Metrics" (System-wide). The counts are Counters and the
#: pending count and the GPU/CPU readings Gauges in Triton's exposition (its ``# TYPE``
#: lines; Triton labels a GPU by ``gpu_uuid``). Left out, because Triton has them off by
#: default or gpuserve has no such feature: the ``*_summary_us`` summaries
#: (``summary_latencies=true``), ``nv_inference_first_response_histogram_ms``
#: (``histogram_latencies=true``), the pinned-memory pool and the response-cache series.
TRITON_DOC: dict[str, tuple[str, frozenset[str]]] = {
    "nv_inference_request_success": ("counter", MV),
    "nv_inference_request_failure": ("counter", MV | {"reason"}),
    "nv_inference_count": ("counter", MV),
    "nv_inference_exec_count": ("counter", MV),
    "nv_inference_pending_request_count": ("gauge", MV),
    "nv_inference_request_duration_us": ("counter", MV),
    "nv_inference_queue_duration_us": ("counter", MV),
    "nv_inference_compute_input_duration_us": ("counter", MV),
    "nv_inference_compute_infer_duration_us": ("counter", MV),
    "nv_inference_compute_output_duration_us": ("counter", MV),
    "nv_gpu_power_usage": ("gauge", frozenset({"gpu_uuid"})),
    "nv_gpu_power_limit": ("gauge", frozenset({"gpu_uuid"})),
    "nv_energy_consumption": ("counter", frozenset({"gpu_uuid"})),
    "nv_gpu_utilization": ("gauge", frozenset({"gpu_uuid"})),
    "nv_gpu_memory_total_bytes": ("gauge", frozenset({"gpu_uuid"})),
    "nv_gpu_memory_used_bytes": ("gauge", frozenset({"gpu_uuid"})),
    "nv_cpu_utilization": ("gauge", frozenset()),
    "nv_cpu_memory_total_bytes": ("gauge", frozenset()),
    "nv_cpu_memory_used_bytes": ("gauge", frozenset()),
}
TRITON_REASONS = {"REJECTED", "CANCELED", "BACKEND", "OTHER"}

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class Exposition:
    """The text format as written: ``# TYPE`` per family and every sample by its exact name."""

    def __init__(self, text: str) -> None:
        self.types: dict[str, str] = {}
        self.samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(" ", 3)
                self.types[name] = kind
            elif line and not line.startswith("#"):
                match = _SAMPLE.match(line)
                assert match, line
                labels = frozenset(_LABEL.findall(match.group(2) or ""))
                self.samples[(match.group(1), labels)] = float(match.group(3))

    def families(self, prefix: str) -> dict[str, tuple[str, set[frozenset[str]]]]:
        """name -> (type, label-name sets of its samples) for the families named ``prefix*``."""
        out: dict[str, tuple[str, set[frozenset[str]]]] = {}
        for (name, labels), _ in self.samples.items():
            if name.startswith(prefix):
                kind = self.types.get(name, "<no TYPE line of this exact name>")
                out.setdefault(name, (kind, set()))[1].add(frozenset(k for k, _ in labels))
        return out

    def nv(self, name: str, model: str = MODEL, **extra: str) -> float:
        labels = {("model", model), ("version", "1"), *extra.items()}
        return self.samples.get((name, frozenset(labels)), 0.0)


@pytest.fixture(scope="module")
def server():
    running = InProcessServer(FIXTURE_REPOSITORY)
    yield running
    running.stop()


def scrape(url: str) -> Exposition:
    response = httpx.get(url, timeout=10.0)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return Exposition(response.text)


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

    def grew(name: str, **extra: str) -> float:
        return after.nv(name, **extra) - before.nv(name, **extra)

    assert grew("nv_inference_request_success") == 3
    assert grew("nv_inference_count") == 6
    assert 1 <= grew("nv_inference_exec_count") <= 3
    assert grew("nv_inference_request_duration_us") > 0
    assert grew("nv_inference_queue_duration_us") >= 0
    assert grew("nv_inference_compute_infer_duration_us") > 0
    failures = {r: grew("nv_inference_request_failure", reason=r) for r in TRITON_REASONS}
    # The short tensor fails while decoded against the version's config: bad input, OTHER.
    assert failures == {"REJECTED": 0, "CANCELED": 0, "BACKEND": 0, "OTHER": 1}
    total = sum(after.nv("nv_inference_request_failure", reason=r) for r in TRITON_REASONS)
    assert total == stats["inference_stats"]["fail"]["count"]
    # The same ModelStats as the statistics extension, in microseconds.
    success = stats["inference_stats"]["success"]
    assert after.nv("nv_inference_request_success") == success["count"]
    assert after.nv("nv_inference_request_duration_us") == pytest.approx(success["ns"] / 1000)
    assert after.nv("nv_inference_count") == stats["inference_count"]
    assert after.nv("nv_inference_exec_count") == stats["execution_count"]
    assert after.nv("nv_inference_pending_request_count") == 0  # all answered
    # No Triton name ever carries prometheus_client's counter suffix.
    suffixed = [n for n, _ in after.samples if n.startswith("nv_") and n.endswith("_total")]
    assert suffixed == []
    # The gpuserve_* series are still there beside them, unchanged.
    assert after.types["gpuserve_requests_total"] == "counter"
    assert any(name == "gpuserve_requests_total" for name, _ in after.samples)


def test_every_nv_family_is_named_typed_and_labelled_as_triton_documents(server):
    port = scrape(f"http://127.0.0.1:{server.server.metrics_server.port}/metrics")
    http = scrape(f"{server.url}/metrics")
    for exposition in (http, port):
        families = exposition.families("nv_")
        expected = {n: (t, {labels}) for n, (t, labels) in TRITON_DOC.items() if n in families}
        assert families == expected
        on_cpu = {n for n in TRITON_DOC if not n.startswith(("nv_gpu_", "nv_energy_"))}
        assert sorted(on_cpu - set(families)) == []
        reasons = {
            dict(labels)["reason"]
            for name, labels in exposition.samples
            if name == "nv_inference_request_failure" and ("model", "echo_bytes") in labels
        }
        assert reasons == TRITON_REASONS
    assert 0.0 <= port.samples[("nv_cpu_utilization", frozenset())] <= 1.0
    total = port.samples[("nv_cpu_memory_total_bytes", frozenset())]
    assert 0 < port.samples[("nv_cpu_memory_used_bytes", frozenset())] < total


def test_nv_gpu_series_by_uuid_with_nvml_named_as_triton_documents():
    nvml = FakeNvml()
    metrics = ServerMetrics(nvml=nvml, process=False)
    exposition = Exposition(render(metrics.registry)[0].decode())
    families = exposition.families("nv_")
    assert families == {n: (t, {labels}) for n, (t, labels) in TRITON_DOC.items() if n in families}
    assert {n for n in TRITON_DOC if n.startswith(("nv_gpu_", "nv_energy_"))} == set(families)

    def by_uuid(name: str) -> dict[str, float]:
        return {
            dict(labels)["gpu_uuid"]: value
            for (n, labels), value in exposition.samples.items()
            if n == name
        }

    assert by_uuid("nv_gpu_utilization") == {"GPU-0000-0": 0.37, "GPU-0000-1": 1.0}
    assert by_uuid("nv_gpu_memory_total_bytes")["GPU-0000-1"] == 160 * 2**30
    assert by_uuid("nv_gpu_power_usage") == {"GPU-0000-0": 312.5}  # GPU 1 reads no power
    assert by_uuid("nv_gpu_power_limit") == {"GPU-0000-0": 700.0, "GPU-0000-1": 700.0}
    # Joules since start-up: the fake adds 1.5 J per reading, one reading at start.
    assert by_uuid("nv_energy_consumption") == {"GPU-0000-0": 1.5, "GPU-0000-1": 1.5}
    metrics.close()


def test_no_nv_gpu_series_without_nvml():
    metrics = ServerMetrics(nvml=FakeNvml(init_error=True), process=False)
    assert b"nv_gpu_" not in render(metrics.registry)[0]
    metrics.close()


def test_openmetrics_keeps_triton_names_as_unknown_type(server):
    response = httpx.get(
        f"{server.url}/metrics", headers={"accept": "application/openmetrics-text"}, timeout=10
    )
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    text = response.text
    assert "# TYPE nv_inference_count unknown" in text
    assert f'nv_inference_count{{model="{MODEL}",version="1"}}' in text
    assert "# TYPE gpuserve_requests counter" in text
    assert text.rstrip().endswith("# EOF")
