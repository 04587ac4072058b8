"""The Batch API's wire: input lines, ``POST /v1/batches`` bodies, and OpenAI's JSON of files,
batches and output lines.

Input line (one JSON object per line of the uploaded JSONL file)::

    {"custom_id": "request-1", "method": "POST", "url": "/v1/embeddings",
     "body": {"model": "text_embedding", "input": "..."}}

``custom_id`` is a non-empty string (at most :data:`MAX_CUSTOM_ID_CHARS` characters), unique in
the file; ``url`` is the batch's endpoint; ``body`` is what a live call to it would send.
Blank lines are skipped (and not counted).

Output line (one per input line, in the output file when the call answered 2xx, else in the
error file)::

    {"id": "batch_req_...", "custom_id": "request-1",
     "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}

A line that was never sent (malformed, or left when the batch expired) has ``"response":
null`` and ``"error": {"code", "message", "line"}`` (``line``: its 1-based line number).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import orjson

from gpuserve.server.batches.store import BatchRecord, FileRecord

#: The endpoints a batch may name.
ENDPOINTS = ("/v1/embeddings", "/v1/chat/completions", "/v1/completions", "/v1/rerank")
MAX_CUSTOM_ID_CHARS = 512
#: OpenAI's limits on ``metadata``.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
_WINDOW = re.compile(r"([1-9][0-9]{0,6})([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class WireError(ValueError):
    """A request the Batch API refuses (400), naming the field ``param``."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class BatchLine:
    """One valid input line.

    Attributes:
        number: 1-based line number in the file.
        custom_id: The client's id of the line.
        body: The request body to send.
    """

    number: int
    custom_id: str
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class BadLine:
    """One malformed input line.

    Attributes:
        number: 1-based line number in the file.
        custom_id: Its ``custom_id`` when it could be read, else None.
        message: What is wrong, naming the field.
    """

    number: int
    custom_id: str | None
    message: str


@dataclass(frozen=True, slots=True)
class CreateBatch:
    """A decoded ``POST /v1/batches`` body.

    Attributes:
        input_file_id: The uploaded file (not yet checked to exist).
        endpoint: One of :data:`ENDPOINTS`.
        completion_window: As given (``24h``).
        window_s: The window in seconds.
        metadata: Key-value pairs, or None.
    """

    input_file_id: str
    endpoint: str
    completion_window: str
    window_s: int
    metadata: dict[str, str] | None


# -- input lines -----------------------------------------------------------------------------


def read_lines(stream: BinaryIO) -> Iterator[tuple[int, bytes]]:
    """``(number, line)`` of every non-blank line of a JSONL file (1-based numbers)."""
    for number, raw in enumerate(stream, 1):
        if raw.strip():
            yield number, raw


def count_lines(data: bytes | bytearray | memoryview) -> int:
    """Non-blank lines in ``data``."""
    return sum(1 for raw in bytes(data).splitlines() if raw.strip())


def parse_line(raw: bytes, number: int, endpoint: str) -> BatchLine | BadLine:
    """One input line, checked (module docstring); never raises."""
    try:
        document = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        return BadLine(number, None, f"line {number} is not valid JSON: {err}")
    if type(document) is not dict:
        return BadLine(number, None, f"line {number} is not a JSON object")
    custom_id = document.get("custom_id")
    if type(custom_id) is not str or not custom_id:
        return BadLine(number, None, f"line {number}: 'custom_id' must be a non-empty string")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return BadLine(
            number, None, f"line {number}: 'custom_id' is longer than {MAX_CUSTOM_ID_CHARS}"
        )
    method = document.get("method", "POST")
    if method != "POST":
        return BadLine(number, custom_id, f"line {number}: 'method' must be POST, got {method!r}")
    url = document.get("url")
    if url != endpoint:
        return BadLine(
            number,
            custom_id,
            f"line {number}: 'url' must be the batch's endpoint {endpoint}, got {url!r}",
        )
    body = document.get("body")
    if type(body) is not dict:
        return BadLine(number, custom_id, f"line {number}: 'body' must be a JSON object")
    return BatchLine(number, custom_id, body)


# -- POST /v1/batches ------------------------------------------------------------------------


def parse_window(text: object) -> int:
    """``completion_window`` in seconds: a count and a unit, ``24h``, ``30m``, ``7d``, ``90s``.

    Raises:
        WireError: another form.
    """
    match = _WINDOW.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise WireError(
            f"'completion_window' must be a duration such as '24h' (s, m, h or d), got {text!r}",
            "completion_window",
        )
    return int(match.group(1)) * _UNIT_S[match.group(2)]


