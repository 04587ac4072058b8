"""The KServe V2 gRPC front end over a real grpc.aio listener: tritonclient.grpc against the
fixture repository (health, metadata, config, statistics, index, inference, streams,
cancellation), the standard health service, and the default text_embedding model."""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import shutil
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.conftest import FIXTURE_REPOSITORY
from tests.helpers import InProcessServer


@pytest.fixture(scope="module")
def triton(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def stub(server):
    """The raw service stub compiled by tritonclient (Triton's own protos)."""
    with grpc.insecure_channel(server.grpc_url) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def fp32_input(data: np.ndarray, name: str = "INPUT0") -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(data.shape), "FP32")
    tensor.set_data_from_numpy(data.astype(np.float32))
    return tensor


def status_of(error: InferenceServerException) -> str:
    return str(error.status()).removeprefix("StatusCode.")


# -- health, metadata, config, statistics, index --------------------------------------------


def test_health_and_server_metadata(triton):
    assert triton.is_server_live() and triton.is_server_ready()
    meta = triton.get_server_metadata()
    assert meta.name == "gpuserve" and "statistics" in meta.extensions


def test_standard_health_service(server):
    with grpc.insecure_channel(server.grpc_url) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()


def test_model_metadata_ready_and_config(triton):
    meta = triton.get_model_metadata("double_fp32")
    assert meta.versions == ["1"] and meta.platform == "python"
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
        ("INPUT0", "FP32", [-1, 16])
    ]
    assert triton.get_model_metadata("double_fp32", "1").name == "double_fp32"
    assert triton.is_model_ready("double_fp32") and triton.is_model_ready("double_fp32", "1")
    assert not triton.is_model_ready("broken_model")
    config = triton.get_model_config("double_fp32").config
    assert config.name == "double_fp32" and config.backend == "python"
    assert config.max_batch_size == 8
    assert config.dynamic_batching.max_queue_delay_microseconds == 50000
    assert config.dynamic_batching.default_queue_policy.max_queue_size == 1024
    assert [(t.name, t.data_type, list(t.dims)) for t in config.input] == [
        ("INPUT0", 11, [16])  # TYPE_FP32
    ]
    echo = triton.get_model_config("echo_bytes").config
    assert [t.data_type for t in echo.output] == [13, 8]  # TYPE_STRING, TYPE_INT32


def test_statistics_and_repository_index(triton):
    triton.infer("double4_fp32", [fp32_input(np.ones((2, 4)))])
    (stats,) = triton.get_inference_statistics("double4_fp32").model_stats
    assert stats.name == "double4_fp32" and stats.version == "1"
    assert stats.inference_count >= 2 and stats.inference_stats.success.count >= 1
    everything = triton.get_inference_statistics().model_stats
    assert {"double4_fp32", "slow_fp32"} <= {s.name for s in everything}
    index = {m.name: m for m in triton.get_model_repository_index().models}
    assert index["double_fp32"].state == "READY"
    assert index["broken_model"].state == "UNAVAILABLE" and index["broken_model"].reason


def test_unknown_model_or_version_is_not_found_and_broken_model_unavailable(triton):
    data = [fp32_input(np.zeros((1, 16)))]
    cases = [
        (lambda: triton.infer("nope", data), "NOT_FOUND", "nope"),
        (lambda: triton.infer("double_fp32", data, model_version="7"), "NOT_FOUND", "version"),
        (lambda: triton.get_model_metadata("nope"), "NOT_FOUND", "nope"),
        (lambda: triton.get_model_config("nope"), "NOT_FOUND", "nope"),
        (lambda: triton.is_model_ready("nope"), "NOT_FOUND", "nope"),
        (lambda: triton.infer("broken_model", data), "UNAVAILABLE", "not ready"),
    ]
    for call, code, mentions in cases:
        with pytest.raises(InferenceServerException) as err:
            call()
        assert status_of(err.value) == code
        assert mentions in err.value.message()


# -- inference ---------------------------------------------------------------------------


def test_infer_raw_by_model_and_version_echoes_id(triton):
    x = np.arange(32, dtype=np.float32).reshape(2, 16) + 1
    for version in ("", "1"):
        result = triton.infer(
            "double_fp32", [fp32_input(x)], model_version=version, request_id="r-7"
        )
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x * 2)
        response = result.get_response()
        assert response.id == "r-7" and response.model_version == "1"


