"""The generated reference pages (docs/reference/config.md and cli.md) are complete and current.

Both pages are written by ``scripts/gen_reference.py`` from the pydantic configuration models
and the ``gpuserve`` argument parser. A field or flag without a description fails here, and so
does a page in the tree that differs from what the script writes now (a field or a flag added,
renamed or re-described without regenerating): run ``python scripts/gen_reference.py``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
REGENERATE = "python scripts/gen_reference.py"


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location(
        "gen_reference", ROOT / "scripts" / "gen_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_reference"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gen_reference", None)


def test_every_config_field_has_a_description(gen) -> None:
    missing = gen.missing_descriptions()
    assert not missing, (
        "config fields without a description (add them to the Attributes: section of the "
        f"class docstring, or Field(description=...)), then run `{REGENERATE}`: {missing}"
    )


def test_every_cli_flag_has_a_help_text(gen) -> None:
    missing = gen.missing_help()
    assert not missing, f"flags without help=..., then run `{REGENERATE}`: {missing}"


def test_generated_pages_in_the_tree_are_current(gen) -> None:
    for path, text in gen.pages().items():
        current = path.read_text(encoding="utf-8") if path.exists() else ""
        assert current == text, (
            f"{path.relative_to(ROOT)} is stale (a config field or CLI flag changed): "
            f"run `{REGENERATE}` and commit the page"
        )


def test_the_pages_cover_what_they_are_generated_from(gen) -> None:
    from gpuserve.config import ModelConfig, ServerConfig

    config = (ROOT / "docs" / "reference" / "config.md").read_text(encoding="utf-8")
    cli = (ROOT / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    for name in ModelConfig.model_fields:
        assert f"| `{name}` |" in config
    for name in ServerConfig.model_fields:
        assert f"`GPUSERVE_{name.upper()}`" in config
    for flag in ("--http-port N", "--model-control-mode", "--load-on-demand", "--batches N"):
        assert flag in cli