def parse_create(document: dict[str, Any]) -> CreateBatch:
    """A ``POST /v1/batches`` body.

    Raises:
        WireError: a field is missing or wrong (message names it).
    """
    file_id = document.get("input_file_id")
    if type(file_id) is not str or not file_id:
        raise WireError("'input_file_id' is required: the id of an uploaded file", "input_file_id")
    endpoint = document.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise WireError(
            f"'endpoint' must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", "endpoint"
        )
    window = document.get("completion_window", "24h")
    window_s = parse_window(window)
    metadata = document.get("metadata")
    if metadata is not None:
        metadata = _metadata(metadata)
    return CreateBatch(file_id, str(endpoint), str(window), window_s, metadata)


def _metadata(value: object) -> dict[str, str]:
    if type(value) is not dict:
        raise WireError("'metadata' must be an object of strings", "metadata")
    if len(value) > MAX_METADATA_PAIRS:
        raise WireError(f"'metadata' has more than {MAX_METADATA_PAIRS} pairs", "metadata")
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY_CHARS or type(item) is not str:
            raise WireError(
                f"'metadata' keys are at most {MAX_METADATA_KEY_CHARS} characters and values "
                f"strings (key {key[:80]!r})",
                "metadata",
            )
        if len(item) > MAX_METADATA_VALUE_CHARS:
            raise WireError(
                f"'metadata.{key}' is longer than {MAX_METADATA_VALUE_CHARS} characters",
                "metadata",
            )
    return dict(value)


# -- output lines ----------------------------------------------------------------------------


def line_id() -> str:
    """A fresh ``batch_req_...`` id of one output line."""
    return "batch_req_" + secrets.token_hex(12)


def answered_line(custom_id: str, status: int, body: bytes) -> bytes:
    """The output line of a call that answered ``status`` with the JSON ``body`` (bytes of
    one JSON value, embedded as is), newline-terminated."""
    # the body is already JSON: spliced in, not parsed and dumped again
    prefix = orjson.dumps({"id": line_id(), "custom_id": custom_id})[:-1]
    request_id = "req_" + secrets.token_hex(12)
    response = orjson.dumps({"status_code": status, "request_id": request_id})[:-1]
    return prefix + b',"response":' + response + b',"body":' + bytes(body) + b'},"error":null}\n'


def unsent_line(custom_id: str | None, code: str, message: str, number: int) -> bytes:
    """The error line of a line that was never sent (malformed, expired), newline-terminated."""
    error = {"code": code, "message": message, "line": number}
    line = {"id": line_id(), "custom_id": custom_id, "response": None, "error": error}
    return orjson.dumps(line) + b"\n"


# -- objects ---------------------------------------------------------------------------------


def file_object(record: FileRecord) -> dict[str, Any]:
    """OpenAI's File object."""
    return {
        "id": record.id,
        "object": "file",
        "bytes": record.bytes,
        "created_at": record.created_at,
        "expires_at": record.expires_at,
        "filename": record.filename,
        "purpose": record.purpose,
        "status": "processed",
        "status_details": None,
    }


def batch_object(record: BatchRecord) -> dict[str, Any]:
    """OpenAI's Batch object (the output file ids once the batch is final and they hold a
    line)."""
    final = record.final
    errors = None
    if record.errors:
        errors = {"object": "list", "data": record.errors}
    return {
        "id": record.id,
        "object": "batch",
        "endpoint": record.endpoint,
        "model": record.model,
        "errors": errors,
        "input_file_id": record.input_file_id,
        "completion_window": record.completion_window,
        "status": record.status,
        "output_file_id": record.output_file_id if final and record.output_bytes else None,
        "error_file_id": record.error_file_id if final and record.error_bytes else None,
        "created_at": record.created_at,
        "in_progress_at": record.in_progress_at,
        "expires_at": record.expires_at,
        "finalizing_at": record.finalizing_at,
        "completed_at": record.completed_at,
        "failed_at": record.failed_at,
        "expired_at": record.expired_at,
        "cancelling_at": record.cancelling_at,
        "cancelled_at": record.cancelled_at,
        "request_counts": {
            "total": record.total,
            "completed": record.completed,
            "failed": record.failed,
        },
        "metadata": record.metadata,
    }


def page(items: list[dict[str, Any]], has_more: bool, **extra: Any) -> bytes:
    """OpenAI's list object: ``{object, data, first_id, last_id, has_more}``."""
    return orjson.dumps(
        {
            "object": "list",
            "data": items,
            "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None,
            "has_more": has_more,
            **extra,
        }
    )