def test_infer_timing_is_in_trailing_metadata(stub):
    request = service_pb2.ModelInferRequest(model_name="double4_fp32")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(np.ones(4, np.float32).tobytes())
    response, call = stub.ModelInfer.with_call(request, timeout=10)
    assert np.frombuffer(response.raw_output_contents[0], np.float32).tolist() == [2.0] * 4
    timing = dict(call.trailing_metadata())
    for key in ("x-queue-time-us", "x-compute-time-us", "x-total-time-us"):
        assert int(timing[key]) >= 0
    assert int(timing["x-total-time-us"]) >= int(timing["x-compute-time-us"])


def test_typed_contents_and_requested_outputs(stub):
    request = service_pb2.ModelInferRequest(model_name="echo_bytes", id="typed")
    text = request.inputs.add(name="TEXT", datatype="BYTES", shape=[2, 1])
    text.contents.bytes_contents.extend([b"h\xc3\xa9llo", b""])
    request.outputs.add(name="LEN")
    response = stub.ModelInfer(request, timeout=10)
    assert response.id == "typed" and [o.name for o in response.outputs] == ["LEN"]
    assert np.frombuffer(response.raw_output_contents[0], "<i4").tolist() == [6, 0]

    request = service_pb2.ModelInferRequest(model_name="tokens_int64")
    ids = request.inputs.add(name="input_ids", datatype="INT64", shape=[1, 2])
    ids.contents.int64_contents.extend([2**53 + 1, -(2**63)])
    response = stub.ModelInfer(request, timeout=10)
    assert np.frombuffer(response.raw_output_contents[0], "<i8").tolist() == [2**53 + 1, -(2**63)]


def test_bytes_round_trip_through_tritonclient(triton):
    text = np.array([["héllo ✓".encode()], [b""], [b"a\x00b"]], dtype=object)
    tensor = grpcclient.InferInput("TEXT", [3, 1], "BYTES")
    tensor.set_data_from_numpy(text)
    result = triton.infer("echo_bytes", [tensor])
    assert result.as_numpy("TEXT_OUT").ravel().tolist() == text.ravel().tolist()
    assert result.as_numpy("LEN").ravel().tolist() == [10, 0, 3]


def test_priority_and_timeout_parameters_are_validated(triton):
    data = [fp32_input(np.zeros((1, 4)))]
    assert triton.infer("double4_fp32", data, priority=1, timeout=5_000_000) is not None
    with pytest.raises(InferenceServerException) as err:
        triton.infer("double4_fp32", data, priority=3)
    assert status_of(err.value) == "INVALID_ARGUMENT" and "priority" in err.value.message()


def test_access_log_line_per_call(server, triton, caplog):
    servicer = server.server.grpc.servicer
    servicer.access_log = True
    try:
        with caplog.at_level(logging.INFO, logger="gpuserve.access"):
            triton.infer("double4_fp32", [fp32_input(np.ones((2, 4)))])
            with pytest.raises(InferenceServerException):
                triton.infer("double4_fp32", [fp32_input(np.ones((2, 5)))])
    finally:
        servicer.access_log = False
    records = [r for r in caplog.records if r.name == "gpuserve.access" and r.method == "grpc"]
    ok, bad = records[-2:]
    assert (ok.path, ok.status, ok.model, ok.version, ok.rows) == (
        "ModelInfer",
        "OK",
        "double4_fp32",
        "1",
        2,
    )
    assert ok.shapes == {"INPUT0": [2, 4]} and ok.bytes > 32
    assert (bad.status, bad.shapes, bad.bytes) == ("INVALID_ARGUMENT", {"INPUT0": [2, 5]}, 0)


# -- ModelStreamInfer --------------------------------------------------------------------


def test_stream_of_100_gets_one_response_per_request_concurrently(triton, client):
    before = client.get("/v2/models/double_fp32/stats").json()["model_stats"][0]
    results: queue.Queue = queue.Queue()
    triton.start_stream(callback=lambda result, error: results.put((result, error)))
    started = time.monotonic()
    try:
        for i in range(100):
            x = np.full((1, 16), float(i), dtype=np.float32)
            triton.async_stream_infer("double_fp32", [fp32_input(x)], request_id=f"s-{i}")
        got = {}
        for _ in range(100):
            result, error = results.get(timeout=20)
            assert error is None, error
            request_id = result.get_response().id
            assert request_id not in got
            got[request_id] = result.as_numpy("OUTPUT0")
        elapsed = time.monotonic() - started
    finally:
        triton.stop_stream()
    assert results.empty()
    assert sorted(got) == sorted(f"s-{i}" for i in range(100))
    for i in range(100):
        np.testing.assert_array_equal(got[f"s-{i}"], np.full((1, 16), 2.0 * i))
    after = client.get("/v2/models/double_fp32/stats").json()["model_stats"][0]
    executions = after["execution_count"] - before["execution_count"]
    # One at a time, 100 requests would wait out the 50 ms window 100 times (5 s) and run 100
    # batches: the stream's requests must have been queued together.
    assert executions <= 50, f"{executions} executions: the stream was served one by one"
    assert elapsed < 4.0


