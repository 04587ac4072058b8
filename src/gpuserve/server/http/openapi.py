"""The HTTP API as an OpenAPI 3.0 document, served at ``GET /v2/openapi.json``.

It describes every endpoint of :mod:`gpuserve.server.http.app`,
:mod:`gpuserve.server.http.repository_api` and :mod:`gpuserve.server.http.openai` (its part is
in :mod:`gpuserve.server.http.openapi_openai`), with the KServe V2 request and response bodies, the
error body ``{"error": "..."}`` and every status an endpoint can answer. The test suite runs
schemathesis against a live server with this document (``tests/integration/test_fuzz_openapi.py``),
so a change of the API that is not made here too fails there.

The document is built once, from plain dicts, and cached as JSON bytes.
"""

from __future__ import annotations

import functools
from typing import Any

import orjson

import gpuserve
from gpuserve.server.http.openapi_openai import openai_paths
from gpuserve.server.http.openapi_schemas import (
    _OPEN,
    _OPTIONAL_TOKEN,
    _TIME_HEADER,
    JSON,
    OCTETS,
    _components,
    _errors,
    _json_response,
    _ref,
)


def _op(
    summary: str,
    responses: dict[str, Any],
    *,
    parameters: list[dict[str, Any]] | None = None,
    body: dict[str, Any] | None = None,
    security: list[dict[str, list[str]]] | None = None,
    operation_id: str,
) -> dict[str, Any]:
    op: dict[str, Any] = {
        "operationId": operation_id,
        "summary": summary,
        "responses": responses,
        "security": _OPTIONAL_TOKEN if security is None else security,
    }
    if parameters:
        op["parameters"] = parameters
    if body is not None:
        op["requestBody"] = body
    return op


_MODEL = {
    "name": "model_name",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
    "description": "A model folder of the repository.",
}
_VERSION = {
    "name": "model_version",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": "^[0-9]+$"},
    "description": "A version folder number.",
}


def _model_paths() -> dict[str, Any]:
    """The per-model endpoints, with and without ``/versions/{model_version}``."""
    paths: dict[str, Any] = {}
    infer_body = {
        "required": True,
        "content": {
            JSON: {"schema": _ref("InferenceRequest")},
            OCTETS: {
                "schema": {"type": "string", "format": "binary"},
                "description": "Binary tensor extension: the JSON request followed by the "
                "raw bytes of the inputs that carry parameters.binary_data_size; the JSON "
                "length goes in Inference-Header-Content-Length.",
            },
        },
    }
    header_length = {
        "name": "Inference-Header-Content-Length",
        "in": "header",
        "required": False,
        "schema": {"type": "integer", "minimum": 0},
        "description": "Length of the JSON part of a binary request.",
    }
    infer_ok = {
        "description": "The outputs; with binary outputs, the JSON is followed by their raw "
        "bytes and its length is in Inference-Header-Content-Length.",
        "headers": {
            "x-queue-time-us": {**_TIME_HEADER, "required": True},
            "x-compute-time-us": {**_TIME_HEADER, "required": True},
            "x-total-time-us": {**_TIME_HEADER, "required": True},
        },
        "content": {
            JSON: {"schema": _ref("InferenceResponse")},
            OCTETS: {"schema": {"type": "string", "format": "binary"}},
        },
    }
    for suffix, params, tag in (
        ("", [_MODEL], ""),
        ("/versions/{model_version}", [_MODEL, _VERSION], "Version"),
    ):
        base = "/v2/models/{model_name}" + suffix
        paths[base] = {
            "get": _op(
                "Model metadata (inputs and outputs with -1 for the batch dimension).",
                {
                    "200": _json_response("Model metadata.", _ref("ModelMetadata")),
                    **_errors("400", "401", "404", "503"),
                },
                parameters=params,
                operation_id=f"modelMetadata{tag}",
            )
        }
        paths[base + "/ready"] = {
            "get": _op(
                "Model readiness.",
                {
                    "200": _json_response("Ready.", _ref("Ready")),
                    "503": _json_response("Not ready, with the reason.", _ref("Ready")),
                    **_errors("400", "401", "404"),
                },
                parameters=params,
                operation_id=f"modelReady{tag}",
            )
        }
        paths[base + "/infer"] = {
            "post": _op(
                "Inference (JSON tensors or the binary tensor extension).",
                {
                    "200": infer_ok,
                    **_errors("400", "401", "404", "413", "429", "431", "500", "503"),
                },
                parameters=[*params, header_length],
                body=infer_body,
                operation_id=f"modelInfer{tag}",
            )
        }
        paths.update(_generate_paths(base, params, tag))  # Triton's generate extension
        paths[base + "/config"] = {
            "get": _op(
                "The model's configuration as loaded, in Triton's ModelConfig JSON "
                "(?format=gpuserve: gpuserve's own form).",
                {
                    "200": _json_response(
                        "Configuration.",
                        {"anyOf": [_ref("TritonModelConfig"), _ref("ModelConfig")]},
                    ),
                    **_errors("400", "401", "404", "503"),
                },
                parameters=params,
                operation_id=f"modelConfig{tag}",
            )
        }
        paths[base + "/config/gpuserve"] = {
            "get": _op(
                "The model's configuration as loaded, in gpuserve's form (config.yaml fields).",
                {
                    "200": _json_response("Configuration.", _ref("ModelConfig")),
                    **_errors("400", "401", "404", "503"),
                },
                parameters=params,
                operation_id=f"modelConfigGpuserve{tag}",
            )
        }
        paths[base + "/stats"] = {
            "get": _op(
                "Statistics extension: counts and cumulative nanoseconds.",
                {
                    "200": _json_response("Statistics.", _ref("ModelStatistics")),
                    **_errors("400", "401", "404"),
                },
                parameters=params,
                operation_id=f"modelStatistics{tag}",
            )
        }
    return paths


