"""Every shell and Python example of the README and of the manual (``docs/``) runs as written.

Each page's fenced ``bash`` and ``python`` blocks are extracted and run in order, in one fresh
scratch folder per page (as a new user's working directory, so files a block writes are there
for the next), against real servers on free ports:

* ``localhost:8000`` / ``127.0.0.1:8000`` become a server's HTTP address and ``:8001`` its gRPC
  port; ``gpuserve`` is this environment's command.
* A line ``gpuserve serve`` without ``--model-repository`` (``gpuserve serve &``) is the
  module's server of the embedded default repository, already running: it is left out.
* A line ``gpuserve serve --model-repository DIR ... &`` (continuation lines joined) starts
  the page's own server: the real command in the page's folder with free ports appended
  (argparse keeps the last value of a flag), waited for until ready; the page's later blocks
  talk to it, and it stops at the end of the page.
* ``gpuserve bench`` lines run with one level and short windows appended, so a block costs
  seconds instead of minutes; their own flags are still parsed and used.
* ``yaml`` blocks must parse; those with a ``backend:`` key must be valid model configs.
* A block preceded by ``<!-- test: expect-error -->`` shows a mistake: it must still exit 0
  (the page writes ``|| echo ...`` where a command fails), and its output must show the
  failure (``failed`` or an ``"error"`` body).

Blocks that cannot run here are listed in :data:`SKIPPED` with the reason (and are still
checked to parse where that is cheap: every ``gpuserve`` command line's flags go through the
real argument parser). A block that imports a package this environment lacks is skipped with
the rest of its section, naming it (the test extra installs every package the pages use).
A block that imports LangChain runs on the Python that ``GPUSERVE_LANGCHAIN_PYTHON`` names,
where it is set (see :data:`LANGCHAIN_PYTHON`).
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
from tests.helpers import InProcessServer, SubprocessServer, free_port

# The export of text_embedding alone takes ~12 s, the bench lines ~7 s, the first-model page
# ~20 s (its own server, two reloads in poll mode).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BIN = Path(sys.executable).parent

#: Blocks that do not run here, by a piece of their text, with the reason.
_RETRIEVAL = (
    "needs reranker, classifier and SPLADE models in the repository: "
    "tests/integration/test_retrieval.py calls every route, with these clients, on models "
    "built at test time"
)
SKIPPED = {
    "python3 -m venv .venv": "creates a virtual environment and installs into it: .ci/run "
    "does exactly this on a fresh clone",
    ". .venv/bin/activate": "activates the virtual environment of the install command; this "
    "test runs in an installed environment already",
    "gpuserve tune": "serves and benchmarks candidates for up to --budget-s (20 minutes): "
    "tests/e2e/test_tune.py runs a short tune",
    # the retrieval page's calls need a reranker, a classifier and a SPLADE model, and no
    # package ships their weights
    "localhost:8000/rerank": _RETRIEVAL,
    "InferenceClient(model=": _RETRIEVAL,
    "cohere.Client(base_url=": _RETRIEVAL,
    "CohereRerank(": "needs a reranker in the repository: tests/integration/"
    "test_langchain_clients.py runs this block against one",
}
#: Words that mark a block needing what this machine lacks.
NEEDS = {
    "docker": "needs docker",
    "kubectl": "needs kubectl and a cluster",
    "nvidia-smi": "needs a GPU",
    "--index-url": "downloads a CUDA build of torch",
    "apt-get": "installs system packages (nginx)",
}
#: Appended to ``gpuserve bench`` lines: one level, short windows, no progress bar.
BENCH_FAST = "--warmup-s 0.3 --window-s 0.5 --max-windows 2 --stable-windows 1 --quiet"
EXPECT_ERROR = "<!-- test: expect-error -->"
#: The environment of every block and page server: this environment's commands first on PATH,
#: and PYTHONPATH made absolute (blocks run in a scratch folder, where ``src`` is no folder).
ENV = {
    "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    "PYTHONPATH": os.pathsep.join(
        str(Path(p).resolve()) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p
    ),
}
RUN_LANGS = ("bash", "sh", "python")
#: LangChain's current packages need other major versions of cohere and huggingface_hub than
#: the test extra, so they live in a virtual environment of their own: blocks importing them
#: run on its Python where GPUSERVE_LANGCHAIN_PYTHON names it
#: (tests/integration/test_langchain_clients.py says how to make it), without tests/conftest.py's
#: offline switches (huggingface_hub then refuses local URLs too; they call only the server).
LANGCHAIN_PYTHON = os.environ.get("GPUSERVE_LANGCHAIN_PYTHON")
OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    code: str
    section: str
    expect_error: bool = False

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


@dataclass(frozen=True)
class Page:
    name: str
    blocks: tuple[Block, ...]

    @property
    def runnable(self) -> list[Block]:
        return [b for b in self.blocks if b.lang in RUN_LANGS]


def page_blocks(name: str, text: str) -> Page:
    blocks: list[Block] = []
    section = "top"
    pattern = r"^(#{1,4}) ([^\n]+)$|^```(\w*)\n(.*?)^```"
    for match in re.finditer(pattern, text, re.S | re.M):
        if match.group(1):
            section = match.group(2).strip()
            continue
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip().rsplit("\n", 1)[-1]
        blocks.append(
            Block(name, line, match.group(3), match.group(4), section, before == EXPECT_ERROR)
        )
    return Page(name, tuple(blocks))


ALL = [page_blocks(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8")) for p in PAGES]
RUNNABLE = [p for p in ALL if p.runnable]
YAML_BLOCKS = [b for p in ALL for b in p.blocks if b.lang == "yaml"]


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


def localise(code: str, port: int, grpc_port: int) -> str:
    for host in ("localhost", "127.0.0.1"):
        code = code.replace(f"{host}:8000", f"127.0.0.1:{port}")
        code = code.replace(f"{host}:8001", f"127.0.0.1:{grpc_port}")
    return code


def joined_lines(code: str) -> list[str]:
    """The block's lines with backslash continuations joined."""
    return code.replace("\\\n", " ").splitlines()


