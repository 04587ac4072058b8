"""OpenTelemetry traces (``--trace-config mode=opentelemetry``) at a real OTLP/HTTP receiver.

The server runs with Triton's trace flags (``rate=2``, ``level=TIMESTAMPS``, an
``opentelemetry,url`` pointing at a receiver inside this test, a 50 ms export delay); the
official SDK's exporter posts protobuf ``ExportTraceServiceRequest`` messages, which the
receiver decodes with ``opentelemetry-proto``. A client's W3C ``traceparent`` (HTTP header,
gRPC metadata) continues the client's trace: the request's span is its child, with children
for admission, queue, compute and response; an ensemble's steps and a BLS call are child
spans of their request's span; requests without a trace context are sampled 1 in 2.
"""

from __future__ import annotations

import queue
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra (opentelemetry-sdk)")

from tests.fixtures.ensemble_models import (
    BLS_GPUSERVE,
    BLS_TRITON,
    PIPELINE,
    bls_config,
    write_model,
    write_steps,
)
from tests.fixtures.otlp_receiver import Receiver, of_trace
from tests.helpers import InProcessServer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

STAGES = ["admission", "queue", "compute", "response"]


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    running = Receiver()
    yield running
    running.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory, receiver):
    root = tmp_path_factory.mktemp("otel")
    write_steps(root)
    write_model(root, "pipeline", PIPELINE, None)
    write_model(root, "bls_add", bls_config("add_one"), BLS_GPUSERVE)
    write_model(root, "pb_add", bls_config("add_one"), BLS_TRITON)
    shutil.copytree(FIXTURES / "decoupled" / "capped", root / "capped")
    running = InProcessServer(
        root,
        trace_config=[
            "mode=opentelemetry",
            f"opentelemetry,url={receiver.url}",
            "opentelemetry,resource=service.name=gpuserve-test",
            "opentelemetry,bsp_schedule_delay=50",
            "rate=2",
            "level=TIMESTAMPS",
            "count=-1",
        ],
    )
    yield running
    running.stop()


def traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def body(model: str, request_id: str, rows: int = 2) -> dict[str, Any]:
    name = "IN" if model == "pipeline" else "X"
    values = np.arange(rows * 4, dtype=np.float32).ravel().tolist()
    return {
        "id": request_id,
        "inputs": [{"name": name, "datatype": "FP32", "shape": [rows, 4], "data": values}],
    }


