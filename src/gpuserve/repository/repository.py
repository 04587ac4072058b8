"""Reading a model repository from disk: which models and versions exist, and their configs.

Layout::

    <repository>/<model>/config.yaml
    <repository>/<model>/<version>/...      version folders are positive integers

Every problem found is collected, so ``gpuserve models validate`` can report all of them at
once; a model with problems is skipped at serve time and shown as failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gpuserve.config import CONFIG_FILENAME, ModelConfig, load_model_config
from gpuserve.errors import ConfigError


@dataclass(slots=True)
class ModelEntry:
    """One model folder of the repository.

    Attributes:
        name: Folder name (the model name).
        path: The folder.
        config: Validated config, or None if it failed.
        versions: Version numbers selected by the version policy, ascending.
        available: Every numeric version folder found.
        error: Why the model cannot be served, or None.
    """

    name: str
    path: Path
    config: ModelConfig | None = None
    versions: list[int] = field(default_factory=list)
    available: list[int] = field(default_factory=list)
    error: str | None = None


def version_folders(model_path: Path) -> list[int]:
    """Numeric version sub-folders of a model folder, ascending (``0`` is not a version)."""
    found = []
    for child in model_path.iterdir():
        if child.is_dir() and child.name.isdigit() and int(child.name) > 0:
            found.append(int(child.name))
    return sorted(found)


def scan_model(path: Path) -> ModelEntry:
    """Read one model folder (never raises; problems go to ``entry.error``)."""
    entry = ModelEntry(path.name, path)
    try:
        entry.config = load_model_config(path / CONFIG_FILENAME)
    except ConfigError as err:
        entry.error = err.message
        return entry
    entry.available = version_folders(path)
    if not entry.available:
        entry.error = f"{path}: no version folder (expected numeric sub-folders such as '1/')"
        return entry
    entry.versions = entry.config.version_policy.select(entry.available)
    if not entry.versions:
        entry.error = (
            f"{path}: version_policy selects none of the available versions {entry.available}"
        )
    return entry


def scan_repository(root: Path) -> list[ModelEntry]:
    """Every model folder (a sub-folder holding ``config.yaml``) of ``root``, by name.

    Raises:
        ConfigError: ``root`` is not a readable folder.
    """
    if not root.is_dir():
        raise ConfigError(f"model repository {root} is not a folder")
    entries = []
    for child in sorted(root.iterdir()):
        if child.is_dir() and not child.name.startswith((".", "_")):
            if (child / CONFIG_FILENAME).is_file():
                entries.append(scan_model(child))
            elif any(c.is_dir() and c.name.isdigit() for c in child.iterdir()):
                entries.append(
                    ModelEntry(child.name, child, error=f"{child}: missing {CONFIG_FILENAME}")
                )
    return entries
