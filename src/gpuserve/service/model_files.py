"""Model files sent with a load request (Triton's ``file:<path>`` parameters), laid out as a
private model folder.

A load request may carry the model's files instead of naming the repository's: each
``file:<relative path>`` parameter holds one file's bytes (``file:1/model.onnx``), laid out
as a model folder, and a ``config`` parameter is then required (the files never include the
configuration). The paths are checked as Triton checks them: relative, no ``..`` and each
``/``-separated component at most ``NAME_MAX`` (255) bytes of UTF-8; a path that breaks a rule
is refused with :class:`~gpuserve.errors.RepositoryPollError` (HTTP 500 / gRPC INTERNAL,
``failed to poll from model repository``, as Triton answers). The files go into a fresh
folder of :func:`tempfile.mkdtemp` (mode 0700, files 0600), inside it under the model's name,
and :class:`LoadedFiles` removes that folder when the model is unloaded or loaded again.

A load configuration that names no backend gets the one its model files tell
(:func:`with_detected_backend`), as Triton's auto-complete does.

Files that run code when a model loads (:func:`code_files`: Python sources, pickled and
TorchScript files, native libraries, by name or by their first bytes) are the upload policy's
concern: without a token they need ``allow_model_upload_code`` (see
:mod:`gpuserve.service.commands`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpuserve.errors import InvalidInputError, RepositoryPollError
from gpuserve.repository.triton.config import is_triton_config

logger = logging.getLogger(__name__)

#: The prefix of a load request parameter that carries one model file.
FILE_PREFIX = "file:"
#: Most bytes of one path component (Linux's ``NAME_MAX``).
NAME_MAX = 255
#: Prefix of the temporary folders that hold files sent with a load request.
TEMP_PREFIX = "gpuserve-load-"


#: Name endings of files that run code when a model loads: Python sources and bytecode,
#: pickles (``torch.save`` files, joblib, ...), TorchScript / ``torch.export`` archives,
#: native libraries. (``.bin`` is not among them: Triton's warm-up data files are raw
#: tensors named so; a pickled ``pytorch_model.bin`` is caught by its first bytes.)
CODE_SUFFIXES = (
    ".py", ".pyc", ".pyo", ".pyd", ".pyx", ".so", ".dylib", ".dll",
    ".pt", ".pth", ".pt2", ".pkl", ".pickle", ".ckpt", ".joblib", ".dill",
    ".jit", ".torchscript",
)  # fmt: skip
#: First bytes of a pickle (protocol 2 and later: every ``torch.save`` file of the legacy
#: format) and of a zip archive (``torch.save``, TorchScript and ``torch.export`` files),
#: whatever the file is called.
CODE_MAGIC = (b"\x80", b"PK\x03\x04")


def code_files(files: Mapping[tuple[str, ...], bytes]) -> list[str]:
    """The relative paths among ``files`` (checked path components -> contents) that can run
    code when a model loads: named with a :data:`CODE_SUFFIXES` ending, or starting like a
    pickle or a zip archive (:data:`CODE_MAGIC`). Sorted."""
    found = []
    for parts, content in files.items():
        name = parts[-1].lower()
        if name.endswith(CODE_SUFFIXES) or content.startswith(CODE_MAGIC):
            found.append("/".join(parts))
    return sorted(found)


def _refuse(path: str, why: str) -> RepositoryPollError:
    return RepositoryPollError(
        f"failed to poll from model repository: parameter '{FILE_PREFIX}{path}': {why} "
        f"(expected a relative path such as '{FILE_PREFIX}1/model.onnx')"
    )


def check_file_path(path: str) -> tuple[str, ...]:
    """The components of the relative path of a ``file:<path>`` parameter.

    Args:
        path: The parameter's name after ``file:``.

    Returns:
        The non-empty components, in order.

    Raises:
        RepositoryPollError: empty, absolute, with ``..``, ``.``, an empty component, a
            backslash, NUL or a component over 255 bytes.
    """
    if not path:
        raise _refuse(path, "the path is empty")
    if path.startswith("/"):
        raise _refuse(path, "an absolute path")
    if "\\" in path or "\0" in path:
        raise _refuse(path, "a backslash or NUL in the path")
    parts = tuple(path.split("/"))
    for part in parts:
        if part in ("", ".", ".."):
            raise _refuse(path, f"the path component {part!r} is not allowed")
        size = len(part.encode("utf-8", "surrogatepass"))
        if size > NAME_MAX:
            raise _refuse(path, f"a path component of {size} bytes (at most {NAME_MAX})")
    return parts


def check_files(files: Mapping[str, bytes], limit_bytes: int) -> dict[tuple[str, ...], bytes]:
    """Check every path of ``files`` (relative path -> content) and their total size.

    Args:
        files: The files of a load request, by relative path (after ``file:``).
        limit_bytes: Most bytes all contents may hold together (the request body limit).

    Returns:
        The contents by path components.

    Raises:
        RepositoryPollError: a path breaks a rule (see :func:`check_file_path`).
        InvalidInputError: the contents pass ``limit_bytes``.
    """
    checked = {check_file_path(path): content for path, content in files.items()}
    total = sum(len(content) for content in checked.values())
    if total > limit_bytes:
        raise InvalidInputError(
            f"the files of the load request hold {total} bytes, more than this server's "
            f"limit of {limit_bytes} (max_request_body_bytes)"
        )
    return checked


def write_model_folder(name: str, files: Mapping[tuple[str, ...], bytes]) -> Path:
    """Write ``files`` into ``<new private temporary folder>/<name>/`` (blocking: run it off
    the event loop).

    Args:
        name: The model's name (a checked plain folder name).
        files: Contents by checked path components (see :func:`check_files`).

    Returns:
        The model folder (its parent is the temporary folder to remove afterwards).

    Raises:
        RepositoryPollError: two paths collide (a file where another needs a folder); the
            temporary folder is removed.
    """
    root = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX))  # mode 0700
    folder = root / name
    current = ""
    try:
        folder.mkdir(mode=0o700)
        for parts, content in files.items():
            current = "/".join(parts)
            target = folder.joinpath(*parts)
            target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
            fd = os.open(target, flags, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(content)
    except OSError as err:
        shutil.rmtree(root, ignore_errors=True)
        raise _refuse(current, f"cannot be written ({err.strerror})") from None
    return folder


def remove_folder(root: Path) -> None:
    """Remove a temporary folder of :func:`write_model_folder` (blocking; never raises)."""
    shutil.rmtree(root, ignore_errors=True)


class LoadedFiles:
    """The temporary folder each model loaded from a request's files was loaded from, so it
    goes when the model is unloaded or loaded again (from the repository or other files)."""

    def __init__(self) -> None:
        self.folders: dict[str, Path] = {}

    async def replace(self, name: str, root: Path | None) -> None:
        """``name`` now loads from ``root`` (None: from the repository); removes the folder
        it loaded from before, if any."""
        previous = self.folders.pop(name, None)
        if root is not None:
            self.folders[name] = root
        if previous is not None and previous != root:
            await discard(previous)

    def close(self) -> None:
        """Remove every temporary folder (at shutdown)."""
        for root in self.folders.values():
            remove_folder(root)
        self.folders.clear()


async def discard(root: Path) -> None:
    """Remove temporary folder ``root`` off the event loop."""
    await asyncio.get_running_loop().run_in_executor(None, remove_folder, root)
    logger.debug("removed the load request files folder %s", root)


#: The model file that tells a version folder's backend, in the order looked for (Triton's
#: default model file names), with the backend name of each configuration schema:
#: (file, gpuserve's ``backend``, Triton's ``backend``).
_BACKEND_FILES = (
    ("model.onnx", "onnx", "onnxruntime"),
    ("model.pt", "torch", "pytorch"),
    ("model.py", "python", "python"),
)


def with_detected_backend(override: dict[str, Any], folder: Path) -> dict[str, Any]:
    """``override`` with the backend its model files tell, when it names none, as Triton's
    auto-complete finds it (``{"max_batch_size": 16}`` for a folder holding
    ``1/model.onnx`` loads as an ONNX model whose tensors come from the file).

    Args:
        override: A load request's configuration (either schema).
        folder: The model folder the versions load from.

    Returns:
        ``override`` unchanged when it names a backend or platform or no model file is
        found; otherwise a copy with ``backend`` set (in the override's own schema).
    """
    if {"backend", "platform"} & override.keys():
        return override
    triton = is_triton_config(override)
    try:
        versions = sorted(p for p in folder.iterdir() if p.name.isdigit() and p.is_dir())
    except OSError:
        return override
    for filename, ours, tritons in _BACKEND_FILES:
        if any((version / filename).is_file() for version in versions):
            return {**override, "backend": tritons if triton else ours}
    return override