_GENERATE_BODY = {
    "required": True,
    "content": {
        JSON: {
            "schema": {
                "type": "object",
                "description": "Keys naming a model input carry its data (a value or a list); "
                "'parameters' (an object) and other keys are request parameters; 'id' is "
                "the request id.",
                "properties": {
                    "id": {"type": "string"},
                    "parameters": {"type": "object", "additionalProperties": True},
                },
                "additionalProperties": True,
            }
        }
    },
}
_GENERATE_RESPONSE = {
    "type": "object",
    "description": "Each output by name (BYTES as text; one element as a scalar).",
    "required": ["model_name", "model_version"],
    "properties": {
        "model_name": {"type": "string"},
        "model_version": {"type": "string"},
        "id": {"type": "string"},
    },
    "additionalProperties": True,
}


def _generate_paths(base: str, params: list[dict[str, Any]], tag: str) -> dict[str, Any]:
    """``generate`` and ``generate_stream`` under one model path (see
    :mod:`gpuserve.server.http.generate`)."""
    errors = _errors("400", "401", "404", "413", "429", "500", "503")
    return {
        base + "/generate": {
            "post": _op(
                "Generate extension: one JSON response (a decoupled model must send one).",
                {"200": _json_response("The response.", _GENERATE_RESPONSE), **errors},
                parameters=params,
                body=_GENERATE_BODY,
                operation_id=f"modelGenerate{tag}",
            )
        },
        base + "/generate_stream": {
            "post": _op(
                "Generate extension: the responses as server-sent events, each 'data: "
                "{...}' (a failure after the first is a last event with 'error').",
                {
                    "200": {
                        "description": "Server-sent events, one per response.",
                        "content": {"text/event-stream": {"schema": {"type": "string"}}},
                    },
                    **errors,
                },
                parameters=params,
                body=_GENERATE_BODY,
                operation_id=f"modelGenerateStream{tag}",
            )
        },
    }