def children(spans: list[dict[str, Any]], parent: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted((s for s in spans if s["parent"] == parent["span_id"]), key=lambda s: s["start"])


def check_request_span(spans, span, model: str, request_id: str, rows: int = 2) -> None:
    """A model's span: its attributes, and the four stage spans inside it, in order."""
    attributes = span["attributes"]
    assert attributes["model_name"] == model and attributes["model_version"] == "1"
    assert attributes["request_id"] == request_id
    assert attributes["rows"] == rows and attributes["batch_size"] >= rows
    stages = [s for s in children(spans, span) if s["name"] in STAGES]
    assert [s["name"] for s in stages] == STAGES
    assert span["start"] <= stages[0]["start"] and stages[-1]["end"] <= span["end"]
    for before, after in zip(stages, stages[1:], strict=False):
        assert before["end"] <= after["start"] + 1  # contiguous, in order
    assert span["end"] - span["start"] < 30e9
    assert span["resource"]["service.name"] == "gpuserve-test"


def test_http_traceparent_continues_the_clients_trace(server, receiver):
    header, trace_id, client_span = traceparent()
    answer = httpx.post(
        f"{server.url}/v2/models/add_one/infer",
        json=body("add_one", "http-1"),
        headers={"traceparent": header},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    spans = receiver.wait_for_request(trace_id, client_span)
    mine = of_trace(spans, trace_id)
    (root,) = [s for s in mine if s["name"] == "add_one"]
    assert root["parent"] == client_span  # the client's span is its parent: one trace
    assert root["kind"] == 2  # SPAN_KIND_SERVER
    check_request_span(mine, root, "add_one", "http-1")


def test_grpc_metadata_traceparent_continues_the_clients_trace(server, receiver):
    import tritonclient.grpc as grpcclient

    header, trace_id, client_span = traceparent()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    tensor = grpcclient.InferInput("X", [2, 4], "FP32")
    tensor.set_data_from_numpy(np.arange(8, dtype=np.float32).reshape(2, 4))
    client.infer("double", [tensor], request_id="grpc-1", headers={"traceparent": header})
    spans = receiver.wait_for_request(trace_id, client_span)
    mine = of_trace(spans, trace_id)
    (root,) = [s for s in mine if s["name"] == "double"]
    assert root["parent"] == client_span
    check_request_span(mine, root, "double", "grpc-1")


def test_an_ensembles_steps_are_child_spans(server, receiver):
    header, trace_id, client_span = traceparent()
    answer = httpx.post(
        f"{server.url}/v2/models/pipeline/infer",
        json=body("pipeline", "ens-1"),
        headers={"traceparent": header},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    # the ensemble's span + 4 stages, and 3 steps with 4 stages each
    spans = receiver.wait_for_request(trace_id, client_span)
    mine = of_trace(spans, trace_id)
    (root,) = [s for s in mine if s["name"] == "pipeline"]
    assert root["parent"] == client_span
    steps = [s for s in children(mine, root) if s["name"] not in STAGES]
    assert sorted(s["name"] for s in steps) == ["add_one", "combine", "double"]
    for step in steps:
        assert step["attributes"]["gpuserve.kind"] == "ensemble_step"
        assert step["kind"] == 1  # SPAN_KIND_INTERNAL
        assert root["start"] <= step["start"] and step["end"] <= root["end"]
        check_request_span(mine, step, step["name"], "ens-1")


@pytest.mark.parametrize("caller", ["bls_add", "pb_add"])
def test_a_bls_call_is_a_child_span(server, receiver, caller):
    header, trace_id, client_span = traceparent()
    answer = httpx.post(
        f"{server.url}/v2/models/{caller}/infer",
        json=body(caller, f"{caller}-1"),
        headers={"traceparent": header},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    spans = receiver.wait_for_request(trace_id, client_span)
    mine = of_trace(spans, trace_id)
    (root,) = [s for s in mine if s["name"] == caller]
    calls = [s for s in mine if s["name"] == "add_one"]
    assert calls  # (Triton's execute may call once per request row: one span per call)
    for call in calls:
        assert call["parent"] == root["span_id"]
        assert call["attributes"]["gpuserve.kind"] == "bls"
        assert root["start"] <= call["start"] and call["end"] <= root["end"]
        assert [s["name"] for s in children(mine, call)] == STAGES
    check_request_span(mine, root, caller, f"{caller}-1")


def test_requests_without_a_trace_context_are_sampled_at_the_rate(server, receiver):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for i in range(8):
            answer = http.post("/v2/models/combine/infer", json=rate_body(f"rate-{i}"))
            assert answer.status_code == 200, answer.text
        # A traced marker last: spans are exported in the order they end, so once it has
        # arrived every sampled request before it has too.
        header, trace_id, client_span = traceparent()
        answer = http.post(
            "/v2/models/combine/infer", json=rate_body("marker"), headers={"traceparent": header}
        )
        assert answer.status_code == 200
    spans = receiver.wait_for_request(trace_id, client_span)
    sampled = {
        s["attributes"]["request_id"]
        for s in spans
        if s["name"] == "combine" and s["attributes"]["request_id"].startswith("rate-")
    }
    assert len(sampled) == 4, sampled  # rate=2: one in two
    # each sampled request is a trace of its own (no client context)
    roots = [s for s in spans if s["attributes"].get("request_id") in sampled]
    assert all(s["parent"] == "" for s in roots) and len({s["trace_id"] for s in roots}) == 4


def rate_body(request_id: str) -> dict[str, Any]:
    values = [1.0, 2.0, 3.0, 4.0]
    return {
        "id": request_id,
        "inputs": [
            {"name": n, "datatype": "FP32", "shape": [1, 4], "data": values} for n in ("A", "B")
        ],
    }


def test_a_failed_request_has_an_error_span(server, receiver):
    header, trace_id, _ = traceparent()
    bad = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": [1.0]}]}
    answer = httpx.post(
        f"{server.url}/v2/models/add_one/infer", json=bad, headers={"traceparent": header}
    )
    assert answer.status_code == 400
    spans = receiver.wait_for(lambda got: len(of_trace(got, trace_id)) >= 1)
    (span,) = of_trace(spans, trace_id)
    assert span["name"] == "add_one" and span["status"] == 2  # STATUS_CODE_ERROR


def test_a_decoupled_stream_over_grpc_is_one_span_ended_with_its_last_response(server, receiver):
    import tritonclient.grpc as grpcclient

    header, trace_id, client_span = traceparent()
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(
        callback=lambda result, error: results.put(error), headers={"traceparent": header}
    )
    count = grpcclient.InferInput("COUNT", [1], "INT32")
    count.set_data_from_numpy(np.array([3], dtype=np.int32))
    client.async_stream_infer("capped", [count], request_id="stream-1")
    for _ in range(3):
        assert results.get(timeout=30) is None
    client.stop_stream()
    client.close()
    spans = receiver.wait_for_request(trace_id, client_span)
    mine = of_trace(spans, trace_id)
    (root,) = [s for s in mine if s["name"] == "capped"]
    assert root["parent"] == client_span and root["status"] != 2
    assert root["attributes"]["request_id"] == "stream-1"
    assert [s["name"] for s in children(mine, root)] == STAGES


def test_generate_extension_continues_the_trace(server, receiver):
    header, trace_id, client_span = traceparent()
    answer = httpx.post(
        f"{server.url}/v2/models/capped/generate",
        json={"COUNT": 1, "id": "gen-1"},
        headers={"traceparent": header},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    spans = receiver.wait_for_request(trace_id, client_span)
    (root,) = [s for s in of_trace(spans, trace_id) if s["name"] == "capped"]
    assert root["parent"] == client_span


def test_with_tracing_off_no_request_asks_the_tracer(tmp_path, monkeypatch):
    from gpuserve.service.tracing.runtime_settings import TraceSettings

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("TraceSettings.start called with tracing off")

    write_steps(tmp_path)
    off = InProcessServer(tmp_path)
    try:
        monkeypatch.setattr(TraceSettings, "start", never)
        header, _, _ = traceparent()
        answer = httpx.post(
            f"{off.url}/v2/models/add_one/infer",
            json=body("add_one", "off-1"),
            headers={"traceparent": header},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        assert not off.server.service.tracing
    finally:
        off.stop()
