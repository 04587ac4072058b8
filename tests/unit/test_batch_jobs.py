"""The Batch API's parts without a server: the job store's exactly-once key, the runner's
resume after a crash (bytes written past the committed length are cut), the bulk mark, the
line and multipart wires, and the state directory's id checks."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from gpuserve.config import ModelConfig
from gpuserve.errors import InvalidInputError, OverloadedError
from gpuserve.protocol.multipart import parse_form
from gpuserve.server.batches.bulk import BulkWire, mark_bulk
from gpuserve.server.batches.jobs import BatchJobs, BatchLimits
from gpuserve.server.batches.lines import LineAnswer
from gpuserve.server.batches.state import StateDir, checked_batch_id, checked_file_id
from gpuserve.server.batches.store import BatchRecord, FileRecord, JobStore
from gpuserve.server.batches.wire import (
    BadLine,
    BatchLine,
    answered_line,
    parse_line,
    parse_window,
)

LIMITS = BatchLimits(
    max_file_bytes=1 << 20,
    max_lines=1000,
    concurrent_lines=3,
    file_ttl_s=3600.0,
    max_storage_bytes=0,
)


class FakeLines:
    """Answers each line with its text back; holds every line after ``hold_after`` until
    ``release`` is set; refuses the first call of ``busy`` once as overloaded."""

    def __init__(self, hold_after: int | None = None, busy: str | None = None) -> None:
        self.calls: list[str] = []
        self.hold_after = hold_after
        self.release = asyncio.Event()
        self.busy = busy

    async def run(self, endpoint: str, body: dict[str, Any], is_gone: Any) -> LineAnswer:
        text = body["input"]
        self.calls.append(text)
        if text == self.busy:
            self.busy = None
            return LineAnswer(429, b'{"error":{}}', transient=True)
        if self.hold_after is not None and len(self.calls) > self.hold_after:
            await self.release.wait()
        if text == "fail":
            return LineAnswer(400, b'{"error":{"message":"no"}}')
        return LineAnswer(200, json.dumps({"echo": text}).encode())


def write_input(state: StateDir, store: JobStore, lines: list[str]) -> FileRecord:
    state.create()
    data = "".join(lines).encode()
    record = FileRecord("file-" + "1" * 24, "batch", "in.jsonl", len(data), len(lines), 0, None)
    state.file(record.id).write_bytes(data)
    store.add_file(record)
    return record


def lines_of(count: int, extra: list[str] | None = None) -> list[str]:
    out = [
        json.dumps({"custom_id": f"c{i}", "url": "/v1/embeddings", "body": {"input": f"t{i}"}})
        + "\n"
        for i in range(count)
    ]
    return out + (extra or [])


async def run_until(jobs: BatchJobs, batch_id: str, done: Any, deadline_s: float = 10.0) -> None:
    end = asyncio.get_running_loop().time() + deadline_s
    while not done(jobs.store().batch(batch_id)):
        assert asyncio.get_running_loop().time() < end, jobs.store().batch(batch_id)
        await asyncio.sleep(0.005)


def create(jobs: BatchJobs, record: FileRecord, window_s: int = 3600) -> str:
    from gpuserve.server.batches.wire import CreateBatch

    request = CreateBatch(record.id, "/v1/embeddings", "1h", window_s, None)
    return jobs.create(request, record).id


def test_a_killed_runner_resumes_and_each_line_is_written_once(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "state")

    async def first() -> str:
        lines = FakeLines(hold_after=5)
        jobs = BatchJobs(state, LIMITS, lines)  # type: ignore[arg-type]
        record = write_input(state, jobs.store(), lines_of(20, ["\n", "oops\n"]))
        jobs.start()
        batch_id = create(jobs, record)
        await run_until(jobs, batch_id, lambda b: b.completed >= 5)
        # the "kill": the process dies with lines in flight; bytes past the committed length
        job = jobs._jobs[batch_id]
        assert job.output_fd is not None
        with open(state.partial(batch_id, "output.jsonl"), "ab") as stream:
            stream.write(b'{"custom_id": "c0", "half a line')
        assert job.task is not None
        job.task.cancel()
        await asyncio.sleep(0)
        jobs._store.close()  # type: ignore[union-attr]
        return batch_id

    batch_id = asyncio.run(first())
    store = JobStore(state.database)
    stopped = store.batch(batch_id)
    assert stopped is not None and stopped.status == "in_progress"
    assert stopped.completed == 5 and stopped.failed == 1  # the malformed line, at validation
    store.close()

    async def second() -> BatchRecord:
        jobs = BatchJobs(state, LIMITS, FakeLines())  # type: ignore[arg-type]
        jobs.start()
        await run_until(jobs, batch_id, lambda b: b.final)
        record = jobs.store().batch(batch_id)
        await jobs.close(1.0)
        assert record is not None
        return record

    record = asyncio.run(second())
    assert record.status == "completed" and (record.completed, record.failed) == (20, 1)
    output = state.file(record.output_file_id).read_bytes().splitlines()
    ids = [json.loads(line)["custom_id"] for line in output]
    assert sorted(ids) == sorted(f"c{i}" for i in range(20))
    errors = [json.loads(x) for x in state.file(record.error_file_id).read_bytes().splitlines()]
    assert [(e["custom_id"], e["error"]["line"]) for e in errors] == [(None, 22)]
    assert not state.partial(batch_id, "output.jsonl").parent.exists()


def test_transient_refusals_are_tried_again_and_failures_recorded(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "state")

    async def main() -> BatchRecord:
        lines = FakeLines(busy="t1")
        jobs = BatchJobs(state, LIMITS, lines)  # type: ignore[arg-type]
        extra = [json.dumps({"custom_id": "f", "url": "/v1/embeddings", "body": {"input": "fail"}})]
        record = write_input(state, jobs.store(), lines_of(3, [extra[0] + "\n"]))
        jobs.start()
        batch_id = create(jobs, record)
        await run_until(jobs, batch_id, lambda b: b.final)
        assert lines.calls.count("t1") == 2
        result = jobs.store().batch(batch_id)
        await jobs.close(1.0)
        assert result is not None
        return result

    record = asyncio.run(main())
    assert (record.status, record.completed, record.failed) == ("completed", 3, 1)
    (error,) = [json.loads(x) for x in state.file(record.error_file_id).read_bytes().splitlines()]
    assert error["custom_id"] == "f" and error["response"]["status_code"] == 400


def test_the_store_keys_each_custom_id_once(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite3")
    batch = BatchRecord(
        "batch_" + "0" * 24,
        "/v1/embeddings",
        "file-x",
        "24h",
        "in_progress",
        0,
        10,
        "file-a",
        "file-b",
    )
    store.add_batch(batch)
    store.record_line(batch.id, 1, "a", True, 10, 0)
    with pytest.raises(sqlite3.IntegrityError):
        store.record_line(batch.id, 2, "a", True, 20, 0)
    with pytest.raises(sqlite3.IntegrityError):
        store.record_line(batch.id, 1, "b", True, 20, 0)
    after = store.batch(batch.id)
    assert after is not None and (after.completed, after.output_bytes) == (1, 10)
    assert store.done_lines(batch.id) == {1}
    assert not store.update(batch.id, ("validating",), status="failed")
    assert store.finish(batch.id, "completed", 5, [])
    assert not store.finish(batch.id, "cancelled", 6, [])
    assert store.done_lines(batch.id) == set()
    store.close()


def test_every_request_of_a_job_goes_to_the_bulk_lane() -> None:
    class Wire:
        def request_id(self) -> str | None:
            return "id"

        def decode(self, config: ModelConfig, name: str, version: str | None) -> Any:
            from gpuserve.engine.request import InferenceRequest

            return InferenceRequest(name, version, {})

    config = ModelConfig(name="m", backend="python", dynamic_batching={"priority_levels": 3})
    request = BulkWire(Wire()).decode(config, "m", None)
    assert request.lane == "bulk" and request.priority == 0  # its priority stays the caller's
    plain = Wire().decode(config, "m", None)
    assert plain.lane == "interactive"
    mark_bulk(plain, config)
    assert plain.lane == "bulk"


def test_lines_windows_and_answers() -> None:
    good = parse_line(b'{"custom_id": "a", "url": "/v1/rerank", "body": {}}', 1, "/v1/rerank")
    assert good == BatchLine(1, "a", {})
    for raw, message in [
        (b"[1]", "not a JSON object"),
        (b'{"custom_id": ""}', "custom_id"),
        (b'{"custom_id": "a", "url": "/v1/embeddings", "body": {}}', "endpoint"),
        (b'{"custom_id": "a", "url": "/v1/rerank", "method": "GET", "body": {}}', "POST"),
        (b'{"custom_id": "a", "url": "/v1/rerank", "body": []}', "body"),
    ]:
        bad = parse_line(raw, 7, "/v1/rerank")
        assert isinstance(bad, BadLine) and message in bad.message and "line 7" in bad.message
    assert parse_window("24h") == 86400 and parse_window("90s") == 90
    for window in ("0h", "24", "1w", 24):
        with pytest.raises(ValueError, match="completion_window"):
            parse_window(window)
    line = json.loads(answered_line("x", 200, b'{"a": [1, 2]}'))
    assert line["response"]["body"] == {"a": [1, 2]} and line["error"] is None


def test_multipart_form_and_ids() -> None:
    body = (
        b'--XyZ\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n'
        b"Content-Type: application/octet-stream\r\n\r\n{}\r\n{}\r\n--XyZ--\r\n"
    )
    parts = parse_form(body, b"multipart/form-data; boundary=XyZ")
    assert [(p.name, p.filename, bytes(p.data)) for p in parts] == [
        ("purpose", None, b"batch"),
        ("file", "a.jsonl", b"{}\r\n{}"),
    ]
    with pytest.raises(InvalidInputError):
        parse_form(body, b"application/json")
    with pytest.raises(InvalidInputError):
        parse_form(body[:60], b"multipart/form-data; boundary=XyZ")
    assert checked_file_id("file-" + "a" * 24) and checked_batch_id("batch_" + "0" * 24)
    for bad in ("file-../../x", "file-" + "A" * 24, "file-" + "a" * 25, "../jobs.sqlite3"):
        assert checked_file_id(bad) is None
    with pytest.raises(ValueError):
        StateDir(Path("/tmp")).file("../etc/passwd")
    assert OverloadedError  # a transient refusal (see FakeLines)
