"""The OpenAI Files and Batch endpoints, under the OpenAI API's ``/v1`` mount (its API token,
its error shape).

Endpoints::

    POST   /v1/files                  upload a JSONL file (multipart: purpose=batch, file)
    GET    /v1/files                  the stored files (purpose, after, limit, order) and
                                      ``total_bytes``: what the state directory holds
    GET    /v1/files/{id}             one file
    GET    /v1/files/{id}/content     its bytes
    DELETE /v1/files/{id}             delete it (not while an unfinished batch reads it)
    POST   /v1/batches                start a batch {input_file_id, endpoint, completion_window,
                                      metadata}
    GET    /v1/batches                the batches, newest first (after, limit)
    GET    /v1/batches/{id}           one batch: status and request_counts
    POST   /v1/batches/{id}/cancel    stop sending its lines

An upload larger than ``batch_max_file_bytes``, with more lines than ``batch_max_lines``, or
one the storage (``batch_max_storage_bytes``) has no room for is refused with 413 naming the
setting. An id that is not of the server's own form is "not found", like an unknown one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import orjson

from gpuserve.errors import InvalidInputError
from gpuserve.protocol.multipart import parse_form
from gpuserve.server.batches.jobs import BatchJobs
from gpuserve.server.batches.state import checked_batch_id, checked_file_id, new_id
from gpuserve.server.batches.store import FileRecord
from gpuserve.server.batches.wire import (
    WireError,
    batch_object,
    count_lines,
    file_object,
    page,
    parse_create,
)
from gpuserve.server.http.openai_errors import ErrorAnswer, OpenAIHttpError, error_answer
from gpuserve.server.http.request import HttpRequest, respond_json
from gpuserve.service.outcome import AccessRecord, log_access

logger = logging.getLogger(__name__)

Spawn = Callable[[Coroutine[Any, Any, None]], None]

FILES = "/v1/files"
BATCHES = "/v1/batches"
#: Most items of one page of ``GET /v1/batches`` / ``GET /v1/files``.
MAX_BATCH_PAGE = 100
MAX_FILE_PAGE = 10_000


def handles(path: str) -> bool:
    """Whether ``path`` (trailing ``/`` removed) is one of this API's."""
    return path in (FILES, BATCHES) or path.startswith((FILES + "/", BATCHES + "/"))