def serve_command(line: str) -> list[str] | None:
    """The arguments after ``gpuserve serve`` of a line that starts a server of its own
    repository in the background, else None."""
    if not line.strip().startswith("gpuserve serve "):
        return None
    words = shlex.split(line.split(" #")[0].strip(), posix=True)
    if words[:2] == ["gpuserve", "serve"] and "--model-repository" in words and words[-1] == "&":
        return words[2:-1]
    return None


def shell_script(code: str, port: int, grpc_port: int) -> str:
    lines = []
    for line in joined_lines(code):
        words = line.split("#")[0].split()
        if words[:2] == ["gpuserve", "serve"] and "--model-repository" not in words:
            continue  # the module's server stands in for it
        if serve_command(line) is not None:
            continue  # started by the test (see PageRun.start)
        if words[:2] == ["gpuserve", "bench"]:
            level = "--request-rate 50" if "--request-rate" in words else "--concurrency 1"
            url = f"--url http://127.0.0.1:{port}"
            line = f"{line.split('#')[0].rstrip()} {url} {level} {BENCH_FAST}"
        lines.append(line)
    return "set -euo pipefail\n" + localise("\n".join(lines), port, grpc_port)


def gpuserve_command_lines(code: str) -> list[list[str]]:
    """The ``gpuserve ...`` commands of a shell block (continuations joined, & dropped)."""
    commands = []
    for line in joined_lines(code):
        if line.strip().startswith("gpuserve "):
            command = re.split(r" (?:\|\||&&|\||;) ", line.split(" #")[0])[0]
            words = shlex.split(command.strip().rstrip("&"), posix=True)
            commands.append(words[1:])
    return commands


