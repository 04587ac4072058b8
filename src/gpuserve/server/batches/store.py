"""The Batch API's job store: files and batches in SQLite (the standard library's ``sqlite3``,
WAL mode), with the key that makes each line's result count exactly once.

Tables::

    files    one row per stored file (uploads and the outputs of finished batches)
    batches  one row per batch: status, timestamps, request counts, and the committed length
             of its partial output and error files
    lines    one row per input line whose result is written: (batch, line) and
             (batch, custom_id) are unique

Each line's result is committed with :meth:`JobStore.record_line`, which inserts the line's
key and advances the batch's counts and committed file lengths in one transaction: a line is
either done (its key, its bytes and its count) or not done at all. The runner writes the line's
bytes at the committed length before it commits, so bytes a killed process wrote past the
committed length are overwritten, and cut when the batch is finalised.

WAL with ``synchronous=NORMAL``: a commit survives the process being killed (the operating
system holds the write); only a power loss may take the last commits back, and then their
lines run again. Several processes may share one store (``busy_timeout``); which one runs a
batch is decided by the runner's lock files, not here.

Every method runs on the caller's thread and returns at once (small transactions on a local
file); the store knows nothing of HTTP, asyncio or the file contents.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import orjson

#: Statuses after which a batch never changes again.
FINAL = ("completed", "failed", "expired", "cancelled")
#: Statuses of a batch the runner still has work for.
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    lines INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    output_file_id TEXT NOT NULL,
    error_file_id TEXT NOT NULL,
    in_progress_at INTEGER,
    finalizing_at INTEGER,
    completed_at INTEGER,
    failed_at INTEGER,
    expired_at INTEGER,
    cancelling_at INTEGER,
    cancelled_at INTEGER,
    total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    output_bytes INTEGER NOT NULL DEFAULT 0,
    error_bytes INTEGER NOT NULL DEFAULT 0,
    model TEXT,
    errors TEXT,
    metadata TEXT,
    ending TEXT
);
CREATE INDEX IF NOT EXISTS batches_status ON batches (status);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    custom_id TEXT,
    ok INTEGER NOT NULL,
    PRIMARY KEY (batch_id, line),
    UNIQUE (batch_id, custom_id)
);
"""


@dataclass(slots=True)
class FileRecord:
    """One stored file.

    Attributes:
        id: ``file-`` and 24 hex digits (the server makes it; it names the file on disk).
        purpose: ``batch`` (uploads), ``batch_output`` (outputs and errors of a batch).
        filename: The name the client gave, or ``<batch id>_output.jsonl``.
        bytes: Size, bytes.
        lines: Non-blank lines.
        created_at / expires_at: Unix seconds; ``expires_at`` None: never.
    """

    id: str
    purpose: str
    filename: str
    bytes: int
    lines: int
    created_at: int
    expires_at: int | None


@dataclass(slots=True)
class BatchRecord:
    """One batch, as stored.

    Attributes:
        id: ``batch_`` and 24 hex digits.
        endpoint: The path every line goes to (``/v1/embeddings``, ...).
        input_file_id: The uploaded JSONL file.
        completion_window: As given (``24h``).
        status: OpenAI's: validating, in_progress, finalizing, completed, failed, expired,
            cancelling, cancelled.
        created_at / expires_at: Unix seconds; ``expires_at`` is the completion deadline.
        output_file_id / error_file_id: The ids the outputs will have (chosen at creation;
            shown once the batch is final and the file holds a line).
        in_progress_at ... cancelled_at: When the batch entered each status, Unix seconds.
        total / completed / failed: Lines in the input; lines answered 2xx; lines that
            failed (malformed, refused, failed, expired).
        output_bytes / error_bytes: Committed length of the partial output and error files.
        model: The model the first valid line names, or None.
        errors: Why the batch failed as a whole: ``[{code, message, line}]``, or None.
        metadata: The client's key-value pairs, or None.
        ending: The final status a ``finalizing`` batch goes to (completed, expired).
    """

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    expires_at: int
    output_file_id: str
    error_file_id: str
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    output_bytes: int = 0
    error_bytes: int = 0
    model: str | None = None
    errors: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None = None
    ending: str | None = None

    @property
    def final(self) -> bool:
        """Whether the batch will never change again."""
        return self.status in FINAL


_BATCH_COLUMNS = [f.name for f in fields(BatchRecord)]
_IN_UNFINISHED = "(" + ", ".join(f"'{s}'" for s in UNFINISHED) + ")"
_IN_FINAL = "(" + ", ".join(f"'{s}'" for s in FINAL) + ")"
_FILE_COLUMNS = [f.name for f in fields(FileRecord)]
_JSON_COLUMNS = ("errors", "metadata")


