"""The state directory of the Batch API: where it is, what is in it, and the paths of ids.

Layout::

    <state dir>/
      jobs.sqlite3            the job store (gpuserve.server.batches.store), WAL mode
      files/<file id>         every stored file (uploads, outputs and errors of batches)
      batches/<batch id>/     a running batch's partial output.jsonl and errors.jsonl
      locks/<batch id>.lock   held (flock) by the process that runs the batch

Where it is (``--state-dir``, else):

1. ``.gpuserve-state`` beside the model repository (in its parent folder) when that folder is
   writable and the repository is not the one embedded in the package;
2. otherwise the user's data directory: ``$XDG_DATA_HOME/gpuserve/state`` (by default
   ``~/.local/share/gpuserve/state``; ``~/Library/Application Support/gpuserve/state`` on
   macOS).

Nothing is created until the Batch API is first used (a server that never sees a batch never
writes there); an existing store is opened at start so its jobs resume.

Ids are made by the server (:func:`new_id`) and every id read from a request is checked
against a strict pattern (:func:`checked_file_id`, :func:`checked_batch_id`) before it names
a path, so no id can reach outside the state directory.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import sys
from pathlib import Path

from gpuserve.config import default_model_repository

DATABASE = "jobs.sqlite3"
STATE_FOLDER = ".gpuserve-state"

FILE_ID = re.compile(r"file-[0-9a-f]{24}")
BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")


def new_id(prefix: str) -> str:
    """A fresh id: ``prefix`` (``file-`` or ``batch_``) and 24 random hex digits."""
    return prefix + secrets.token_hex(12)


def checked_file_id(text: str) -> str | None:
    """``text`` when it is a file id of this server's form, else None."""
    return text if FILE_ID.fullmatch(text) else None


def checked_batch_id(text: str) -> str | None:
    """``text`` when it is a batch id of this server's form, else None."""
    return text if BATCH_ID.fullmatch(text) else None


def user_data_dir() -> Path:
    """The user's data directory for gpuserve's state (see the module docstring)."""
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Application Support"
    else:
        xdg = os.environ.get("XDG_DATA_HOME")
        base = Path(xdg) if xdg else Path.home() / ".local" / "share"
    return base / "gpuserve" / "state"


def default_state_dir(repository: Path) -> Path:
    """Where the state lives when ``--state-dir`` is not given (module docstring)."""
    repository = repository.resolve()
    parent = repository.parent
    if repository != default_model_repository().resolve() and os.access(parent, os.W_OK):
        return parent / STATE_FOLDER
    return user_data_dir()


class StateDir:
    """Paths inside one state directory.

    Args:
        root: The directory (created by :meth:`create`).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.database = root / DATABASE

    def exists(self) -> bool:
        """Whether a store was created here before."""
        return self.database.is_file()

    def create(self) -> None:
        """Create the directory and its folders (owner-only permissions).

        Raises:
            OSError: it cannot be created.
        """
        for folder in (self.root, self.root / "files", self.root / "batches", self.root / "locks"):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)

    def file(self, file_id: str) -> Path:
        """The path of a stored file (``file_id`` checked again: a bad one is a bug)."""
        if checked_file_id(file_id) is None:
            raise ValueError(f"not a file id: {file_id!r}")
        return self.root / "files" / file_id

    def partial(self, batch_id: str, name: str) -> Path:
        """A running batch's partial ``output.jsonl`` or ``errors.jsonl``."""
        if checked_batch_id(batch_id) is None or name not in ("output.jsonl", "errors.jsonl"):
            raise ValueError(f"not a batch id: {batch_id!r}")
        return self.root / "batches" / batch_id / name

    def lock(self, batch_id: str) -> JobLock | None:
        """Take batch ``batch_id``'s lock if no other process holds it (the lock goes with
        the process, also when it is killed), else None."""
        if checked_batch_id(batch_id) is None:
            raise ValueError(f"not a batch id: {batch_id!r}")
        fd = os.open(self.root / "locks" / f"{batch_id}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        return JobLock(self.root / "locks" / f"{batch_id}.lock", fd)


class JobLock:
    """A held batch lock (:meth:`StateDir.lock`)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self, remove: bool = False) -> None:
        """Let the lock go (``remove``: also delete its file: the batch is final)."""
        if self._fd is None:
            return
        if remove:
            self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None
