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

The endpoints are the rows of :meth:`BatchApi.routes`; a path below a file or batch that no
row takes is that object's 404, a method no row of the path takes 405 (an unknown id's 404
first).

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
from gpuserve.server.batches.store import BatchRecord, FileRecord
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
from gpuserve.server.http.routes import (
    DELETE,
    GET,
    POST,
    Answer,
    Exact,
    Params,
    Route,
    Router,
    Template,
    methods_text,
)
from gpuserve.service.outcome import AccessRecord, log_access

logger = logging.getLogger(__name__)

Spawn = Callable[[Coroutine[Any, Any, None]], None]

FILES = "/v1/files"
BATCHES = "/v1/batches"
#: Most items of one page of ``GET /v1/batches`` / ``GET /v1/files``.
MAX_BATCH_PAGE = 100
MAX_FILE_PAGE = 10_000


class BatchApi:
    """The endpoints of the module docstring.

    Args:
        jobs: The batch runner (and its store).
        access_log: Write one access line per answer.
        spawn: Runs a coroutine as a task the HTTP front end keeps until it is done.
    """

    def __init__(self, jobs: BatchJobs, access_log: bool, spawn: Spawn) -> None:
        self.jobs = jobs
        self.access_log = access_log
        self._spawn = spawn
        #: The table the OpenAI API mounts at ``/v1/files`` and ``/v1/batches`` (under its
        #: auth; the paths without their trailing "/"s).
        self.router = Router(self.routes, self._miss, fail=self._fail, strip=True)

    def routes(self) -> list[Route]:
        """The endpoints, one row each."""
        return [
            Route(POST, Exact(FILES), self._upload_route),
            Route(GET, Exact(FILES), self._list_files),
            Route(GET, Template(FILES + "/{file_id}"), self._file),
            Route(DELETE, Template(FILES + "/{file_id}"), self._delete_file),
            Route(GET, Template(FILES + "/{file_id}/content"), self._content_route),
            Route(POST, Exact(BATCHES), self._create),
            Route(GET, Exact(BATCHES), self._list_batches),
            Route(GET, Template(BATCHES + "/{batch_id}"), self._batch),
            Route(POST, Template(BATCHES + "/{batch_id}/cancel"), self._cancel),
        ]

    def _miss(
        self, request: HttpRequest, method: str, path: str, allowed: frozenset[str] | None
    ) -> Answer:
        """Below a file or batch, an unknown id (or path) is "no such object", whatever
        the method; another method of a known one, or of the lists, is 405."""
        parts = path.split("/")  # ['', 'v1', 'files' | 'batches', id, ...]
        if parts[2] == "batches" or len(parts) > 3:
            self.jobs.store()  # 503 while shutting down, before the rest
        if len(parts) > 3:
            if parts[2] == "files":
                self._file_record(parts[3])
            else:
                self._batch_record(parts[3])
            if allowed is None:  # a known id, an unknown path below it
                kind = "File" if parts[2] == "files" else "Batch"
                code = "file_not_found" if parts[2] == "files" else "batch_not_found"
                raise OpenAIHttpError(404, f"No such {kind} object: {parts[3]}", code=code)
        assert allowed is not None  # each list has rows
        raise _method(method, request.path, methods_text(allowed))

    def _file_record(self, text: str) -> FileRecord:
        """The stored file of id ``text``; 404 when there is none."""
        file_id = checked_file_id(text)
        record = self.jobs.store().file(file_id) if file_id is not None else None
        if record is None:
            raise OpenAIHttpError(404, f"No such File object: {text}", code="file_not_found")
        return record

    def _batch_record(self, text: str) -> BatchRecord:
        """The batch of id ``text``; 404 when there is none."""
        batch_id = checked_batch_id(text)
        record = self.jobs.store().batch(batch_id) if batch_id is not None else None
        if record is None:
            raise OpenAIHttpError(404, f"No such Batch object: {text}", code="batch_not_found")
        return record

    # -- files -----------------------------------------------------------------------------

    def _upload_route(self, request: HttpRequest, _method: str, _: Params) -> Answer:
        self._spawn(self._upload(request))
        return None

    def _file(self, request: HttpRequest, _method: str, params: Params) -> Answer:
        record = self._file_record(params[0])
        self._send(request, 200, orjson.dumps(file_object(record)))
        return None

    def _delete_file(self, request: HttpRequest, _method: str, params: Params) -> Answer:
        record = self._file_record(params[0])
        store = self.jobs.store()
        users = store.file_users(record.id)
        if users:
            raise InvalidInputError(
                f"file {record.id} is the input of batch {users[0]}, which is not "
                "finished: cancel it first"
            )
        self.jobs.state.file(record.id).unlink(missing_ok=True)
        store.delete_file(record.id)
        self.jobs.refresh_storage()
        self._send(request, 200, orjson.dumps({"id": record.id, "object": "file", "deleted": True}))
        return None

    def _content_route(self, request: HttpRequest, _method: str, params: Params) -> Answer:
        self._spawn(self._content(request, self._file_record(params[0])))
        return None

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

    def _list_files(self, request: HttpRequest, _method: str, _: Params) -> Answer:
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
        return None

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

    def _list_batches(self, request: HttpRequest, _method: str, _: Params) -> Answer:
        store = self.jobs.store()
        query = _query(request)
        limit = _limit(query, 20, MAX_BATCH_PAGE)
        records, more = store.batches(query.get("after"), limit)
        self._send(request, 200, page([batch_object(r) for r in records], more))
        return None

    def _batch(self, request: HttpRequest, _method: str, params: Params) -> Answer:
        self.jobs.store()  # 503 while shutting down, before the id's 404
        record = self._batch_record(params[0])
        self._send(request, 200, orjson.dumps(batch_object(record)))
        return None

    def _cancel(self, request: HttpRequest, _method: str, params: Params) -> Answer:
        self.jobs.store()
        record = self._batch_record(params[0])
        if record.status not in ("validating", "in_progress", "cancelling", "cancelled"):
            raise InvalidInputError(
                f"batch {record.id} is {record.status}: only a validating or in_progress "
                "batch can be cancelled"
            )
        record = self.jobs.cancel(record.id) or record
        self._send(request, 200, orjson.dumps(batch_object(record)))
        return None

    def _create(self, request: HttpRequest, _method: str, _: Params) -> Answer:
        self.jobs.store()  # 503 while shutting down, before the body's 400
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
        return None

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