class JobStore:
    """The SQLite store of one state directory (module docstring).

    Args:
        path: The database file (created with its tables when missing).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        # autocommit mode: every multi-statement change is an explicit BEGIN IMMEDIATE
        self._db = sqlite3.connect(path, isolation_level=None, timeout=5.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        """Close the database (a later call fails)."""
        self._db.close()

    # -- files -----------------------------------------------------------------------------

    def add_file(self, record: FileRecord) -> None:
        """Store a new file's record (its bytes are already on disk)."""
        self._insert("files", _FILE_COLUMNS, [getattr(record, n) for n in _FILE_COLUMNS])

    def file(self, file_id: str) -> FileRecord | None:
        """The file ``file_id``, or None."""
        row = self._db.execute(
            f"SELECT {', '.join(_FILE_COLUMNS)} FROM files WHERE id = ?", (file_id,)
        ).fetchone()
        return None if row is None else FileRecord(*row)

    def files(
        self, purpose: str | None, after: str | None, limit: int, newest_first: bool
    ) -> tuple[list[FileRecord], bool]:
        """A page of files in upload order (or its reverse), after the file ``after``.

        Returns:
            Up to ``limit`` records, and whether more follow.
        """
        where, args = self._page("files", after, newest_first)
        if purpose is not None:
            where.append("purpose = ?")
            args.append(purpose)
        rows = self._db.execute(
            f"SELECT {', '.join(_FILE_COLUMNS)} FROM files"
            f"{' WHERE ' + ' AND '.join(where) if where else ''}"
            f" ORDER BY seq {'DESC' if newest_first else 'ASC'} LIMIT ?",
            (*args, limit + 1),
        ).fetchall()
        return [FileRecord(*row) for row in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str) -> bool:
        """Forget file ``file_id``; whether it was there."""
        return self._db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0

    def file_users(self, file_id: str) -> list[str]:
        """Batches not yet final whose input is ``file_id``."""
        rows = self._db.execute(
            f"SELECT id FROM batches WHERE input_file_id = ? AND status IN {_IN_UNFINISHED}",
            (file_id,),
        ).fetchall()
        return [row[0] for row in rows]

    def expired_files(self, now: int) -> list[FileRecord]:
        """Files whose time has passed and that no unfinished batch reads."""
        rows = self._db.execute(
            f"SELECT {', '.join(_FILE_COLUMNS)} FROM files WHERE expires_at IS NOT NULL"
            " AND expires_at <= ? AND id NOT IN"
            f" (SELECT input_file_id FROM batches WHERE status IN {_IN_UNFINISHED})",
            (now,),
        ).fetchall()
        return [FileRecord(*row) for row in rows]

    def stored_bytes(self) -> int:
        """Bytes of every stored file plus the committed partial outputs of unfinished
        batches."""
        files = self._db.execute("SELECT COALESCE(SUM(bytes), 0) FROM files").fetchone()[0]
        partial = self._db.execute(
            "SELECT COALESCE(SUM(output_bytes + error_bytes), 0) FROM batches"
            f" WHERE status IN {_IN_UNFINISHED}"
        ).fetchone()[0]
        return int(files) + int(partial)

    # -- batches ---------------------------------------------------------------------------

    def add_batch(self, record: BatchRecord) -> None:
        """Store a new batch."""
        self._insert("batches", _BATCH_COLUMNS, self._batch_values(record))

    def batch(self, batch_id: str) -> BatchRecord | None:
        """The batch ``batch_id``, or None."""
        row = self._db.execute(
            f"SELECT {', '.join(_BATCH_COLUMNS)} FROM batches WHERE id = ?", (batch_id,)
        ).fetchone()
        return None if row is None else _batch(row)

    def batches(self, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        """A page of batches, newest first, after the batch ``after``.

        Returns:
            Up to ``limit`` records, and whether more follow.
        """
        where, args = self._page("batches", after, True)
        rows = self._db.execute(
            f"SELECT {', '.join(_BATCH_COLUMNS)} FROM batches"
            f"{' WHERE ' + ' AND '.join(where) if where else ''} ORDER BY seq DESC LIMIT ?",
            (*args, limit + 1),
        ).fetchall()
        return [_batch(row) for row in rows[:limit]], len(rows) > limit

    def unfinished(self) -> list[BatchRecord]:
        """Batches the runner still has work for, oldest first."""
        rows = self._db.execute(
            f"SELECT {', '.join(_BATCH_COLUMNS)} FROM batches WHERE status IN {_IN_UNFINISHED}"
            " ORDER BY seq"
        ).fetchall()
        return [_batch(row) for row in rows]

    def finished_before(self, when: int) -> list[str]:
        """Final batches whose last change is older than ``when`` (Unix seconds)."""
        rows = self._db.execute(
            "SELECT id FROM batches WHERE status IN"
            f" {_IN_FINAL} AND COALESCE(completed_at, failed_at, expired_at, cancelled_at) < ?",
            (when,),
        ).fetchall()
        return [row[0] for row in rows]

    def delete_batch(self, batch_id: str) -> None:
        """Forget a batch and its line keys."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self._db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
            self._db.execute("DELETE FROM batches WHERE id = ?", (batch_id,))
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def update(self, batch_id: str, when: Sequence[str] = (), **values: Any) -> bool:
        """Set fields of batch ``batch_id``, only while its status is one of ``when`` (any
        status when empty): a compare-and-set, so a cancel and a finish never both win.

        Returns:
            Whether the batch was changed.
        """
        names = list(values)
        args = [_column_value(name, values[name]) for name in names]
        sql = f"UPDATE batches SET {', '.join(f'{n} = ?' for n in names)} WHERE id = ?"
        args.append(batch_id)
        if when:
            sql += f" AND status IN ({', '.join('?' * len(when))})"
            args.extend(when)
        return self._db.execute(sql, args).rowcount > 0

    # -- lines -----------------------------------------------------------------------------

    def done_lines(self, batch_id: str) -> set[int]:
        """Numbers of the lines of ``batch_id`` whose result is committed."""
        rows = self._db.execute("SELECT line FROM lines WHERE batch_id = ?", (batch_id,))
        return {row[0] for row in rows}

    def record_line(
        self,
        batch_id: str,
        line: int,
        custom_id: str | None,
        ok: bool,
        output_bytes: int,
        error_bytes: int,
    ) -> None:
        """Commit one line's result: its key, its count (completed when ``ok``, else
        failed) and the new committed lengths of the output and error files, together.

        Raises:
            sqlite3.IntegrityError: the line (or its ``custom_id``) is already recorded;
                nothing changed.
        """
        self.record_lines(batch_id, [(line, custom_id, ok)], output_bytes, error_bytes)

    def record_lines(
        self,
        batch_id: str,
        lines: Iterable[tuple[int, str | None, bool]],
        output_bytes: int,
        error_bytes: int,
    ) -> None:
        """:meth:`record_line` for several ``(line, custom_id, ok)`` in one transaction."""
        items = list(lines)
        good = sum(1 for _, _, ok in items if ok)
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self._db.executemany(
                "INSERT INTO lines (batch_id, line, custom_id, ok) VALUES (?, ?, ?, ?)",
                [(batch_id, line, custom_id, int(ok)) for line, custom_id, ok in items],
            )
            self._db.execute(
                "UPDATE batches SET completed = completed + ?, failed = failed + ?,"
                " output_bytes = ?, error_bytes = ? WHERE id = ?",
                (good, len(items) - good, output_bytes, error_bytes, batch_id),
            )
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def finish(self, batch_id: str, status: str, at: int, outputs: Sequence[FileRecord]) -> bool:
        """Make a finalising (or cancelling) batch final: store its output files' records,
        set ``status`` and its time, and drop its line keys, in one transaction.

        Returns:
            Whether the batch was still unfinished (False: another process finished it).
        """
        self._db.execute("BEGIN IMMEDIATE")
        try:
            changed = self.update(batch_id, UNFINISHED, status=status, **{f"{status}_at": at})
            if changed:
                for record in outputs:
                    self._db.execute(
                        f"INSERT OR IGNORE INTO files ({', '.join(_FILE_COLUMNS)})"
                        f" VALUES ({', '.join('?' * len(_FILE_COLUMNS))})",
                        [getattr(record, n) for n in _FILE_COLUMNS],
                    )
                self._db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        return changed

    # -- helpers ---------------------------------------------------------------------------

    def _insert(self, table: str, columns: list[str], values: list[Any]) -> None:
        self._db.execute(
            f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
            values,
        )

    def _page(
        self, table: str, after: str | None, newest_first: bool
    ) -> tuple[list[str], list[Any]]:
        """The WHERE terms of a page after the row ``after`` (an unknown cursor: an empty
        page, not an error)."""
        if after is None:
            return [], []
        row = self._db.execute(f"SELECT seq FROM {table} WHERE id = ?", (after,)).fetchone()
        if row is None:
            return ["0"], []
        return [f"seq {'<' if newest_first else '>'} ?"], [row[0]]

    @staticmethod
    def _batch_values(record: BatchRecord) -> list[Any]:
        return [_column_value(name, getattr(record, name)) for name in _BATCH_COLUMNS]


def _column_value(name: str, value: Any) -> Any:
    if name in _JSON_COLUMNS and value is not None:
        return orjson.dumps(value).decode()
    return value


def _batch(row: Sequence[Any]) -> BatchRecord:
    values = dict(zip(_BATCH_COLUMNS, row, strict=True))
    for name in _JSON_COLUMNS:
        if values[name] is not None:
            values[name] = orjson.loads(values[name])
    return BatchRecord(**values)
