"""Names a client sends that must not leave the model repository.

A model name is one folder name of the repository, a version label is ASCII digits, and a
configuration sent with a load request cannot point a model at files outside its version
folder. Both front ends reach these checks through the inference service, so they refuse the
same names with the same messages.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from gpuserve.errors import InvalidInputError, ModelNotFoundError

_MODEL_NAME_HINT = (
    "a model name is the name of one folder of the model repository: no '/', '\\', NUL or "
    "control characters, not empty and not starting with '.'"
)


def check_model_name(name: str) -> None:
    """Refuse a model name that could name anything but one folder of the repository
    (``..``, ``a/b``, an absolute path, a hidden folder, NUL).

    Raises:
        InvalidInputError: the name is not a plain folder name.
    """
    if (
        not name
        or name.startswith(".")
        or "/" in name
        or "\\" in name
        or any(ord(c) < 32 or ord(c) == 127 for c in name)
    ):
        raise InvalidInputError(f"invalid model name {name!r}: {_MODEL_NAME_HINT}")


def check_version_label(name: str, version: str | None) -> None:
    """Refuse a version label that is not ASCII digits (``²`` is a digit to Python's
    ``str.isdigit`` but not to ``int``), with the words of Triton's answer (``failed to get
    model version from specified version string '...'``), which its clients look for.

    Raises:
        ModelNotFoundError: the model has no such version.
    """
    if version is not None and not (version.isascii() and version.isdigit()):
        raise ModelNotFoundError(
            f"model '{name}' has no version {version!r}: failed to get model version from "
            f"specified version string '{version}', version should be an integral value > 0"
        )


def check_override_paths(config: dict[str, Any]) -> None:
    """Refuse a configuration sent with a load request that points at files outside the
    model's version folder (``huggingface.model_dir`` absolute or with ``..``).

    Raises:
        InvalidInputError: names the field and the value.
    """
    section = config.get("huggingface")
    if not isinstance(section, dict):
        return
    model_dir = section.get("model_dir")
    if not isinstance(model_dir, str):
        return
    path = PurePosixPath(model_dir.replace("\\", "/"))
    if path.is_absolute() or ".." in path.parts:
        raise InvalidInputError(
            f"field 'huggingface.model_dir' {model_dir!r}: a configuration sent with a load "
            "request may only name a folder inside the model's version folder (relative, "
            "without '..'); put other paths in config.yaml"
        )
