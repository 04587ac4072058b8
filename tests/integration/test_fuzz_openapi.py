"""Fuzzing the live HTTP API with schemathesis from its own OpenAPI document (issue 8).

A real server (port 0) serves four well-behaved fixture models; schemathesis reads
``GET /v2/openapi.json`` and sends schema-valid and schema-violating requests to every
operation: the documented examples, boundary cases (coverage phase) and random ones (fuzzing
phase). Each response must be no 5xx, carry a documented status, content type and headers,
and match the documented body schema; each request has a 10 s timeout, so a hang fails. At
the end the server must still be alive and serve a valid request. The whole run takes about
20 s; ``benchmarks/fuzz.py`` runs the same for longer.

Models designed to fail (``marker_fail``, ``wrong_count``, ``broken_model``) or to be slow are
not in the fuzzed repository: their 500/503 answers are what they are for.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.fixtures.lifecycle_support import make_repository
from tests.helpers import InProcessServer

pytestmark = pytest.mark.slow

FUZZED_MODELS = ("double_fp32", "echo_bytes", "tokens_int64", "varlen_fp32")
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
#: Per operation; about 30 operations share the ~20 s budget.
MAX_EXAMPLES = 15
REQUEST_TIMEOUT_S = 10.0


def fuzz_repository(root: Path) -> Path:
    """The fuzzed models, without batching windows (so valid requests answer at once)."""
    make_repository(root, *FUZZED_MODELS)
    for name in FUZZED_MODELS:
        config = root / name / "config.yaml"
        lines = config.read_text().splitlines()
        config.write_text(
            "\n".join(
                ln
                for ln in lines
                if "max_queue_delay_us" not in ln and ln.strip() != "dynamic_batching:"
            )
            + "\n"
        )
    return root


def focus_on_models(document: dict) -> dict:
    """Point the model-name and version parameters at the fuzzed models (positive cases;
    negative cases still send any other string) and give the infer body an example that
    runs, so the examples phase reaches a model."""
    for item in document["paths"].values():
        for operation in item.values():
            for parameter in operation.get("parameters", []):
                if parameter["name"] == "model_name":
                    parameter["schema"] = {"type": "string", "enum": list(FUZZED_MODELS)}
                    parameter["example"] = "double_fp32"
                elif parameter["name"] == "model_version":
                    parameter["schema"] = {"type": "string", "enum": ["1"]}
            media = operation.get("requestBody", {}).get("content", {}).get("application/json")
            if media is not None and "InferenceRequest" in str(media["schema"]):
                media["example"] = {
                    "id": "example",
                    "inputs": [
                        {
                            "name": "INPUT0",
                            "shape": [1, 16],
                            "datatype": "FP32",
                            "data": [float(i) for i in range(16)],
                        }
                    ],
                }
    return document


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    repository = fuzz_repository(tmp_path_factory.mktemp("fuzz") / "repository")
    # Management on (in 'none' mode): the repository calls parse their bodies and answer
    # 400 for what the mode does not allow, rather than 403 before reading anything.
    running = InProcessServer(repository, metrics_port=-1, grpc_port=-1, enable_management=True)
    yield running
    running.stop()


def load_schema():
    """The schema from the document the server serves (built from the same function; the
    test below checks that the served document equals it)."""
    import orjson

    from gpuserve.server.http.openapi import openapi_json

    schema = schemathesis.openapi.from_dict(focus_on_models(orjson.loads(openapi_json())))
    schema.config.update(request_timeout=REQUEST_TIMEOUT_S)
    schema.config.phases.update(phases=["examples", "coverage", "fuzzing"])
    return schema


schema = load_schema()


def test_the_served_document_is_the_one_fuzzed(fuzz_server):
    from gpuserve.server.http.openapi import openapi_document

    served = httpx.get(f"{fuzz_server.url}/v2/openapi.json", timeout=10)
    assert served.status_code == 200
    assert served.json() == openapi_document()


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_api_conforms_to_its_openapi_document_and_never_answers_5xx(case, fuzz_server):
    started = time.monotonic()
    response = case.call(base_url=fuzz_server.url, timeout=REQUEST_TIMEOUT_S)
    assert time.monotonic() - started < REQUEST_TIMEOUT_S
    case.validate_response(response, checks=CHECKS)


def test_server_is_alive_after_the_fuzzing(fuzz_server):
    with httpx.Client(base_url=fuzz_server.url, timeout=10) as client:
        assert client.get("/v2/health/live").status_code == 200
        assert client.get("/v2/health/ready").status_code == 200
        body = {
            "inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 16}]
        }
        response = client.post("/v2/models/double_fp32/infer", json=body)
        assert response.status_code == 200
        assert response.json()["outputs"][0]["data"] == [2.0] * 16
        text = {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["hi"]}]}
        assert client.post("/v2/models/echo_bytes/infer", json=text).status_code == 200