class BatchApi:
    """The endpoints of the module docstring.

    Args:
        jobs: The batch runner (and its store).
        access_log: Write one access line per answer.
    """

    def __init__(self, jobs: BatchJobs, access_log: bool) -> None:
        self.jobs = jobs
        self.access_log = access_log

    def handles(self, path: str) -> bool:
        """Whether ``path`` is one of this API's."""
        return handles(path)

    def handle(self, request: HttpRequest, method: str, path: str, spawn: Spawn) -> None:
        """Answer one request (``method``: HEAD as GET; ``path`` without a trailing ``/``),
        at once or from a task ``spawn`` runs. Never raises."""
        try:
            parts = path.split("/")[2:]  # ['files', id, 'content'] ...
            if parts[0] == "files":
                self._files(request, method, parts[1:], spawn)
            else:
                self._batches(request, method, parts[1:])
        except Exception as err:
            self._fail(request, err)

    # -- files -----------------------------------------------------------------------------

    def _files(self, request: HttpRequest, method: str, rest: list[str], spawn: Spawn) -> None:
        if not rest:
            if method == "POST":
                spawn(self._upload(request))
            elif method == "GET":
                self._list_files(request)
            else:
                raise _method(method, request.path, "GET or POST")
            return
        store = self.jobs.store()
        file_id = checked_file_id(rest[0])
        record = store.file(file_id) if file_id is not None else None
        if record is None or len(rest) > 2 or (len(rest) == 2 and rest[1] != "content"):
            raise OpenAIHttpError(404, f"No such File object: {rest[0]}", code="file_not_found")
        if len(rest) == 2:
            if method != "GET":
                raise _method(method, request.path, "GET")
            spawn(self._content(request, record))
        elif method == "GET":
            self._send(request, 200, orjson.dumps(file_object(record)))
        elif method == "DELETE":
            users = store.file_users(record.id)
            if users:
                raise InvalidInputError(
                    f"file {record.id} is the input of batch {users[0]}, which is not "
                    "finished: cancel it first"
                )
            self.jobs.state.file(record.id).unlink(missing_ok=True)
            store.delete_file(record.id)
            self.jobs.refresh_storage()
            self._send(
                request, 200, orjson.dumps({"id": record.id, "object": "file", "deleted": True})
            )
        else:
            raise _method(method, request.path, "GET or DELETE")

    async def _upload(self, request: HttpRequest) -> None:
        try:
            form = parse_form(request.body, request.header(b"content-type"))
            fields = {part.name: part for part in form}
            purpose = bytes(fields["purpose"].data).decode() if "purpose" in fields else None
            if purpose != "batch":
                raise InvalidInputError(
                    f"'purpose' must be 'batch' (the only purpose this server stores), got "
                    f"{purpose!r}"
                )
            part = fields.get("file")
            if part is None:
                raise InvalidInputError("the upload has no 'file' part")
            limits = self.jobs.limits
            size = len(part.data)
            if size > limits.max_file_bytes:
                raise OpenAIHttpError(
                    413,
                    f"the file has {size} bytes; batch_max_file_bytes is {limits.max_file_bytes}",
                    code="file_too_large",
                )
            loop = asyncio.get_running_loop()
            lines = await loop.run_in_executor(None, count_lines, part.data)
            if lines > limits.max_lines:
                raise OpenAIHttpError(
                    413,
                    f"the file has {lines} lines; batch_max_lines is {limits.max_lines}",
                    code="too_many_lines",
                )
            if lines == 0:
                raise InvalidInputError("the file has no lines: one JSON request per line")
            store = self.jobs.store()
            stored = self.jobs.refresh_storage()
            if limits.max_storage_bytes and stored + size > limits.max_storage_bytes:
                raise OpenAIHttpError(
                    413,
                    f"the state directory holds {stored} bytes; with this file's {size} it "
                    f"would pass batch_max_storage_bytes ({limits.max_storage_bytes}): delete "
                    "files or wait for them to expire",
                    code="storage_full",
                )
            file_id = new_id("file-")
            path = self.jobs.state.file(file_id)
            await loop.run_in_executor(None, _write, path, part.data)
            now = int(self.jobs.clock())
            record = FileRecord(
                file_id,
                "batch",
                _filename(part.filename),
                size,
                lines,
                now,
                int(now + limits.file_ttl_s),
            )
            store.add_file(record)
            self.jobs.storage_bytes += size
            logger.info("batch API: file %s stored (%d bytes, %d lines)", file_id, size, lines)
        except Exception as err:
            self._fail(request, err)
            return
        self._send(request, 200, orjson.dumps(file_object(record)))

    def _list_files(self, request: HttpRequest) -> None:
        query = _query(request)
        limit = _limit(query, MAX_FILE_PAGE, MAX_FILE_PAGE)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise WireError(f"'order' must be asc or desc, got {order!r}", "order")
        store = self.jobs.store()
        records, more = store.files(
            query.get("purpose"), query.get("after"), limit, order == "desc"
        )
        total = self.jobs.refresh_storage()
        payload = page([file_object(r) for r in records], more, total_bytes=total)
        self._send(request, 200, payload)

    async def _content(self, request: HttpRequest, record: FileRecord) -> None:
        try:
            path = self.jobs.state.file(record.id)
            data = await asyncio.get_running_loop().run_in_executor(None, path.read_bytes)
        except FileNotFoundError:
            self._fail(request, OpenAIHttpError(404, f"No such File object: {record.id}"))
            return
        except Exception as err:
            self._fail(request, err)
            return
        request.respond(200, data, b"application/octet-stream")
        self._log(request, 200, len(data))

    # -- batches ---------------------------------------------------------------------------

    def _batches(self, request: HttpRequest, method: str, rest: list[str]) -> None:
        store = self.jobs.store()
        if not rest:
            if method == "POST":
                self._create(request)
            elif method == "GET":
                query = _query(request)
                limit = _limit(query, 20, MAX_BATCH_PAGE)
                records, more = store.batches(query.get("after"), limit)
                self._send(request, 200, page([batch_object(r) for r in records], more))
            else:
                raise _method(method, request.path, "GET or POST")
            return
        batch_id = checked_batch_id(rest[0])
        record = store.batch(batch_id) if batch_id is not None else None
        if record is None or len(rest) > 2 or (len(rest) == 2 and rest[1] != "cancel"):
            raise OpenAIHttpError(404, f"No such Batch object: {rest[0]}", code="batch_not_found")
        if len(rest) == 2:
            if method != "POST":
                raise _method(method, request.path, "POST")
            if record.status not in ("validating", "in_progress", "cancelling", "cancelled"):
                raise InvalidInputError(
                    f"batch {record.id} is {record.status}: only a validating or in_progress "
                    "batch can be cancelled"
                )
            record = self.jobs.cancel(record.id) or record
        elif method != "GET":
            raise _method(method, request.path, "GET")
        self._send(request, 200, orjson.dumps(batch_object(record)))

    def _create(self, request: HttpRequest) -> None:
        try:
            document = orjson.loads(request.body)
        except orjson.JSONDecodeError as err:
            raise InvalidInputError(f"the request body is not valid JSON: {err}") from None
        if type(document) is not dict:
            raise InvalidInputError("the request body must be a JSON object")
        create = parse_create(document)
        file_id = checked_file_id(create.input_file_id)
        record = self.jobs.store().file(file_id) if file_id is not None else None
        if record is None:
            raise OpenAIHttpError(
                404, f"No such File object: {create.input_file_id}", code="file_not_found"
            )
        if record.purpose != "batch":
            raise WireError(
                f"file {record.id} has purpose {record.purpose!r}; a batch reads a file "
                "uploaded with purpose 'batch'",
                "input_file_id",
            )
        batch = self.jobs.create(create, record)
        self._send(request, 200, orjson.dumps(batch_object(batch)))

    # -- answers ---------------------------------------------------------------------------

    def _fail(self, request: HttpRequest, err: BaseException) -> None:
        if isinstance(err, WireError):
            answer = ErrorAnswer(400, err.message, "invalid_request_error", None, err.param)
        else:
            answer = error_answer(err)  # messages built here name no file paths
        self._send(request, answer.status, answer.body(), answer.headers)

    def _send(
        self,
        request: HttpRequest,
        status: int,
        payload: bytes,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        record = AccessRecord("", request.method, request.path, 0) if self.access_log else None
        respond_json(request, status, payload, headers or (), record)

    def _log(self, request: HttpRequest, status: int, size: int) -> None:
        if self.access_log:
            record = AccessRecord("", request.method, request.path, status, size=size)
            log_access(record)


def _method(method: str, path: str, allowed: str) -> OpenAIHttpError:
    return OpenAIHttpError(405, f"{method} {path}: use {allowed}", code="method_not_allowed")


def _query(request: HttpRequest) -> dict[str, str]:
    values = parse_qs(request.query.decode("latin-1"))
    return {key: items[-1] for key, items in values.items()}


def _limit(query: dict[str, str], default: int, most: int) -> int:
    text = query.get("limit")
    if text is None:
        return default
    try:
        limit = int(text)
    except ValueError:
        limit = 0
    if not 1 <= limit <= most:
        raise WireError(f"'limit' must be an integer from 1 to {most}, got {text!r}", "limit")
    return limit


def _filename(name: str | None) -> str:
    """The client's file name, without folders, at most 255 characters."""
    if not name:
        return "upload.jsonl"
    return name.replace("\\", "/").rsplit("/", 1)[-1][:255] or "upload.jsonl"


def _write(path: Path, data: memoryview) -> None:
    """Write an upload (worker thread): a temporary name, then renamed into place."""
    partial = path.with_name("." + path.name + ".part")
    with partial.open("wb") as stream:
        stream.write(data)
    partial.replace(path)
