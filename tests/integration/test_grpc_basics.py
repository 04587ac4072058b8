"""What only the gRPC front end has, over a real grpc.aio listener: the standard health
service, typed ``contents`` and requested outputs through the raw stub, the access-log line
per call, ``ModelStreamInfer`` (tritonclient.grpc streams), and the default text_embedding
model answering the same over gRPC and HTTP.

What both front ends answer alike (health, metadata, configuration, statistics, index,
inference, errors, queue, shutdown, repository commands) is in the parametrised suite,
``tests/integration/test_frontends_*.py``."""

from __future__ import annotations

import logging
import queue
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

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


# -- the standard health service -----------------------------------------------------------


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


# -- typed contents and the access log ----------------------------------------------------


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
    # With early dispatch a batch leaves once as many rows wait as the model's last batch
    # carried, so the count of executions below depends on that batch: make it 2 rows, as
    # the tests that used to run before this one left it, whatever ran before.
    triton.infer("double_fp32", [fp32_input(np.zeros((2, 16)))])
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
    # Sorted: Triton's "Request for unknown model" sorts before the datatype error.
    assert errors[0].startswith("Request for unknown model: 'nope' is not found")
    assert "INT32" in errors[1] and "FP32" in errors[1]


def test_stream_error_response_carries_the_request_id(stub):
    def requests():
        request = service_pb2.ModelInferRequest(model_name="double4_fp32", id="broken-1")
        request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 3])
        request.raw_input_contents.append(b"\0" * 12)
        yield request

    (response,) = list(stub.ModelStreamInfer(requests(), timeout=10))
    assert "INPUT0" in response.error_message and "[1, 3]" in response.error_message
    assert response.infer_response.id == "broken-1"


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
