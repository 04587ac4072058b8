"""The OpenAI-compatible endpoints in the OpenAPI document (``/v1/embeddings``, ``/v1/models``).

Merged into :func:`gpuserve.server.http.openapi.openapi_document` (paths, schemas and error
responses), so schemathesis fuzzes them with the rest. Their errors are OpenAI's
``{"error": {"message", "type", "param", "code"}}``, including what the HTTP transport
answers before any handler runs (a body over ``max_request_body_bytes``: 413, a head over
``max_header_bytes``: 431).
"""

from __future__ import annotations

from typing import Any

from gpuserve.protocol.openai_codec import MAX_INPUTS

JSON = "application/json"

_TOKEN: list[dict[str, list[str]]] = [{}, {"bearer": []}]
_TIME = {"schema": {"type": "string", "pattern": "^[0-9]+$"}}
_NULLABLE_STRING = {"type": "string", "nullable": True}

#: status -> (response name, description)
_ERRORS = {
    "400": ("OpenAIBadRequest", "Invalid body: the message names the field, 'param' names it."),
    "401": ("OpenAIUnauthorized", "An API token is configured and the request lacks it."),
    "404": ("OpenAINotFound", "Unknown model, a model serving no embeddings, or a bad URL."),
    "413": (
        "OpenAIPayloadTooLarge",
        f"More than max_inputs_per_call inputs ({MAX_INPUTS} unless the server sets it), or "
        "a body over max_request_body_bytes.",
    ),
    "431": ("OpenAIHeadersTooLarge", "The request line and headers exceed max_header_bytes."),
    "429": ("OpenAITooManyRequests", "The model's queue is full; retry after Retry-After."),
    "500": ("OpenAIInternalError", "The model failed on this request."),
    "503": ("OpenAIUnavailable", "Not ready, timed out in the queue, or shutting down."),
}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _errors(*codes: str) -> dict[str, Any]:
    return {
        code: {"$ref": f"#/components/responses/{_ERRORS[code][0]}"} for code in (*codes, "431")
    }


def openai_schemas() -> dict[str, Any]:
    """The request, answer and error schemas."""
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
    return {
        "OpenAIError": {
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": {
                    "type": "object",
                    "required": ["message", "type", "param", "code"],
                    "properties": {
                        "message": {"type": "string"},
                        "type": {"type": "string"},
                        "param": _NULLABLE_STRING,
                        "code": _NULLABLE_STRING,
                    },
                }
            },
        },
        "EmbeddingsRequest": {
            "type": "object",
            "required": ["model", "input"],
            "properties": {
                "model": {"type": "string", "minLength": 1},
                "input": {
                    "description": "A text, a list of texts, or token ids (one array or a "
                    "list of them) where the model takes token ids.",
                    "oneOf": [
                        {"type": "string", "minLength": 1},
                        {
                            "type": "array",
                            "minItems": 1,
                            "maxItems": MAX_INPUTS,
                            "items": {"type": "string", "minLength": 1},
                        },
                        ids,
                        {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS, "items": ids},
                    ],
                },
                "encoding_format": {"type": "string", "enum": ["float", "base64"]},
                "dimensions": {"type": "integer", "minimum": 1},
                "user": {"type": "string"},
            },
        },
        "Embedding": {
            "type": "object",
            "required": ["object", "index", "embedding"],
            "properties": {
                "object": {"type": "string", "enum": ["embedding"]},
                "index": {"type": "integer", "minimum": 0},
                "embedding": {
                    "description": "float: the values; base64: their little-endian float32 "
                    "bytes, base64-encoded.",
                    "oneOf": [
                        {"type": "array", "items": {"type": "number", "nullable": True}},
                        {"type": "string"},
                    ],
                },
            },
        },
        "EmbeddingsResponse": {
            "type": "object",
            "required": ["object", "data", "model", "usage"],
            "properties": {
                "object": {"type": "string", "enum": ["list"]},
                "data": {"type": "array", "items": _ref("Embedding")},
                "model": {"type": "string"},
                "usage": {
                    "type": "object",
                    "required": ["prompt_tokens", "total_tokens"],
                    "properties": {
                        "prompt_tokens": {"type": "integer", "minimum": 0},
                        "total_tokens": {"type": "integer", "minimum": 0},
                    },
                },
            },
        },
        "OpenAIModel": {
            "type": "object",
            "required": ["id", "object", "created", "owned_by"],
            "properties": {
                "id": {"type": "string"},
                "object": {"type": "string", "enum": ["model"]},
                "created": {"type": "integer"},
                "owned_by": {"type": "string"},
            },
        },
        "OpenAIModelList": {
            "type": "object",
            "required": ["object", "data"],
            "properties": {
                "object": {"type": "string", "enum": ["list"]},
                "data": {"type": "array", "items": _ref("OpenAIModel")},
            },
        },
    }


def openai_responses() -> dict[str, Any]:
    """The error responses, by name."""
    responses: dict[str, Any] = {}
    for code, (name, description) in _ERRORS.items():
        schema: dict[str, Any] = _ref("OpenAIError")
        if code == "413":
            schema = {"oneOf": [_ref("OpenAIError"), _ref("Error")]}
        responses[name] = {"description": description, "content": {JSON: {"schema": schema}}}
    responses["OpenAITooManyRequests"]["headers"] = {
        "Retry-After": {"required": True, "schema": {"type": "string", "pattern": "^[0-9]+$"}}
    }
    responses["OpenAIUnauthorized"]["headers"] = {
        "WWW-Authenticate": {"required": True, "schema": {"type": "string"}}
    }
    return responses


def openai_paths() -> dict[str, Any]:
    """``/v1/embeddings``, ``/v1/models`` and ``/v1/models/{model}``."""
    model = {
        "name": "model",
        "in": "path",
        "required": True,
        "schema": {"type": "string"},
        "description": "A model serving embeddings.",
    }
    return {
        "/v1/embeddings": {
            "post": {
                "operationId": "openaiEmbeddings",
                "summary": "OpenAI-compatible embeddings, batched with V2 traffic.",
                "security": _TOKEN,
                "requestBody": {
                    "required": True,
                    "content": {
                        JSON: {
                            "schema": _ref("EmbeddingsRequest"),
                            "example": {"model": "text_embedding", "input": "Hello world."},
                        }
                    },
                },
                "responses": {
                    "200": {
                        "description": "One embedding per input, in input order, and the "
                        "tokens the model embedded.",
                        "headers": {
                            "x-queue-time-us": _TIME,
                            "x-compute-time-us": _TIME,
                            "x-total-time-us": _TIME,
                        },
                        "content": {JSON: {"schema": _ref("EmbeddingsResponse")}},
                    },
                    **_errors("400", "401", "404", "413", "429", "500", "503"),
                },
            }
        },
        "/v1/models": {
            "get": {
                "operationId": "openaiModels",
                "summary": "The models serving embeddings now.",
                "security": _TOKEN,
                "responses": {
                    "200": {
                        "description": "Models.",
                        "content": {JSON: {"schema": _ref("OpenAIModelList")}},
                    },
                    **_errors("401"),
                },
            }
        },
        "/v1/models/{model}": {
            "get": {
                "operationId": "openaiModel",
                "summary": "One model serving embeddings.",
                "security": _TOKEN,
                "parameters": [model],
                "responses": {
                    "200": {
                        "description": "The model.",
                        "content": {JSON: {"schema": _ref("OpenAIModel")}},
                    },
                    **_errors("401", "404", "503"),
                },
            }
        },
    }
