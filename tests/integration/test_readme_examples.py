"""Every shell and Python example of the README runs as written (issue 19).

The README's fenced ``bash`` and ``python`` blocks are extracted and run, each in a fresh
scratch folder (as a new user's working directory), against one real server on free ports
serving the embedded default repository:

* ``localhost:8000`` / ``127.0.0.1:8000`` become the server's HTTP address and ``:8001`` its
  gRPC port; ``gpuserve`` is this environment's command.
* A line that starts ``gpuserve serve`` on the default repository (``gpuserve serve &``) is
  the test's server, already running: it is left out.
* ``gpuserve bench`` lines run with one level and short windows appended (argparse keeps the
  last value of a flag), so a block costs seconds instead of minutes; their own flags are
  still parsed and used.
* ``yaml`` blocks must parse; those with a ``backend:`` key must be valid model configs.

Blocks that cannot run here are listed in :data:`SKIPPED` with the reason (and are still
checked to parse where that is cheap: every ``gpuserve`` command line's flags go through the
real argument parser). A block that imports a package this environment lacks is skipped
naming it (the test extra installs every package the README uses).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from gpuserve.cli.main import build_parser
from gpuserve.config import default_model_repository, parse_model_config
from tests.helpers import InProcessServer

# The export of text_embedding alone takes ~12 s, the bench lines ~7 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

README = Path(__file__).parents[2] / "README.md"
BIN = Path(sys.executable).parent

#: Blocks that do not run here, by a piece of their text, with the reason.
SKIPPED = {
    "python3 -m venv .venv": "creates a virtual environment and installs into it: .ci/run "
    "does exactly this on a fresh clone",
    "examples/ocr/model_repository": "serves an example on port 8000 in the background: "
    "tests/integration/test_examples.py serves each example and runs its client",
    "gpuserve tune": "serves and benchmarks candidates for up to --budget-s (20 minutes): "
    "tests/e2e/test_tune.py runs a short tune",
}
#: Words that mark a block needing what this machine lacks.
NEEDS = {
    "docker": "needs docker",
    "kubectl": "needs kubectl and a cluster",
    "nvidia-smi": "needs a GPU",
    "--index-url": "downloads a CUDA build of torch",
}
#: Appended to ``gpuserve bench`` lines: one level, short windows, no progress bar.
BENCH_FAST = "--warmup-s 0.3 --window-s 0.5 --max-windows 2 --stable-windows 1 --quiet"


@dataclass(frozen=True)
class Block:
    line: int
    lang: str
    code: str


@dataclass(frozen=True)
class Section:
    """The blocks under one heading, run in order in one folder, as a reader would."""

    title: str
    blocks: tuple[Block, ...]

    @property
    def id(self) -> str:
        return re.sub(r"[^A-Za-z0-9]+", "-", self.title).strip("-")


def readme_sections(text: str) -> list[Section]:
    sections: list[Section] = []
    title, blocks = "top", []
    pattern = r"^(#{1,4}) ([^\n]+)$|^```(\w*)\n(.*?)^```"
    for match in re.finditer(pattern, text, re.S | re.M):
        if match.group(1):
            if blocks:
                sections.append(Section(title, tuple(blocks)))
            title, blocks = match.group(2).strip(), []
        else:
            line = text.count("\n", 0, match.start()) + 1
            blocks.append(Block(line, match.group(3), match.group(4)))
    if blocks:
        sections.append(Section(title, tuple(blocks)))
    return sections


SECTIONS = readme_sections(README.read_text(encoding="utf-8"))
RUNNABLE = [s for s in SECTIONS if any(b.lang in ("bash", "sh", "python") for b in s.blocks)]
YAML_BLOCKS = [b for s in SECTIONS for b in s.blocks if b.lang == "yaml"]


def skip_reason(block: Block) -> str | None:
    for marker, reason in SKIPPED.items():
        if marker in block.code:
            return reason
    for word, reason in NEEDS.items():
        if word in block.code:
            return reason
    return None


@pytest.fixture(scope="module")
def server():
    running = InProcessServer(default_model_repository())
    yield running
    running.stop()


def localise(code: str, server: InProcessServer) -> str:
    for host in ("localhost", "127.0.0.1"):
        code = code.replace(f"{host}:8000", f"127.0.0.1:{server.port}")
        code = code.replace(f"{host}:8001", f"127.0.0.1:{server.grpc_port}")
    return code


def shell_script(code: str, server: InProcessServer) -> str:
    lines = []
    for line in code.splitlines():
        words = line.split("#")[0].split()
        if words[:2] == ["gpuserve", "serve"] and "--model-repository" not in words:
            continue  # the test's server stands in for it
        if words[:2] == ["gpuserve", "bench"]:
            level = "--request-rate 50" if "--request-rate" in words else "--concurrency 1"
            url = f"--url http://127.0.0.1:{server.port}"
            line = f"{line.split('#')[0].rstrip()} {url} {level} {BENCH_FAST}"
        lines.append(line)
    return "set -euo pipefail\n" + localise("\n".join(lines), server)


def gpuserve_command_lines(code: str) -> list[list[str]]:
    """The ``gpuserve ...`` commands of a shell block (continuations joined, & dropped)."""
    joined = code.replace("\\\n", " ")
    commands = []
    for line in joined.splitlines():
        if line.strip().startswith("gpuserve "):
            words = shlex.split(line.split(" #")[0].strip().rstrip("&"), posix=True)
            commands.append(words[1:])
    return commands


def run_block(block: Block, server: InProcessServer, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    if block.lang == "python":
        command = [sys.executable, "-c", localise(block.code, server)]
    else:
        command = ["bash", "-c", shell_script(block.code, server)]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_readme_has_examples_and_every_skip_still_matches():
    codes = [b.code for s in RUNNABLE for b in s.blocks]
    assert len(codes) >= 8
    for marker in SKIPPED:
        assert any(marker in code for code in codes), f"no README block has {marker!r}"


@pytest.mark.parametrize("section", RUNNABLE, ids=[s.id for s in RUNNABLE])
def test_readme_section_runs_as_written(section, server, tmp_path):
    parser = build_parser()
    ran, skipped = 0, []
    for block in section.blocks:
        if block.lang not in ("bash", "sh", "python"):
            continue
        for args in gpuserve_command_lines(block.code) if block.lang != "python" else []:
            parser.parse_args(args)  # flags the README shows must exist (exit 2 otherwise)
        reason = skip_reason(block)
        if reason is not None:
            skipped.append(f"line {block.line}: {reason}")
            continue
        result = run_block(block, server, tmp_path)
        missing = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", result.stderr)
        if result.returncode != 0 and missing:
            # The rest of the section builds on this block: skip it too.
            skipped.append(f"line {block.line} on: needs {missing.group(1)}, not installed here")
            break
        assert result.returncode == 0, (
            f"README line {block.line} failed ({result.returncode}):\n"
            f"{result.stdout}\n{result.stderr}"
        )
        assert '"error"' not in result.stdout, result.stdout
        ran += 1
    for note in skipped:
        print("skipped", note)
    if not ran:
        pytest.skip("; ".join(skipped))


@pytest.mark.parametrize("block", YAML_BLOCKS, ids=[f"L{b.line}" for b in YAML_BLOCKS])
def test_readme_yaml_is_valid(block):
    data = yaml.safe_load(block.code)
    assert isinstance(data, dict)
    if "backend" in data:
        parse_model_config(data, Path(f"README.md:{block.line}"), "example")
