"""The default repository's ``text_embedding`` model, unchanged (its ``model.py`` is loaded
from the installed package), to compare with its ensemble form ``text_embedding_pipeline``."""

from __future__ import annotations

import importlib.util

from gpuserve.config import default_model_repository

_PATH = default_model_repository() / "text_embedding" / "1" / "model.py"
_SPEC = importlib.util.spec_from_file_location("gpuserve_example_text_embedding", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
_MODULE = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_MODULE)

Model = _MODULE.Model
