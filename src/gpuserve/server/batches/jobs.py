"""The batch runner: validates, runs, cancels, expires and finalises batches, resumes them after
a restart, and keeps the state directory's storage bounded.

A batch goes ``validating`` -> ``in_progress`` -> ``finalizing`` -> ``completed`` (or
``expired`` when its completion window passes first), or ``cancelling`` -> ``cancelled``, or
``failed`` (its input cannot be used at all: missing, repeated ``custom_id`` s).

* **Validating** reads the input file once (on a worker thread), counts its lines and writes
  every malformed one to the error file with its line number; the rest run.
* **Running**: at most ``batch_concurrent_lines`` lines at once over all batches (one
  semaphore), each through :class:`~gpuserve.server.batches.lines.LineRunner`. A refusal that
  may pass (queue full, model loading) is tried again with back-off; any other answer is the
  line's result.
* **Exactly once**: a line's result is written at the committed length of the partial output
  (or error) file, then committed with its (batch, line) and (batch, custom_id) key and the new
  length in one transaction (:meth:`JobStore.record_line`); all of it on the event loop, with
  no await in between. After SIGKILL the restart cuts the partial files to their committed
  lengths and runs the lines without a key, so every ``custom_id`` is in the output once.
* **Stopping** (SIGTERM, :meth:`BatchJobs.begin_stop`): no line starts; lines in flight finish
  within the shutdown timeout and are recorded if they succeeded (a failure while stopping may
  be the shutdown's own 503: not recorded, the line runs again); the batch stays
  ``in_progress`` and resumes at the next start.
* **One runner per batch**: the process that holds the batch's lock file runs it, so several
  servers may share a state directory; a batch whose process died is taken over at the next
  sweep.
* **Storage**: every file expires ``batch_file_ttl_s`` after it was written (never while an
  unfinished batch reads it), and a final batch's record as long after it ended.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpuserve.errors import UnavailableError
from gpuserve.server.batches.input_scan import open_at, scan_input
from gpuserve.server.batches.lines import LineAnswer, LineRunner
from gpuserve.server.batches.state import JobLock, StateDir, new_id
from gpuserve.server.batches.store import UNFINISHED, BatchRecord, FileRecord, JobStore
from gpuserve.server.batches.wire import (
    BadLine,
    BatchLine,
    CreateBatch,
    answered_line,
    parse_line,
    read_lines,
    unsent_line,
)

logger = logging.getLogger(__name__)

#: A transient refusal is tried this many more times, waiting twice as long each time.
RETRIES = 6
FIRST_RETRY_S = 0.25
#: How often a running batch looks in the store for a cancel made by another process, s.
STATUS_POLL_S = 1.0
#: Most seconds between two storage sweeps (expiry, orphaned batches).
SWEEP_MAX_S = 60.0

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """The Batch API's limits (from :class:`~gpuserve.config.ServerConfig`).

    Attributes:
        max_file_bytes: Largest upload, bytes.
        max_lines: Most lines in one uploaded file.
        concurrent_lines: Lines in flight at once, all batches together.
        file_ttl_s: Seconds a file is kept after it was written.
        max_storage_bytes: Most bytes the stored files may hold (0: no limit).
    """

    max_file_bytes: int
    max_lines: int
    concurrent_lines: int
    file_ttl_s: float
    max_storage_bytes: int


class _Job:
    """A batch this process runs: its lock, its committed lengths and its stop flags."""

    def __init__(self, batch_id: str, lock: JobLock) -> None:
        self.id = batch_id
        self.lock = lock
        self.cancelled = False
        self.broken = False  # a result could not be committed: stop, run again later
        self.output_bytes = 0
        self.error_bytes = 0
        self.done: set[int] = set()
        self.output_fd: int | None = None
        self.error_fd: int | None = None
        self.task: asyncio.Task[None] | None = None

    def close_files(self) -> None:
        for fd in (self.output_fd, self.error_fd):
            if fd is not None:
                os.close(fd)
        self.output_fd = self.error_fd = None


class BatchJobs:
    """The batches of one state directory (module docstring).

    Args:
        state: The state directory (created at first use).
        limits: The limits.
        lines: Runs one line.
        clock: Unix time, seconds (tests pass a fake).
    """

    def __init__(
        self, state: StateDir, limits: BatchLimits, lines: LineRunner, clock: Clock = time.time
    ) -> None:
        self.state = state
        self.limits = limits
        self.lines = lines
        self.clock = clock
        self._store: JobStore | None = None
        self._jobs: dict[str, _Job] = {}
        self._slots = asyncio.Semaphore(limits.concurrent_lines)
        self._ready = asyncio.Event()
        self._stopping = False
        self._abandoned = False
        self._closed = False
        self._sweeper: asyncio.Task[None] | None = None
        #: Bytes stored now (files and committed partial outputs), for the storage gauge.
        self.storage_bytes = 0

    # -- life cycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Begin running batches (call on the event loop once the models are loaded):
        resume the unfinished batches of an existing store, then sweep periodically."""
        if self._ready.is_set() or self._stopping:
            return
        self._ready.set()
        if self._store is None and self.state.exists():
            try:
                self._open()
            except UnavailableError as err:
                logger.error("batch API: %s", err.message)
                return
        self._start_sweeper()

    def begin_stop(self) -> None:
        """Start no more lines (SIGTERM); running batches stay in progress for the next
        start."""
        self._stopping = True
        self._ready.set()  # batches waiting for the models to load end at once

    async def close(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the lines in flight, drop the rest (they run again
        at the next start), and close the store."""
        self.begin_stop()
        if self._sweeper is not None:
            self._sweeper.cancel()
        tasks = [job.task for job in self._jobs.values() if job.task is not None]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=timeout_s)
            if late:
                logger.warning("batch API: %d batches still had lines running: dropped", len(late))
                self._abandoned = True
                for task in late:
                    task.cancel()
                await asyncio.wait(late)
        self._closed = True
        if self._store is not None:
            self._store.close()
            self._store = None

    def store(self) -> JobStore:
        """The job store, created with the state directory at first use.

        Raises:
            UnavailableError: the state directory cannot be created or opened (503).
        """
        if self._stopping:
            raise UnavailableError("the server is shutting down; retry")
        return self._open()

    def _open(self) -> JobStore:
        """:meth:`store`, also while stopping (lines in flight still commit)."""
        if self._closed:
            raise UnavailableError("the server is shutting down; retry")
        if self._store is None:
            try:
                self.state.create()
                self._store = JobStore(self.state.database)
            except (OSError, sqlite3.Error) as err:
                logger.error("batch API: cannot use state directory %s: %s", self.state.root, err)
                raise UnavailableError(
                    "the batch API's state directory cannot be used (see the server log)"
                ) from None
            logger.info("batch API: state in %s", self.state.root)
            self.storage_bytes = self._store.stored_bytes()
            if self._ready.is_set():
                self._start_sweeper()
        return self._store

    def _start_sweeper(self) -> None:
        if self._sweeper is None and self._store is not None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    # -- commands from the API -------------------------------------------------------------

    def create(self, request: CreateBatch, input_file: FileRecord) -> BatchRecord:
        """Store a new batch of ``input_file`` and start it."""
        store = self.store()
        now = int(self.clock())
        record = BatchRecord(
            id=new_id("batch_"),
            endpoint=request.endpoint,
            input_file_id=input_file.id,
            completion_window=request.completion_window,
            status="validating",
            created_at=now,
            expires_at=now + request.window_s,
            output_file_id=new_id("file-"),
            error_file_id=new_id("file-"),
            total=input_file.lines,
            metadata=request.metadata,
        )
        store.add_batch(record)
        logger.info(
            "batch %s: %d lines to %s from %s",
            record.id,
            record.total,
            record.endpoint,
            input_file.id,
        )
        self._launch(record.id)
        return record

    def cancel(self, batch_id: str) -> BatchRecord | None:
        """Ask batch ``batch_id`` to stop: lines in flight finish, the rest are not sent.

        Returns:
            The batch now (``cancelling``, or as it was when it cannot be cancelled), or
            None when there is no such batch.
        """
        store = self.store()
        if store.update(
            batch_id,
            ("validating", "in_progress"),
            status="cancelling",
            cancelling_at=int(self.clock()),
        ):
            job = self._jobs.get(batch_id)
            if job is not None:
                job.cancelled = True
            logger.info("batch %s: cancelling", batch_id)
        return store.batch(batch_id)

    def refresh_storage(self) -> int:
        """Bytes stored now (also kept in :attr:`storage_bytes`)."""
        self.storage_bytes = self.store().stored_bytes()
        return self.storage_bytes

    # -- running ---------------------------------------------------------------------------

    def _launch(self, batch_id: str) -> None:
        """Run batch ``batch_id`` here unless another process (or task) does."""
        if batch_id in self._jobs or self._stopping:
            return
        lock = self.state.lock(batch_id)
        if lock is None:
            return  # another server runs it
        job = _Job(batch_id, lock)
        self._jobs[batch_id] = job
        job.task = asyncio.get_running_loop().create_task(self._run(job))

    async def _run(self, job: _Job) -> None:
        final = False
        try:
            await self._ready.wait()
            if self._stopping:
                return
            store = self._open()
            record = store.batch(job.id)  # read again under the lock
            if record is None or record.final:
                final = True
                return
            if record.status == "validating":
                record = await self._validate(job, record)
            if record.status == "in_progress":
                record = await self._execute(job, record)
            if self._stopping or record.status not in ("finalizing", "cancelling"):
                return  # stopped (resumes later), or final
            final = self._finalize(job, record)
        except asyncio.CancelledError:
            raise
        except FileNotFoundError as err:  # the input file was removed from the disk
            logger.error("batch %s: failed: %s", job.id, err)
            missing = {"code": "missing_input_file", "message": "the input file is gone"}
            self._open().update(
                job.id,
                UNFINISHED,
                status="failed",
                failed_at=int(self.clock()),
                errors=[{**missing, "line": None}],
            )
            final = True
        except Exception:
            logger.exception("batch %s: failed; it runs again at the next sweep", job.id)
        finally:
            job.close_files()
            job.lock.release(remove=final)
            self._jobs.pop(job.id, None)

    def _path(self, file_id: str) -> Path:
        return self.state.file(file_id)

    async def _validate(self, job: _Job, record: BatchRecord) -> BatchRecord:
        """Read the input once: fail the batch when it cannot run, else record its
        malformed lines and go in progress."""
        store = self._open()
        path = self._path(record.input_file_id)
        loop = asyncio.get_running_loop()
        try:
            scan = await loop.run_in_executor(None, scan_input, path, record.endpoint)
        except FileNotFoundError:
            scan = None
        now = int(self.clock())
        if scan is None or scan.repeated:
            errors = (
                [{"code": "missing_input_file", "message": "the input file is gone", "line": None}]
                if scan is None
                else scan.repeated
            )
            store.update(job.id, ("validating",), status="failed", failed_at=now, errors=errors)
            logger.info("batch %s: failed validation (%s)", job.id, errors[0]["message"])
            return store.batch(job.id) or record
        self._open_partials(job, record)
        job.done = store.done_lines(job.id)
        bad = [line for line in scan.bad if line.number not in job.done]
        if bad:
            chunk = b"".join(
                unsent_line(line.custom_id, "invalid_request", line.message, line.number)
                for line in bad
            )
            assert job.error_fd is not None
            os.pwrite(job.error_fd, chunk, job.error_bytes)
            lengths = (job.output_bytes, job.error_bytes + len(chunk))
            store.record_lines(job.id, [(b.number, b.custom_id, False) for b in bad], *lengths)
            job.error_bytes = lengths[1]
            job.done.update(b.number for b in bad)
        store.update(
            job.id,
            ("validating",),
            status="in_progress",
            in_progress_at=now,
            total=scan.total,
            model=scan.model,
        )
        return store.batch(job.id) or record

    def _open_partials(self, job: _Job, record: BatchRecord) -> None:
        """Open the partial output and error files at their committed lengths."""
        if job.output_fd is not None:
            return
        folder = self.state.partial(job.id, "output.jsonl").parent
        folder.mkdir(mode=0o700, exist_ok=True)
        job.output_bytes, job.error_bytes = record.output_bytes, record.error_bytes
        job.output_fd = open_at(self.state.partial(job.id, "output.jsonl"), record.output_bytes)
        job.error_fd = open_at(self.state.partial(job.id, "errors.jsonl"), record.error_bytes)

    async def _execute(self, job: _Job, record: BatchRecord) -> BatchRecord:
        """Send every line without a result, at most ``concurrent_lines`` at once; returns
        the batch as it is when its lines are done, or when it stopped."""
        store = self._open()
        self._open_partials(job, record)
        job.done = store.done_lines(job.id)
        running: set[asyncio.Task[None]] = set()
        checked = time.monotonic()
        deadline = record.expires_at
        try:
            with self._path(record.input_file_id).open("rb") as stream:
                for number, raw in read_lines(stream):
                    if number in job.done:
                        continue
                    if time.monotonic() - checked > STATUS_POLL_S:
                        checked = time.monotonic()
                        self._poll_cancel(job)
                    if self._stopped(job, deadline):
                        break
                    await self._slots.acquire()
                    if self._stopped(job, deadline):
                        self._slots.release()
                        break
                    line = parse_line(raw, number, record.endpoint)
                    if isinstance(line, BadLine):  # validated before: only a changed file
                        self._slots.release()
                        self._commit(job, line.number, line.custom_id, None, line.message)
                        continue
                    task = asyncio.get_running_loop().create_task(
                        self._line(job, record.endpoint, line)
                    )
                    running.add(task)
                    task.add_done_callback(running.discard)
            if running:
                await asyncio.wait(set(running))
        finally:
            for task in running:
                task.cancel()
        record = store.batch(job.id) or record
        if self._stopping or job.broken or record.status != "in_progress":
            return record
        ending = "completed"
        if self.clock() >= deadline and self._expire_rest(job, record):
            ending = "expired"
        store.update(
            job.id,
            ("in_progress",),
            status="finalizing",
            finalizing_at=int(self.clock()),
            ending=ending,
        )
        return store.batch(job.id) or record

    def _stopped(self, job: _Job, deadline: int) -> bool:
        return self._stopping or job.cancelled or job.broken or self.clock() >= deadline

    def _poll_cancel(self, job: _Job) -> None:
        record = self._open().batch(job.id)
        if record is not None and record.status == "cancelling":
            job.cancelled = True

    async def _line(self, job: _Job, endpoint: str, line: BatchLine) -> None:
        """Run one line (trying a transient refusal again) and commit its result."""
        try:
            delay = FIRST_RETRY_S
            for attempt in range(RETRIES + 1):
                answer = await self.lines.run(endpoint, line.body, self._is_abandoned)
                if not answer.transient or attempt == RETRIES or self._stopping:
                    break
                await asyncio.sleep(delay)
                delay *= 2
            if self._stopping and not answer.ok:
                return  # maybe the shutdown's own refusal: the line runs again
            self._commit(job, line.number, line.custom_id, answer, None)
        except Exception:
            logger.exception("batch %s: line %d not recorded; the batch stops", job.id, line.number)
            job.broken = True  # it runs again at the next sweep, from its committed lines
        finally:
            self._slots.release()

    def _is_abandoned(self) -> bool:
        return self._abandoned

    def _commit(
        self,
        job: _Job,
        number: int,
        custom_id: str | None,
        answer: LineAnswer | None,
        malformed: str | None,
    ) -> None:
        """Write one line's result at the committed length and commit it with its key (no
        await: nothing else writes between the two)."""
        if answer is not None:
            assert custom_id is not None
            data = answered_line(custom_id, answer.status, answer.body)
            ok = answer.ok
        else:
            data = unsent_line(custom_id, "invalid_request", malformed or "", number)
            ok = False
        out, err = job.output_bytes, job.error_bytes
        fd = job.output_fd if ok else job.error_fd
        assert fd is not None
        os.pwrite(fd, data, out if ok else err)
        if ok:
            out += len(data)
        else:
            err += len(data)
        try:
            self._open().record_line(job.id, number, custom_id, ok, out, err)
        except sqlite3.IntegrityError:
            logger.error(
                "batch %s: line %d was already recorded: not written again", job.id, number
            )
            return
        job.output_bytes, job.error_bytes = out, err
        job.done.add(number)

    def _expire_rest(self, job: _Job, record: BatchRecord) -> int:
        """Write every line not yet done to the error file as ``batch_expired``; how many
        there were."""
        store = self._open()
        message = "This request could not be executed before the completion window expired."
        pending: list[tuple[int, str | None, bool]] = []
        chunk: list[bytes] = []
        expired = 0

        def flush() -> None:
            data = b"".join(chunk)
            assert job.error_fd is not None
            os.pwrite(job.error_fd, data, job.error_bytes)
            store.record_lines(job.id, pending, job.output_bytes, job.error_bytes + len(data))
            job.error_bytes += len(data)
            job.done.update(number for number, _, _ in pending)
            pending.clear()
            chunk.clear()

        with self._path(record.input_file_id).open("rb") as stream:
            for number, raw in read_lines(stream):
                if number in job.done:
                    continue
                line = parse_line(raw, number, record.endpoint)
                custom_id = line.custom_id
                chunk.append(unsent_line(custom_id, "batch_expired", message, number))
                pending.append((number, custom_id, False))
                expired += 1
                if len(pending) >= 1000:
                    flush()
        if pending:
            flush()
        if expired:
            logger.info("batch %s: expired with %d lines not sent", job.id, expired)
        return expired

    def _finalize(self, job: _Job, record: BatchRecord) -> bool:
        """Move the partial files (cut to their committed lengths) to stored files and make
        the batch final; whether it is final now."""
        store = self._open()
        job.close_files()
        ending = "cancelled" if record.status == "cancelling" else record.ending or "completed"
        now = int(self.clock())
        expires = int(now + self.limits.file_ttl_s)
        outputs = []
        for name, file_id, size, lines in (
            ("output.jsonl", record.output_file_id, record.output_bytes, record.completed),
            ("errors.jsonl", record.error_file_id, record.error_bytes, record.failed),
        ):
            if size == 0:
                continue
            partial, target = self.state.partial(job.id, name), self._path(file_id)
            if partial.exists():  # else moved before a crash
                os.truncate(partial, size)
                os.replace(partial, target)
            kind = "output" if name == "output.jsonl" else "error"
            outputs.append(
                FileRecord(
                    file_id, "batch_output", f"{job.id}_{kind}.jsonl", size, lines, now, expires
                )
            )
        if not store.finish(job.id, ending, now, outputs):
            return False
        shutil.rmtree(self.state.partial(job.id, "output.jsonl").parent, ignore_errors=True)
        self.storage_bytes = store.stored_bytes()
        logger.info(
            "batch %s: %s (%d completed, %d failed of %d)",
            job.id,
            ending,
            record.completed,
            record.failed,
            record.total,
        )
        return True

    # -- storage ---------------------------------------------------------------------------

    async def _sweep_forever(self) -> None:
        interval = min(SWEEP_MAX_S, max(0.05, self.limits.file_ttl_s / 10))
        while not self._stopping:
            try:
                self.sweep()
            except Exception:
                logger.exception("batch API: storage sweep failed")
            await asyncio.sleep(interval)

    def sweep(self) -> None:
        """Delete expired files and old final batches; run unfinished batches nobody runs
        (at start, and those of a process that died)."""
        store = self._open()
        now = self.clock()
        for record in store.expired_files(int(now)):
            self._path(record.id).unlink(missing_ok=True)
            store.delete_file(record.id)
            logger.info("batch API: file %s expired (%d bytes)", record.id, record.bytes)
        for batch_id in store.finished_before(int(now - self.limits.file_ttl_s)):
            store.delete_batch(batch_id)
        for batch in store.unfinished():
            self._launch(batch.id)
        self.storage_bytes = store.stored_bytes()
