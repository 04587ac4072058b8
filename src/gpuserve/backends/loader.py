"""Importing user code from a version folder without polluting ``sys.modules`` by name."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from gpuserve.errors import ConfigError


def import_module_from_path(path: Path, model_name: str, version: int) -> ModuleType:
    """Import ``path`` as a uniquely named module (two versions may both have ``model.py``).

    The version folder is put on ``sys.path`` while the module executes, so ``model.py`` may
    import its sibling files.

    Raises:
        ConfigError: the file cannot be imported (syntax error, failing import, ...).
    """
    safe = "".join(c if c.isalnum() else "_" for c in model_name)
    module_name = f"gpuserve_user_models.{safe}.v{version}.{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{path}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs, as a normal import would be: dataclasses, pickling and
    # typing.get_type_hints look the module up by name. A reload replaces the entry.
    sys.modules[module_name] = module
    folder = str(path.parent)
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