def _repository_paths() -> dict[str, Any]:
    paths: dict[str, Any] = {
        "/v2/repository/index": {
            "post": _op(
                "Every model version and its state.",
                {
                    "200": _json_response("The index.", _ref("RepositoryIndex")),
                    **_errors("400", "401", "413"),
                },
                body={
                    "required": False,
                    "content": {JSON: {"schema": _ref("RepositoryIndexRequest")}},
                },
                operation_id="repositoryIndex",
            )
        }
    }
    changes = {
        "load": ("Load, or apply repository changes (explicit mode).", _ref("LoadRequest")),
        "unload": ("Drain and unload every version (explicit mode).", None),
        "rollback": ("Serve the previous version again.", None),
        "canary": ("Start or change a canary.", _ref("CanaryRequest")),
        "canary/promote": ("The canary becomes the default version.", None),
        "canary/abort": ("The canary ends.", None),
        "status": ("The model's route, versions and held back versions.", None),
    }
    for action, (summary, schema) in changes.items():
        body = None
        if schema is not None:
            body = {"required": action == "canary", "content": {JSON: {"schema": schema}}}
        codes = (
            ("400", "401", "404", "413")
            if action == "status"
            else ("400", "401", "403", "404", "413", "503")
        )
        paths[f"/v2/repository/models/{{model_name}}/{action}"] = {
            "post": _op(
                summary,
                {
                    "200": _json_response("The model's status.", _ref("ModelStatus")),
                    **_errors(*codes),
                },
                parameters=[_MODEL],
                body=body,
                operation_id="repository" + "".join(p.title() for p in action.split("/")),
            )
        }
    return paths


@functools.cache
def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.0 document of the HTTP API (a fresh copy is not made: do not modify)."""
    paths: dict[str, Any] = {
        "/v2/health/live": {
            "get": _op(
                "Liveness: 200 while the process serves.",
                {"200": _json_response("Live.", _ref("Live"))},
                security=_OPEN,
                operation_id="serverLive",
            )
        },
        "/v2/health/ready": {
            "get": _op(
                "Readiness: 200 when ready, else 503.",
                {
                    "200": _json_response("Ready.", _ref("Ready")),
                    "503": _json_response("Not ready.", _ref("Ready")),
                },
                security=_OPEN,
                operation_id="serverReady",
            )
        },
        "/v2": {
            "get": _op(
                "Server metadata and extensions.",
                {"200": _json_response("Metadata.", _ref("ServerMetadata")), **_errors("401")},
                operation_id="serverMetadata",
            )
        },
        "/v2/models/stats": {
            "get": _op(
                "Statistics of every model version.",
                {"200": _json_response("Statistics.", _ref("ModelStatistics")), **_errors("401")},
                operation_id="allModelStatistics",
            )
        },
        "/v2/models": {
            "get": _op(
                "Every model of the repository, by name (KServe's model list).",
                {"200": _json_response("Model names.", _ref("ModelList")), **_errors("401")},
                operation_id="modelList",
            )
        },
        **_model_paths(),
        **_repository_paths(),
        **openai_paths(),
        "/v2/openapi.json": {
            "get": _op(
                "This document.",
                {"200": _json_response("OpenAPI 3.0 document.", {"type": "object"})},
                security=_OPEN,
                operation_id="openapi",
            )
        },
        "/metrics": {
            "get": _op(
                "Prometheus metrics (text exposition, or OpenMetrics when accepted).",
                {
                    "200": {
                        "description": "Metrics.",
                        "content": {
                            "text/plain": {"schema": {"type": "string"}},
                            "application/openmetrics-text": {"schema": {"type": "string"}},
                        },
                    }
                },
                security=_OPEN,
                operation_id="metrics",
            )
        },
    }
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "gpuserve",
            "version": gpuserve.__version__,
            "description": "KServe V2 Open Inference Protocol over HTTP, with Triton's "
            "binary tensor, statistics, model configuration and model repository extensions, "
            'and gpuserve\'s lifecycle endpoints. Errors are {"error": "..."}; the '
            "OpenAI-compatible /v1 endpoints answer OpenAI's bodies and errors.",
        },
        "paths": paths,
        "components": _components(),
    }


@functools.cache
def openapi_json() -> bytes:
    """:func:`openapi_document` as JSON bytes."""
    return orjson.dumps(openapi_document())
