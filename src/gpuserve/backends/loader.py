"""Importing user code from a version folder without polluting ``sys.modules`` by name."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from gpuserve.backends.optional import import_lock
from gpuserve.errors import ConfigError


def import_module_from_path(path: Path, model_name: str, version: int) -> ModuleType:
    """Import ``path`` as a uniquely named module (two versions may both have ``model.py``).

    The version folder is put on ``sys.path`` while the module executes, so ``model.py`` may
    import its sibling files; one file executes at a time (thread-safe).

    Raises:
        ConfigError: the file cannot be imported (syntax error, failing import, ...).
    """
    safe = "".join(c if c.isalnum() else "_" for c in model_name)
    module_name = f"gpuserve_user_models.{safe}.v{version}.{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{path}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    folder = str(path.parent)
    # Versions load on several threads at once (BC-35), and ``sys.path`` is one list for
    # the process: while one model.py runs with its folder first on the path, another's
    # must not, or ``import helpers`` in one could find the other's file. The lock is the
    # one optional imports take, so a model.py that imports transformers at its top never
    # races the huggingface backend's import of it. Module code mostly defines classes
    # (weights load in ``Model.load``), so running the files one at a time costs little.
    with import_lock():
        # Registered before it runs, as a normal import would be: dataclasses, pickling and
        # typing.get_type_hints look the module up by name. A reload replaces the entry.
        sys.modules[module_name] = module
        sys.path.insert(0, folder)
        try:
            spec.loader.exec_module(module)
        except Exception as err:  # user code: any failure is a load failure with its cause
            sys.modules.pop(module_name, None)
            raise ConfigError(f"{path}: import failed: {type(err).__name__}: {err}") from err
        finally:
            with contextlib.suppress(ValueError):
                sys.path.remove(folder)
    return module
