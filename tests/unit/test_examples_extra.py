"""The ``examples`` extra installs what the examples' clients import, and each example's
README says how to run it (serving its own ``model_repository``, or the default repository
when it has none).

The imports of every ``examples/<name>/client.py`` (nested ones included) are read with
:mod:`ast`; each one outside the standard library must come from the base install or the
``examples`` extra of ``pyproject.toml`` (``tritonclient.grpc`` needs ``tritonclient[grpc]``).
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
EXAMPLES = sorted(p.parent for p in (ROOT / "examples").glob("*/client.py"))
#: import name -> distribution (requirement name, with the extra a submodule needs)
DISTRIBUTIONS = {
    "numpy": "numpy",
    "httpx": "httpx",
    "PIL": "pillow",
    "tritonclient.http": "tritonclient[http]",
    "tritonclient.grpc": "tritonclient[grpc]",
    "gpuserve": "gpuserve",
    "openai": "openai",
}


def imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def requirement_names() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    names = {"gpuserve"}
    for spec in [*project["dependencies"], *project["optional-dependencies"]["examples"]]:
        match = re.match(r"[A-Za-z0-9_.-]+(\[[\w,]+\])?", spec)
        assert match is not None
        names.add(match.group(0).lower())
    return names


def needed(module: str) -> str | None:
    top = module.split(".")[0]
    if top in sys.stdlib_module_names or top == "__future__":
        return None
    for prefix, dist in DISTRIBUTIONS.items():
        if module == prefix or module.startswith(prefix + "."):
            return dist
    if top == "tritonclient":
        return "tritonclient[http]"
    pytest.fail(f"an example imports {module!r}: add its distribution to DISTRIBUTIONS")


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_the_examples_extra_installs_what_the_client_imports(example):
    have = requirement_names()
    for module in sorted(imports(example / "client.py")):
        dist = needed(module)
        assert dist is None or dist.lower() in have, (
            f"examples/{example.name}/client.py imports {module}: add {dist!r} to the "
            "examples extra of pyproject.toml"
        )


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_each_example_readme_says_how_to_run_it(example):
    readme = (example / "README.md").read_text(encoding="utf-8")
    assert "pip install -e '.[examples]'" in readme
    if (example / "model_repository").is_dir():
        serve = f"gpuserve serve --model-repository examples/{example.name}/model_repository"
    else:  # an example on the default repository
        serve = "gpuserve serve &"
    assert serve in readme
    assert f"python examples/{example.name}/client.py" in readme
