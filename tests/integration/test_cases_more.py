"""Failure cases BC-12 (the JSON configuration keys), BC-20 (the steps ``test_metrics.py``
leaves out) and BC-25 over gRPC of shared/cases/README.md, over real HTTP and gRPC.

* BC-12: the timeout's unit (microseconds) is in every JSON configuration key. Expired and
  longer-timeout requests, and a timeout set with a load request, are in the parametrised
  suite (``test_frontends_queue.py``, ``test_frontends_management.py``), over both protocols.
* BC-20: failures counted by reason (per-row model errors, queue timeouts, cancellations),
  latency quantiles from the histogram buckets, queue and compute time reported apart, the
  queue-depth gauge under a real queue, and counters that survive an unload and reload.
* BC-25 (gRPC): calls admitted before SIGTERM finish, new ones get UNAVAILABLE "shutting
  down" (never NOT_FOUND), readiness turns false while liveness stays true, and the standard
  health service reads NOT_SERVING.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import shutil
import time

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.conftest import FIXTURE_REPOSITORY
from tests.fixtures.lifecycle_support import make_repository
from tests.helpers import InProcessServer, wait_queue, wait_until

pytestmark = pytest.mark.timeout(120)

QUEUE_TIMEOUT_MODEL = "slow_fp32_queue_timeout"  # 1 s per row, max batch 1, 300 ms timeout


def fp32_body(tag: float, timeout_us: int | None = None) -> dict:
    body: dict = {
        "inputs": [
            {"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [tag] + [0.0] * 15}
        ]
    }
    if timeout_us is not None:
        body["parameters"] = {"timeout": timeout_us}
    return body


def grpc_input(tag: float) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
    tensor.set_data_from_numpy(np.array([[tag] + [0.0] * 15], dtype=np.float32))
    return tensor


def wait_running(server, model: str, deadline_s: float = 10.0) -> None:
    """Wait until the model runs a batch (its queue gauges, as a client scrapes them)."""
    wait_queue(server.url, model, executing=1, deadline_s=deadline_s)


# -- BC-12: the unit of the queue timeout, in the JSON configuration -------------------------


def test_bc12_the_unit_is_in_the_config_key_and_its_echo(client):
    """The JSON keys; the values over both protocols are in ``test_frontends_views.py``."""
    config = client.get(f"/v2/models/{QUEUE_TIMEOUT_MODEL}/config/gpuserve").json()
    assert config["dynamic_batching"]["default_timeout_us"] == 300_000
    assert all(
        not key.endswith(("_ms", "_s")) or key.endswith("_us")
        for key in config["dynamic_batching"]
        if "timeout" in key or "delay" in key
    )


# -- BC-20: failures by reason, latency from buckets, queue depth, no reset -------------------

SLOW_200_CONFIG = """\
backend: python
max_batch_size: 1
inputs:
  - {name: INPUT0, datatype: FP32, shape: [16]}
outputs:
  - {name: OUTPUT0, datatype: FP32, shape: [16]}
parameters:
  delay_s: 0.2
"""

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def metrics_server(tmp_path_factory):
    repo = make_repository(
        tmp_path_factory.mktemp("bc20") / "repo",
        "double_fp32",
        "marker_fail_per_row",
        QUEUE_TIMEOUT_MODEL,
    )
    (repo / "slow_200" / "1").mkdir(parents=True)
    (repo / "slow_200" / "config.yaml").write_text(SLOW_200_CONFIG)
    shutil.copy(FIXTURE_REPOSITORY / "slow_fp32" / "1" / "model.py", repo / "slow_200" / "1")
    running = InProcessServer(repo, model_control_mode="explicit", load_model=["*"])
    yield running
    running.stop()


def scrape(url: str) -> Samples:
    samples: Samples = {}
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def outcome(samples: Samples, model: str, reason: str = "") -> float:
    kind = "success" if not reason else "failure"
    labels = {"model": model, "version": "1", "outcome": kind, "reason": reason}
    return value(samples, "gpuserve_requests_total", **labels)


def histogram(samples: Samples, before: Samples, name: str, **labels: str):
    """(upper bound, cumulative count delta) of one histogram's buckets, sorted."""
    rows = []
    for (sample, sample_labels), count in samples.items():
        found = dict(sample_labels)
        le = found.pop("le", None)
        if sample == f"{name}_bucket" and found == labels:
            rows.append((float(le), count - before.get((sample, sample_labels), 0.0)))
    return sorted(rows)


def quantile(rows: list[tuple[float, float]], q: float) -> tuple[float, float]:
    """The (lower, upper] bounds of the bucket holding rank ``q * count``."""
    rank = q * rows[-1][1]
    lower = 0.0
    for upper, cumulative in rows:
        if cumulative >= rank:
            return lower, upper
        lower = upper
    raise AssertionError("no bucket holds the rank")


