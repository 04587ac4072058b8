"""The reusable parts of the OpenAPI document (:mod:`gpuserve.server.http.openapi`): the
component schemas of the V2 bodies, the error responses, and the small builders the paths use.
"""

from __future__ import annotations

from typing import Any

from gpuserve.datatypes import DATATYPES
from gpuserve.server.http.openapi_openai import openai_responses, openai_schemas

JSON = "application/json"
OCTETS = "application/octet-stream"


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _response_ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/responses/{name}"}


def _json_response(description: str, schema: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": schema}}, **extra}


_ERROR_STATUSES = {
    "400": ("BadRequest", "The request is invalid (the message names the field and the value)."),
    "401": ("Unauthorized", "A bearer token is configured and the request lacks it."),
    "403": ("Forbidden", "Model management is disabled on this server."),
    "404": ("NotFound", "Unknown model, version or endpoint."),
    "413": ("PayloadTooLarge", "The body exceeds max_request_body_bytes."),
    "429": ("TooManyRequests", "The model's queue is full; retry after Retry-After seconds."),
    "431": ("HeadersTooLarge", "The request line and headers exceed max_header_bytes."),
    "500": ("InternalError", "The model failed on this request."),
    "503": ("Unavailable", "Not ready, timed out in the queue, or shutting down."),
}

_TIME_HEADER = {"schema": {"type": "string", "pattern": "^[0-9]+$"}}


def _errors(*codes: str) -> dict[str, Any]:
    return {code: _response_ref(_ERROR_STATUSES[code][0]) for code in codes}


def _components() -> dict[str, Any]:
    parameter_value = {"oneOf": [{"type": "string"}, {"type": "number"}, {"type": "boolean"}]}
    parameters = {
        "type": "object",
        "description": "Free-form parameters (string, number or boolean values).",
        "additionalProperties": parameter_value,
    }
    tensor_data = {
        "type": "array",
        "description": "Elements in row-major order, flat or nested; only the count must "
        "match the shape. BYTES elements are strings.",
        "items": {},
    }
    datatype = {"type": "string", "enum": list(DATATYPES)}
    schemas: dict[str, Any] = {
        "Error": {
            "type": "object",
            "required": ["error"],
            "properties": {"error": {"type": "string"}},
        },
        "Parameters": parameters,
        "RequestInput": {
            "type": "object",
            "required": ["name", "shape", "datatype"],
            "properties": {
                "name": {"type": "string"},
                "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                "datatype": datatype,
                "parameters": _ref("Parameters"),
                "data": tensor_data,
            },
        },
        "RequestOutput": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string"}, "parameters": _ref("Parameters")},
        },
        "InferenceRequest": {
            "type": "object",
            "required": ["inputs"],
            "properties": {
                "id": {"type": "string"},
                "parameters": _ref("Parameters"),
                "inputs": {"type": "array", "minItems": 1, "items": _ref("RequestInput")},
                "outputs": {"type": "array", "items": _ref("RequestOutput")},
            },
        },
        "ResponseOutput": {
            "type": "object",
            "required": ["name", "shape", "datatype"],
            "properties": {
                "name": {"type": "string"},
                "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                "datatype": datatype,
                "parameters": _ref("Parameters"),
                "data": tensor_data,
            },
        },
        "InferenceResponse": {
            "type": "object",
            "required": ["model_name", "outputs"],
            "properties": {
                "model_name": {"type": "string"},
                "model_version": {"type": "string"},
                "id": {"type": "string"},
                "parameters": _ref("Parameters"),
                "outputs": {"type": "array", "items": _ref("ResponseOutput")},
            },
        },
        "Live": {
            "type": "object",
            "required": ["live"],
            "properties": {"live": {"type": "boolean"}},
        },
        "Ready": {
            "type": "object",
            "required": ["ready"],
            "properties": {
                "name": {"type": "string"},
                "ready": {"type": "boolean"},
                "reason": {"type": "string"},
            },
        },
        "ModelList": {
            "type": "object",
            "required": ["models"],
            "properties": {"models": {"type": "array", "items": {"type": "string"}}},
        },
        "ServerMetadata": {
            "type": "object",
            "required": ["name", "version", "extensions"],
            "properties": {
                "name": {"type": "string"},
                "version": {"type": "string"},
                "extensions": {"type": "array", "items": {"type": "string"}},
            },
        },
        "TensorMetadata": {
            "type": "object",
            "required": ["name", "datatype", "shape"],
            "properties": {
                "name": {"type": "string"},
                "datatype": datatype,
                "shape": {"type": "array", "items": {"type": "integer", "minimum": -1}},
            },
        },
        "VersionState": {
            "type": "object",
            "description": "gpuserve: one version's state, reason and traffic share.",
            "required": ["version", "state"],
            "properties": {
                "name": {"type": "string"},
                "version": {"type": "string"},
                "state": {
                    "type": "string",
                    "enum": ["READY", "LOADING", "UNLOADING", "UNAVAILABLE"],
                },
                "reason": {"type": "string"},
                "traffic": {"type": "number", "minimum": 0, "maximum": 1},
            },
        },
        "ModelMetadata": {
            "type": "object",
            "required": ["name", "versions", "platform", "inputs", "outputs"],
            "properties": {
                "name": {"type": "string"},
                "versions": {"type": "array", "items": {"type": "string"}},
                "version_states": {"type": "array", "items": _ref("VersionState")},
                "platform": {"type": "string"},
                "inputs": {"type": "array", "items": _ref("TensorMetadata")},
                "outputs": {"type": "array", "items": _ref("TensorMetadata")},
            },
        },
        "TritonModelConfig": {
            "type": "object",
            "description": "The model's configuration in Triton's ModelConfig JSON (what "
            "Triton's clients read; the same content as the gRPC ModelConfig).",
            "required": ["name", "max_batch_size"],
            "properties": {
                "name": {"type": "string"},
                "platform": {"type": "string"},
                "backend": {"type": "string"},
                "max_batch_size": {"type": "integer", "minimum": 0},
                "input": {"type": "array", "items": {"type": "object"}},
                "output": {"type": "array", "items": {"type": "object"}},
                "dynamic_batching": {"type": "object"},
                "instance_group": {"type": "array", "items": {"type": "object"}},
                "version_policy": {"type": "object"},
                "optimization": {"type": "object"},
                "parameters": {"type": "object"},
            },
        },
        "ModelConfig": {
            "type": "object",
            "description": "The model's configuration as loaded (the config.yaml fields, with "
            "their defaults) plus 'platform'. Units are in the key names "
            "(dynamic_batching.max_queue_delay_us, default_timeout_us).",
            "required": ["backend", "max_batch_size", "inputs", "outputs"],
            "properties": {
                "backend": {"type": "string"},
                "platform": {"type": "string"},
                "max_batch_size": {"type": "integer", "minimum": 0},
                "inputs": {"type": "array", "items": {"type": "object"}},
                "outputs": {"type": "array", "items": {"type": "object"}},
                "dynamic_batching": {"type": "object"},
            },
        },
        "ModelStatistics": {
            "type": "object",
            "required": ["model_stats"],
            "properties": {
                "model_stats": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name", "version", "inference_stats"],
                        "properties": {
                            "name": {"type": "string"},
                            "version": {"type": "string"},
                            "inference_count": {"type": "integer", "minimum": 0},
                            "execution_count": {"type": "integer", "minimum": 0},
                            "inference_stats": {"type": "object"},
                            "failure_reasons": {
                                "type": "object",
                                "additionalProperties": {"type": "integer", "minimum": 0},
                            },
                        },
                    },
                }
            },
        },
        "RepositoryIndexRequest": {
            "type": "object",
            "properties": {"ready": {"type": "boolean"}},
        },
        "RepositoryIndex": {"type": "array", "items": _ref("VersionState")},
        "LoadRequest": {
            "type": "object",
            "properties": {
                "parameters": {
                    "type": "object",
                    "properties": {
                        "config": {
                            "description": "A model configuration (JSON string or object) "
                            "used instead of config.yaml until the next load.",
                            "oneOf": [{"type": "string"}, {"type": "object"}],
                        }
                    },
                }
            },
        },
        "CanaryRequest": {
            "type": "object",
            "required": ["version", "weight"],
            "properties": {
                "version": {"type": "integer", "minimum": 1},
                "weight": {"type": "number", "minimum": 0, "maximum": 1},
            },
        },
        "ModelStatus": {
            "type": "object",
            "description": "The model's route (served version, canary), held back versions "
            "and the rows of the repository index.",
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "served_version": {"type": "string", "nullable": True},
                "canary": {
                    "type": "object",
                    "nullable": True,
                    "properties": {
                        "version": {"type": "string"},
                        "weight": {"type": "number", "minimum": 0, "maximum": 1},
                    },
                },
                "held_back": {"type": "array", "items": {"type": "string"}},
                "versions": {"type": "array", "items": _ref("VersionState")},
            },
        },
    }
    error = _json_response("", _ref("Error"))
    responses: dict[str, Any] = {}
    for name, description in _ERROR_STATUSES.values():
        responses[name] = {**error, "description": description}
    responses["TooManyRequests"]["headers"] = {
        "Retry-After": {
            "required": True,
            "description": "Seconds to wait before retrying.",
            "schema": {"type": "string", "pattern": "^[0-9]+$"},
        }
    }
    responses["Unauthorized"]["headers"] = {
        "WWW-Authenticate": {"required": True, "schema": {"type": "string"}}
    }
    return {
        "schemas": {**schemas, **openai_schemas()},
        "responses": {**responses, **openai_responses()},
        "securitySchemes": {
            "bearer": {
                "type": "http",
                "scheme": "bearer",
                "description": "The API token (--api-token) for inference and metadata; the "
                "management token (--management-token) for repository changes.",
            }
        },
    }


_OPTIONAL_TOKEN: list[dict[str, list[str]]] = [{}, {"bearer": []}]
_OPEN: list[dict[str, list[str]]] = []