class PageRun:
    """One page's folder and the server its blocks talk to."""

    def __init__(self, default: InProcessServer, cwd: Path) -> None:
        self.cwd = cwd
        self.port, self.grpc_port = default.port, default.grpc_port
        self.own: SubprocessServer | None = None

    def start(self, args: list[str]) -> None:
        if self.own is not None:
            self.own.stop()
        grpc = free_port()
        self.own = SubprocessServer(
            *args, "--grpc-port", str(grpc), ready_timeout_s=240, cwd=self.cwd, env=ENV,
        )  # fmt: skip
        self.port, self.grpc_port = self.own.port, grpc

    def run(self, block: Block) -> subprocess.CompletedProcess:
        """Run one block; a shell block's lines before a page server's start run first."""
        if block.lang == "python":
            code = localise(block.code, self.port, self.grpc_port)
            langchain = re.search(r"^(from|import) langchain_", code, re.M)
            if not langchain:
                return self._run([sys.executable, "-c", code])
            return self._run([LANGCHAIN_PYTHON or sys.executable, "-c", code], drop=OFFLINE)
        part: list[str] = []
        outputs: list[subprocess.CompletedProcess] = []
        for line in joined_lines(block.code):
            args = serve_command(line)
            if args is None:
                part.append(line)
                continue
            outputs.append(self._shell(part))
            if outputs[-1].returncode != 0:
                return outputs[-1]
            part = []
            self.start(args)
        outputs.append(self._shell(part))
        last = outputs[-1]
        return subprocess.CompletedProcess(
            last.args,
            last.returncode,
            "".join(o.stdout for o in outputs),
            "".join(o.stderr for o in outputs),
        )

    def _shell(self, lines: list[str]) -> subprocess.CompletedProcess:
        return self._run(["bash", "-c", shell_script("\n".join(lines), self.port, self.grpc_port)])

    def _run(self, command: list[str], drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        env = {k: v for k, v in {**os.environ, **ENV}.items() if k not in drop}
        return subprocess.run(
            command, cwd=self.cwd, env=env, capture_output=True, text=True, timeout=300
        )

    def stop(self) -> str:
        if self.own is None:
            return ""
        self.own.stop()
        return self.own.output()


def test_the_pages_have_examples_and_every_skip_still_matches():
    codes = [b.code for p in RUNNABLE for b in p.runnable]
    assert len(codes) >= 20
    assert any(p.name == "docs/first-model.md" for p in RUNNABLE)
    for marker in SKIPPED:
        assert any(marker in code for code in codes), f"no block of README or docs has {marker!r}"


@pytest.mark.parametrize("page", RUNNABLE, ids=[p.name for p in RUNNABLE])
def test_page_runs_as_written(page, server, tmp_path):
    parser = build_parser()
    ran, skipped, skip_section = 0, [], None
    run = PageRun(server, tmp_path)
    try:
        for block in page.runnable:
            for args in gpuserve_command_lines(block.code) if block.lang != "python" else []:
                parser.parse_args(args)  # flags the page shows must exist (exit 2 otherwise)
            reason = skip_reason(block)
            if reason is None and block.section == skip_section:
                reason = "its section needs a package not installed here"
            if reason is not None:
                skipped.append(f"{block.where}: {reason}")
                continue
            result = run.run(block)
            missing = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", result.stderr)
            if result.returncode != 0 and missing:
                # The rest of the section builds on this block: skip it too.
                skipped.append(f"{block.where} on: needs {missing.group(1)}, not installed here")
                skip_section = block.section
                continue
            assert result.returncode == 0, (
                f"{block.where} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
            )
            if block.expect_error:  # the page shows a mistake: it must show up
                shown = result.stdout + result.stderr
                assert "failed" in shown or '"error"' in shown, f"{block.where}:\n{shown}"
            else:
                assert '"error"' not in result.stdout, f"{block.where}:\n{result.stdout}"
            ran += 1
    except BaseException:
        print(run.stop(), file=sys.stderr)
        raise
    run.stop()
    for note in skipped:
        print("skipped", note)
    if not ran:
        pytest.skip("; ".join(skipped))


@pytest.mark.parametrize("block", YAML_BLOCKS, ids=[b.where for b in YAML_BLOCKS])
def test_page_yaml_is_valid(block):
    data = yaml.safe_load(block.code)
    assert isinstance(data, dict)
    if "backend" in data:
        parse_model_config(data, Path(block.where), "example")