def test_bc20_failures_by_reason_latency_queue_depth_and_no_reset(metrics_server):
    url = metrics_server.url
    client = httpx.Client(base_url=url, timeout=30)
    start = scrape(url)

    # 1-2. 10 valid requests, 3 malformed and 2 wrong-datatype ones
    for i in range(10):
        assert client.post("/v2/models/double_fp32/infer", json=fp32_body(i)).status_code == 200
    wrong = fp32_body(0.0)
    wrong["inputs"][0]["datatype"] = "INT32"
    bad = [b'{"inputs": [', b"", b"[]", json.dumps(wrong).encode(), json.dumps(wrong).encode()]
    for body in bad:
        response = client.post("/v2/models/double_fp32/infer", content=body)
        assert response.status_code == 400
    # 3. two requests the model fails row by row
    for _ in range(2):
        response = client.post("/v2/models/marker_fail_per_row/infer", json=fp32_body(-999.0))
        assert response.status_code == 500
    # 4. two queue timeouts and two cancellations behind a running request
    triton = grpcclient.InferenceServerClient(metrics_server.grpc_url)
    model_url = f"/v2/models/{QUEUE_TIMEOUT_MODEL}/infer"
    try:
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            running = pool.submit(client.post, model_url, json=fp32_body(1.0))
            wait_running(metrics_server, QUEUE_TIMEOUT_MODEL)
            timeouts = [pool.submit(client.post, model_url, json=fp32_body(2.0)) for _ in range(2)]
            for _ in range(2):
                with pytest.raises(InferenceServerException):
                    triton.infer(QUEUE_TIMEOUT_MODEL, [grpc_input(3.0)], client_timeout=0.1)
            assert [f.result().status_code for f in timeouts] == [503, 503]
            assert running.result().status_code == 200
    finally:
        triton.close()
    after_failures = scrape(url)

    d = {
        (model, reason): outcome(after_failures, model, reason) - outcome(start, model, reason)
        for model in ("double_fp32", "marker_fail_per_row", QUEUE_TIMEOUT_MODEL)
        for reason in ("", "invalid", "backend_error", "timeout", "cancelled")
    }
    expected = dict.fromkeys(d, 0.0)
    expected[("double_fp32", "")] = 10
    expected[("double_fp32", "invalid")] = 5
    expected[("marker_fail_per_row", "backend_error")] = 2
    expected[(QUEUE_TIMEOUT_MODEL, "")] = 1
    expected[(QUEUE_TIMEOUT_MODEL, "timeout")] = 2
    expected[(QUEUE_TIMEOUT_MODEL, "cancelled")] = 2
    assert d == expected
    labels = {"model": "double_fp32", "version": "1"}
    count = "gpuserve_request_duration_seconds_count"
    assert value(after_failures, count, **labels) - value(start, count, **labels) == 10

    # 5. 20 requests to a 200 ms model, one at a time: the p50 bucket holds 200 ms
    before_slow = scrape(url)
    for i in range(20):
        assert client.post("/v2/models/slow_200/infer", json=fp32_body(i)).status_code == 200
    after_slow = scrape(url)
    slow = {"model": "slow_200", "version": "1"}
    rows = histogram(after_slow, before_slow, "gpuserve_request_duration_seconds", **slow)
    assert rows[-1][1] == 20
    lower, upper = quantile(rows, 0.5)
    assert lower < 0.2 <= upper or lower < 0.25 <= upper, (lower, upper)

    def moved(name: str, **extra: str) -> float:
        return value(after_slow, name, **slow, **extra) - value(before_slow, name, **slow, **extra)

    total = moved("gpuserve_request_duration_seconds_sum")
    queue = moved("gpuserve_queue_duration_seconds_sum")
    compute = sum(
        moved("gpuserve_compute_duration_seconds_sum", stage=stage)
        for stage in ("preprocess", "forward", "postprocess")
    )
    assert 20 * 0.2 <= compute <= total
    assert queue < 0.1 * total  # one at a time: hardly any queueing
    assert queue + compute == pytest.approx(total, rel=0.1)
    for name in ("gpuserve_request_duration_seconds", "gpuserve_queue_duration_seconds"):
        buckets = histogram(after_slow, {}, name, **slow)
        assert value(after_slow, f"{name}_count", **slow) == buckets[-1][1]  # +Inf = _count
        assert math.isinf(buckets[-1][0])

    # 6. ten requests queued behind a running one: the gauge reads about 10, then 0
    with concurrent.futures.ThreadPoolExecutor(11) as pool:
        futures = [
            pool.submit(client.post, "/v2/models/slow_200/infer", json=fp32_body(i))
            for i in range(11)
        ]
        deepest = 0.0
        while not all(f.done() for f in futures):
            deepest = max(deepest, value(scrape(url), "gpuserve_queue_depth", **slow))
            time.sleep(0.02)
        assert [f.result().status_code for f in futures] == [200] * 11
    assert deepest >= 9, deepest
    assert value(scrape(url), "gpuserve_queue_depth", **slow) == 0

    # 7. unload and reload: counters never go backwards
    before_reload = scrape(url)
    assert client.post("/v2/repository/models/double_fp32/unload").status_code == 200
    assert client.post("/v2/repository/models/double_fp32/load").status_code == 200
    assert client.post("/v2/models/double_fp32/infer", json=fp32_body(1.0)).status_code == 200
    after_reload = scrape(url)
    for key, old in before_reload.items():
        name, key_labels = key
        if name.endswith(("_total", "_count", "_sum", "_bucket")) and name.startswith("gpuserve_"):
            assert after_reload.get(key, 0.0) >= old, (key, old, after_reload.get(key))
    assert outcome(after_reload, "double_fp32") == outcome(before_reload, "double_fp32") + 1

    # every gpuserve request series carries model and version labels
    for name, key_labels in after_reload:
        if name.startswith(("gpuserve_requests", "gpuserve_request_duration", "gpuserve_queue")):
            assert {"model", "version"} <= {k for k, _ in key_labels}, name
    client.close()


