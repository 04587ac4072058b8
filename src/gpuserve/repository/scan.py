"""Reading a model repository from disk: which models and versions exist, and their configs.

Layout::

    <repository>/<model>/config.yaml        (or Triton's config.pbtxt; config.yaml wins)
    <repository>/<model>/<version>/...      version folders are positive integers

Every problem found is collected, so ``gpuserve models validate`` can report all of them at
once; a model with problems is skipped at serve time and shown as failed.

A version folder that is still being written is never loaded: it is skipped while it holds a
marker file (``.incomplete`` or ``INCOMPLETE``; write the files, then delete the marker) or
while it is empty. In ``poll`` mode a new or changed folder must also look the same (file
names, sizes, modification times: its :func:`fingerprint`) on two scans in a row. Writing a
version under a hidden name (``.3``) and renaming it to ``3`` when complete is the atomic way.

Nothing outside the repository is ever loaded: a model folder, a version folder or a file in
one that is a symbolic link resolving outside the repository makes that model (or version)
fail with a reason that says so. Model names from the repository API are checked in
:mod:`gpuserve.server.security`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuserve.config import CONFIG_FILENAME, ModelConfig, load_model_config, parse_model_config
from gpuserve.engine.warmup_samples import check_warmup_files
from gpuserve.errors import ConfigError, ModelNotFoundError
from gpuserve.repository.triton.config import (
    TRITON_CONFIG_FILENAME,
    is_triton_config,
    load_triton_config,
    triton_config_from_json,
)

#: Files that mark a version folder as still being written.
INCOMPLETE_MARKERS = (".incomplete", "INCOMPLETE")

#: What identifies a version folder's content: (relative path, size bytes, mtime ns) per file.
Fingerprint = tuple[tuple[str, int, int], ...]

#: The model file each backend loads from a version folder (any one of them).
MODEL_FILES = {
    "python": ("model.py",),
    "torch": ("model.pt2", "model.pt", "model.py"),
    "onnx": ("model.onnx",),
}


@dataclass(slots=True, frozen=True)
class VersionFolder:
    """One numeric version folder of a model.

    Attributes:
        version: The folder's number.
        path: The folder.
        fingerprint: Its content identity (see :func:`fingerprint`).
        problem: Why it cannot be loaded now (incomplete), or None.
    """

    version: int
    path: Path
    fingerprint: Fingerprint
    problem: str | None = None


@dataclass(slots=True)
class ModelEntry:
    """One model folder of the repository.

    Attributes:
        name: Folder name (the model name).
        path: The folder.
        config: Validated config, or None if it failed.
        versions: Version numbers selected by the version policy among the loadable
            folders, ascending.
        available: Every numeric version folder found.
        folders: Every numeric version folder, by number, with its fingerprint and problem.
        error: Why the model cannot be served, or None.
    """

    name: str
    path: Path
    config: ModelConfig | None = None
    versions: list[int] = field(default_factory=list)
    available: list[int] = field(default_factory=list)
    folders: dict[int, VersionFolder] = field(default_factory=dict)
    error: str | None = None

    def loadable(self) -> list[int]:
        """Version folders without a problem, ascending."""
        return [v for v in self.available if self.folders[v].problem is None]


def config_file(model_path: Path) -> Path | None:
    """The model folder's configuration file: ``config.yaml``, else Triton's
    ``config.pbtxt``, else None."""
    for name in (CONFIG_FILENAME, TRITON_CONFIG_FILENAME):
        if (model_path / name).is_file():
            return model_path / name
    return None


def read_config_file(path: Path) -> ModelConfig:
    """Validate a ``config.yaml`` or a ``config.pbtxt`` (by its name).

    Raises:
        ConfigError: unreadable, unparsable or invalid; names the file, field and value.
    """
    if path.name == TRITON_CONFIG_FILENAME:
        return load_triton_config(path)
    return load_model_config(path)


def version_folders(model_path: Path) -> list[int]:
    """Numeric version sub-folders of a model folder, ascending (``0`` is not a version)."""
    found = []
    for child in model_path.iterdir():
        name = child.name
        if child.is_dir() and name.isascii() and name.isdigit() and int(name) > 0:
            found.append(int(child.name))
    return sorted(found)


def fingerprint(path: Path) -> Fingerprint:
    """(relative path, size, mtime ns) of every file under ``path``, sorted.

    ``__pycache__`` folders are left out: importing a ``model.py`` writes them, and that must
    not look like a change of the version.
    """
    rows = []
    for file in path.rglob("*"):
        if "__pycache__" in file.parts or not file.is_file():
            continue
        try:
            stat = file.stat()
        except OSError:  # removed while we looked: the next scan sees the new state
            continue
        rows.append((file.relative_to(path).as_posix(), stat.st_size, stat.st_mtime_ns))
    return tuple(sorted(rows))


def escapes(path: Path, root: Path) -> bool:
    """Whether ``path`` resolves (symbolic links followed) outside ``root``."""
    try:
        return not path.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError):  # unreadable, or a link loop
        return True


def _links_outside(path: Path, root: Path) -> bool:
    """Whether version folder ``path``, or a file or folder in it, links outside ``root``."""
    if escapes(path, root):
        return True
    try:
        return any(escapes(item, root) for item in path.rglob("*") if item.is_symlink())
    except OSError:
        return True


def read_version_folder(path: Path, allow_empty: bool = False) -> VersionFolder:
    """Inspect one version folder: its fingerprint and whether it is complete (an empty one
    only with ``allow_empty``: an ensemble's, as in Triton's repositories)."""
    if _links_outside(path, path.parent.parent):
        outside = f"{path}: links outside the model repository; not loaded"
        return VersionFolder(int(path.name), path, (), outside)
    prints = fingerprint(path)
    problem = None
    markers = [name for name in INCOMPLETE_MARKERS if (path / name).exists()]
    if markers:
        problem = f"{path}: incomplete (marker file '{markers[0]}' present); not loaded"
    elif not prints and not allow_empty:
        problem = f"{path}: empty version folder; not loaded"
    return VersionFolder(int(path.name), path, prints, problem)


def scan_model(path: Path, config: ModelConfig | None = None) -> ModelEntry:
    """Read one model folder (never raises; problems go to ``entry.error``).

    Args:
        path: The model folder.
        config: Use this configuration instead of reading ``config.yaml`` (or
            ``config.pbtxt``).
    """
    entry = ModelEntry(path.name, path)
    if escapes(path, path.parent):
        entry.error = f"{path}: the model folder links outside the model repository; not loaded"
        return entry
    if config is not None:
        entry.config = config
    else:
        try:
            entry.config = read_config_file(config_file(path) or path / CONFIG_FILENAME)
        except ConfigError as err:
            entry.error = err.message
            return entry
    try:  # a missing or wrong-sized model_warmup data file fails before any load
        check_warmup_files(entry.config, path)
    except ConfigError as err:
        entry.error = err.message
        return entry
    try:
        entry.available = version_folders(path)
    except OSError as err:
        entry.error = f"{path}: cannot list version folders: {err.strerror}"
        return entry
    if not entry.available:
        entry.error = f"{path}: no version folder (expected numeric sub-folders such as '1/')"
        return entry
    empty_ok = entry.config.ensemble is not None  # an ensemble's folders hold nothing
    entry.folders = {v: read_version_folder(path / str(v), empty_ok) for v in entry.available}
    loadable = entry.loadable()
    entry.versions = entry.config.version_policy.select(loadable)
    if not entry.versions:
        problems = [entry.folders[v].problem for v in entry.available if entry.folders[v].problem]
        entry.error = (
            f"{path}: version_policy selects none of the loadable versions {loadable} "
            f"(version folders: {entry.available})"
            + (f"; {'; '.join(p for p in problems if p)}" if problems else "")
        )
    return entry


def read_model(path: Path, override: dict[str, Any] | None = None) -> ModelEntry:
    """Read the model folder a load request names (blocking; run it off the event loop).

    Args:
        path: The model folder.
        override: A complete model configuration to use instead of the folder's config file,
            as JSON: ``config.yaml``'s fields, or Triton's ModelConfig (told apart by
            :func:`~gpuserve.repository.triton.config.is_triton_config`); or None.

    Raises:
        ModelNotFoundError: no such model folder (or no ``config.yaml`` and no override).
        ConfigError: the override is not a valid configuration.
    """
    if not path.is_dir() or path.name.startswith((".", "_")):
        raise ModelNotFoundError(f"no model '{path.name}' in the repository {path.parent}")
    if override is None and config_file(path) is None:
        raise ModelNotFoundError(
            f"no model '{path.name}' in the repository {path.parent} (no {CONFIG_FILENAME} "
            f"or {TRITON_CONFIG_FILENAME})"
        )
    config = None
    if override is not None:
        where = Path(f"<load request for {path.name}>")
        if is_triton_config(override):
            config = triton_config_from_json(override, where, path.name)
        else:
            config = parse_model_config(override, where, path.name)
    return scan_model(path, config)


def scan_repository(root: Path) -> list[ModelEntry]:
    """Every model folder (a sub-folder holding ``config.yaml`` or ``config.pbtxt``) of
    ``root``, by name.

    Raises:
        ConfigError: ``root`` is not a readable folder.
    """
    if not root.is_dir():
        raise ConfigError(f"model repository {root} is not a folder")
    entries = []
    for child in sorted(root.iterdir()):
        if child.is_dir() and not child.name.startswith((".", "_")):
            if config_file(child) is not None:
                entries.append(scan_model(child))
            elif any(c.is_dir() and c.name.isascii() and c.name.isdigit() for c in child.iterdir()):
                entries.append(
                    ModelEntry(
                        child.name,
                        child,
                        error=f"{child}: missing {CONFIG_FILENAME} (or {TRITON_CONFIG_FILENAME})",
                    )
                )
    return entries


def validate_repository(root: Path, check_model_files: bool = True) -> list[str]:
    """Every problem of every model in ``root``, for ``gpuserve models validate``.

    Checks the config of each model, its version folders (complete, holding the backend's
    model file), a canary that names a missing version, and, with ``check_model_files``, the
    backend's ``complete_config`` for each selected version (the check the server does before
    loading: declared tensors against an ONNX or ``torch.export`` file), then a trial load on
    the CPU with the warm-up or one request of zeros (:mod:`gpuserve.repository.lifecycle.trial`: a
    ``model.py`` that does not import, a constructor that needs arguments, outputs that are
    not the declared ones).

    Returns:
        One message per problem; empty when the repository is fine.

    Raises:
        ConfigError: ``root`` is not a readable folder.
    """
    from gpuserve.repository.lifecycle.trial import trial_problems  # loads backends: only here

    problems: list[str] = []
    entries = scan_repository(root)
    known = sorted(e.name for e in entries)
    for entry in entries:
        if entry.config is None:
            problems.append(entry.error or f"{entry.path}: invalid")
            continue
        if entry.error:
            problems.append(entry.error)
        for index, step in enumerate(entry.config.ensemble.steps if entry.config.ensemble else []):
            if step.model_name not in known or step.model_name == entry.name:
                problems.append(
                    f"{entry.path}: field 'ensemble.steps[{index}].model_name': "
                    f"{step.model_name!r} is not another model of the repository ({known})"
                )
        for version in entry.available:
            folder = entry.folders[version]
            if folder.problem is not None:
                problems.append(folder.problem)
                continue
            names = MODEL_FILES.get(entry.config.backend, ())
            if names and not any((folder.path / name).is_file() for name in names):
                problems.append(
                    f"{folder.path}: backend '{entry.config.backend}' needs "
                    f"{' or '.join(names)}; found {sorted(p for p, _, _ in folder.fingerprint)}"
                )
                continue
            if check_model_files and version in entry.versions:
                found = _check_complete_config(entry.config, folder.path)
                if isinstance(found, list):
                    problems.extend(found)
                else:  # the config the model file completes: load it and try one request
                    problems.extend(trial_problems(found, folder.path, version))
        canary = entry.config.canary
        if canary is not None and canary.version not in entry.available:
            problems.append(
                f"{entry.path / CONFIG_FILENAME}: field 'canary.version': {canary.version} is "
                f"not a version folder (versions: {entry.available})"
            )
    return problems


def _check_complete_config(config: ModelConfig, version_path: Path) -> ModelConfig | list[str]:
    """The config completed from the version's model file (the huggingface task read from
    the folder, the sections checked), or its problems."""
    from gpuserve.backends import complete_for_version

    try:
        return complete_for_version(config, version_path)
    except ConfigError as err:
        return [err.message]
    except Exception as err:  # a model file the backend cannot read
        return [f"{version_path}: cannot be read by backend '{config.backend}': {err}"]