def test_stream_error_is_that_requests_alone(triton):
    results: queue.Queue = queue.Queue()
    triton.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        good = fp32_input(np.ones((1, 4)))
        bad = grpcclient.InferInput("INPUT0", [1, 4], "INT32")
        bad.set_data_from_numpy(np.ones((1, 4), dtype=np.int32))
        triton.async_stream_infer("double4_fp32", [good], request_id="a")
        triton.async_stream_infer("double4_fp32", [bad], request_id="b")
        triton.async_stream_infer("nope", [good], request_id="c")
        triton.async_stream_infer("double4_fp32", [good], request_id="d")
        outcomes = [results.get(timeout=10) for _ in range(4)]
    finally:
        triton.stop_stream()
    ok = sorted(r.get_response().id for r, e in outcomes if e is None)
    errors = sorted(e.message() for r, e in outcomes if e is not None)
    assert ok == ["a", "d"]
    assert len(errors) == 2
    assert "INT32" in errors[0] and "FP32" in errors[0]
    assert "nope" in errors[1]


def test_stream_error_response_carries_the_request_id(stub):
    def requests():
        request = service_pb2.ModelInferRequest(model_name="double4_fp32", id="broken-1")
        request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 3])
        request.raw_input_contents.append(b"\0" * 12)
        yield request

    (response,) = list(stub.ModelStreamInfer(requests(), timeout=10))
    assert "INPUT0" in response.error_message and "[1, 3]" in response.error_message
    assert response.infer_response.id == "broken-1"


# -- cancellation and overload -----------------------------------------------------------


def slow_model_log(server) -> list[float]:
    """The fixture's module-level RAN list, found through the loaded model object."""
    scheduler = server.manager.version("slow_fp32", None).scheduler
    model = scheduler.instances[0].backend.model
    return type(model).forward.__globals__["RAN"]


def test_request_whose_deadline_passed_in_the_queue_never_runs(server, triton, client):
    def stats():
        return client.get("/v2/models/slow_fp32/stats").json()["model_stats"][0]

    before = stats()["failure_reasons"].get("cancelled", 0)
    running = fp32_input(np.array([[7001.0] + [0.0] * 15]))
    late = fp32_input(np.array([[7002.0] + [0.0] * 15]))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(triton.infer, "slow_fp32", [running])
        time.sleep(0.15)  # the first request's batch (0.5 s) is running: the next one queues
        with pytest.raises(InferenceServerException) as err:
            triton.infer("slow_fp32", [late], client_timeout=0.2)
        assert status_of(err.value) == "DEADLINE_EXCEEDED"
        assert first.result(10).as_numpy("OUTPUT0")[0, 0] == 14002.0
    deadline = time.monotonic() + 3
    while stats()["failure_reasons"].get("cancelled", 0) == before:
        assert time.monotonic() < deadline, "the expired request was not counted as cancelled"
        time.sleep(0.05)
    time.sleep(0.6)  # had it been run, it would have been by now
    ran = slow_model_log(server)
    assert 7001.0 in ran and 7002.0 not in ran
    assert stats()["failure_reasons"]["cancelled"] == before + 1


SMALL_QUEUE_CONFIG = """\
backend: python
max_batch_size: 1
inputs:
  - {name: INPUT0, datatype: FP32, shape: [16]}
outputs:
  - {name: OUTPUT0, datatype: FP32, shape: [16]}
dynamic_batching:
  max_queue_size: 1
parameters:
  delay_s: 0.4
"""


@pytest.fixture(scope="module")
def small_queue_repository(tmp_path_factory):
    repository = tmp_path_factory.mktemp("repository")
    model = repository / "small_queue"
    (model / "1").mkdir(parents=True)
    (model / "config.yaml").write_text(SMALL_QUEUE_CONFIG)
    shutil.copy(FIXTURE_REPOSITORY / "slow_fp32" / "1" / "model.py", model / "1" / "model.py")
    return repository


