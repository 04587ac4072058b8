"""The base install (``pip install -e .``, the README's serve command) runs the default
``text_embedding`` on its fastest CPU execution, ONNX Runtime, with no extra."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from gpuserve.models.text_embedding import ONNXRUNTIME_NEEDS, auto_execution

ROOT = Path(__file__).parents[2]


def base_requirements() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return {re.match(r"[A-Za-z0-9_.-]+", spec).group(0).lower() for spec in project["dependencies"]}


def test_the_base_install_brings_what_onnxruntime_execution_needs():
    missing = set(ONNXRUNTIME_NEEDS) - base_requirements()
    assert not missing, f"the base dependencies of pyproject.toml lack {sorted(missing)}"


def test_auto_picks_onnxruntime_on_a_cpu_for_fp32_and_int8():
    assert auto_execution("cpu", "fp32") == "onnxruntime"
    assert auto_execution("cpu", "int8") == "onnxruntime"  # int8 runs on ONNX Runtime only
    assert auto_execution("cpu", "bf16") == "torch"
    assert auto_execution("cuda:0", "fp32") == "torch"