# -- BC-25 over gRPC: admitted calls finish during SIGTERM, new ones get UNAVAILABLE ----------


def test_bc25_grpc_calls_admitted_before_the_stop_finish_and_new_ones_are_unavailable(tmp_path):
    repo = make_repository(tmp_path / "repo", "slow_fp32")  # 0.5 s per batch of up to 8
    server = InProcessServer(repo, metrics_port=-1, shutdown_timeout_s=20)
    triton = grpcclient.InferenceServerClient(server.grpc_url)
    url = f"{server.url}/v2/models/slow_fp32/infer"

    def grpc_call(tag: float) -> float:
        result = triton.infer("slow_fp32", [grpc_input(tag)], client_timeout=30)
        return float(result.as_numpy("OUTPUT0")[0, 0])

    late: list[tuple[grpc.StatusCode, str]] = []
    probes: list[tuple[bool, bool, int]] = []
    try:
        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            admitted_grpc = [pool.submit(grpc_call, 100.0 + i) for i in range(10)]
            admitted_http = [
                pool.submit(httpx.post, url, json=fp32_body(200.0 + i), timeout=30)
                for i in range(10)
            ]
            scheduler = server.manager.runner("slow_fp32", None)
            # every request admitted (a loaded machine may finish the first batch meanwhile)
            wait_until(
                lambda: (
                    scheduler.in_flight_requests
                    + sum(f.done() for f in admitted_grpc + admitted_http)
                    >= 20
                ),
                20.0,
                "all 20 requests admitted",
            )
            assert scheduler.in_flight_requests >= 8  # the stop meets queued and running work
            stopping = pool.submit(server.stop)  # what SIGTERM does
            wait_until(lambda: server.manager.shutting_down, 10.0, "the stop began")
            with grpc.insecure_channel(server.grpc_url) as channel:
                stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
                health = health_pb2_grpc.HealthStub(channel)
                while not all(f.done() for f in admitted_grpc + admitted_http):
                    try:
                        live = stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=2).live
                        ready = stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=2).ready
                        check = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                        probes.append((live, ready, check))
                        message = service_pb2.ModelInferRequest(model_name="slow_fp32")
                        message.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
                        message.raw_input_contents.append(np.zeros(16, "<f4").tobytes())
                        stub.ModelInfer(message, timeout=5)
                        late.append((grpc.StatusCode.OK, ""))
                    except grpc.RpcError as err:
                        details = err.details() or ""
                        if err.code() == grpc.StatusCode.UNAVAILABLE and "shutting" not in details:
                            # the listener closed: only once every admitted call is done
                            assert all(f.done() for f in admitted_grpc + admitted_http), details
                            break
                        late.append((err.code(), details))
                    time.sleep(0.1)
            grpc_answers = [f.result() for f in admitted_grpc]
            http_answers = [f.result() for f in admitted_http]
            stopping.result(30)
    finally:
        triton.close()
    assert grpc_answers == [2 * (100.0 + i) for i in range(10)]
    assert [r.status_code for r in http_answers] == [200] * 10
    assert late, "no request was sent while the server drained"
    for code, details in late:
        assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in details, (code, details)
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    assert probes and all(p == (True, False, not_serving) for p in probes), probes
    assert not server.thread.is_alive()