@pytest.fixture(scope="module")
def small_queue_server(small_queue_repository):
    running = InProcessServer(small_queue_repository, metrics_port=-1)
    yield running
    running.stop()


def test_queue_full_is_resource_exhausted(small_queue_server):
    triton = grpcclient.InferenceServerClient(small_queue_server.grpc_url)
    data = [fp32_input(np.zeros((1, 16)))]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(triton.infer, "small_queue", data)
        time.sleep(0.15)
        queued = pool.submit(triton.infer, "small_queue", data)
        time.sleep(0.1)
        with pytest.raises(InferenceServerException) as err:
            triton.infer("small_queue", data)
        assert status_of(err.value) == "RESOURCE_EXHAUSTED"
        assert "queue" in err.value.message()
        assert running.result(10) is not None and queued.result(10) is not None
    triton.close()


def test_repository_load_and_unload_with_a_management_token(small_queue_repository):
    running = InProcessServer(
        small_queue_repository,
        metrics_port=-1,
        model_control_mode="explicit",
        management_token="s3cret",
    )
    triton = grpcclient.InferenceServerClient(running.grpc_url)
    token = {"authorization": "Bearer s3cret"}
    try:
        assert not triton.is_server_ready()
        with pytest.raises(InferenceServerException) as err:
            triton.load_model("small_queue")
        assert status_of(err.value) == "UNAUTHENTICATED"
        triton.load_model("small_queue", headers=token)
        assert triton.is_model_ready("small_queue") and triton.is_server_ready()
        with grpc.insecure_channel(running.grpc_url) as channel:
            index = service_pb2_grpc.GRPCInferenceServiceStub(channel).RepositoryIndex(
                service_pb2.RepositoryIndexRequest(ready=True), timeout=5
            )
        assert [(m.name, m.state) for m in index.models] == [("small_queue", "READY")]
        with pytest.raises(InferenceServerException) as err:
            triton.load_model("nope", headers=token)
        assert status_of(err.value) == "NOT_FOUND"
        triton.unload_model("small_queue", headers=token)
        assert not triton.is_model_ready("small_queue")
    finally:
        triton.close()
        running.stop()


def test_shutdown_lets_running_calls_finish_and_refuses_new_ones(small_queue_repository):
    running = InProcessServer(small_queue_repository, metrics_port=-1)
    triton = grpcclient.InferenceServerClient(running.grpc_url)
    data = [fp32_input(np.ones((1, 16)))]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        in_flight = pool.submit(triton.infer, "small_queue", data)
        time.sleep(0.15)  # running (0.4 s) when the stop begins
        stopping = pool.submit(running.stop)
        np.testing.assert_array_equal(in_flight.result(10).as_numpy("OUTPUT0"), np.full((1, 16), 2))
        stopping.result(30)
    assert not running.thread.is_alive()
    with pytest.raises(InferenceServerException) as err:
        triton.infer("small_queue", data, client_timeout=5)
    assert status_of(err.value) == "UNAVAILABLE"
    triton.close()


# -- the default repository: gRPC and HTTP agree -----------------------------------------

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A GPU inference server batches requests to keep the device busy.",
    "Paris is the capital of France.",
]


def test_text_embedding_grpc_matches_http():
    import tritonclient.http as httpclient

    from gpuserve.config import default_model_repository

    running = InProcessServer(default_model_repository(), metrics_port=-1)
    try:
        text = np.array([[s.encode()] for s in SENTENCES], dtype=object)
        grpc_input = grpcclient.InferInput("TEXT", [3, 1], "BYTES")
        grpc_input.set_data_from_numpy(text)
        with grpcclient.InferenceServerClient(running.grpc_url) as triton:
            over_grpc = triton.infer("text_embedding", [grpc_input]).as_numpy("EMBEDDING")
        http_input = httpclient.InferInput("TEXT", [3, 1], "BYTES")
        http_input.set_data_from_numpy(text, binary_data=True)
        http = httpclient.InferenceServerClient(running.url.removeprefix("http://"))
        over_http = http.infer("text_embedding", [http_input]).as_numpy("EMBEDDING")
        http.close()
    finally:
        running.stop()
    assert over_grpc.shape == over_http.shape == (3, 384)
    cosine = (over_grpc * over_http).sum(axis=1) / (
        np.linalg.norm(over_grpc, axis=1) * np.linalg.norm(over_http, axis=1)
    )
    assert (cosine >= 0.9999).all(), cosine
