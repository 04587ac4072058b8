"""Imports point one way (STYLE.md habit 1, DESIGN.md: cli -> server -> service -> engine ->
backends): the engine never imports the server, the service, the metrics layer,
prometheus_client, gRPC or the HTTP stack; backends never import the engine, the server, the
service, the wire formats (protocol), the built-in models (shared text helpers are in
gpuserve.text) or the repository layer (Triton's form of a configuration, which the Python
backend hands its models, is in gpuserve.config, its datatype names in gpuserve.datatypes);
the repository imports no wire format (its Triton reader builds plain configs; the gRPC front
end makes the protobuf message); the text helpers, below the backends, import none (the
admission step built on them answers in the backend contract's terms, so it is a backend
module); the inference service imports no front end and no wire format (server, protocol,
gRPC, protobuf, HTTP); one front end never imports another (``server.grpc`` nothing of
``server.http``), and no front end reaches the model manager but through the service. Checked
statically (every import statement, including function-local ones and ``TYPE_CHECKING`` blocks)
and at run time (what importing the engine pulls in)"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import gpuserve

PACKAGE = Path(gpuserve.__file__).parent

FORBIDDEN = {
    "engine": (
        "gpuserve.server",
        "gpuserve.service",
        "gpuserve.metrics",
        "gpuserve.cli",
        "prometheus_client",
        "grpc",
        "uvicorn",
        "httptools",
    ),
    "backends": (
        "gpuserve.engine",
        "gpuserve.server",
        "gpuserve.metrics",
        "gpuserve.cli",
        "gpuserve.protocol",
        "gpuserve.service",
        "gpuserve.models",
        "gpuserve.repository",
    ),
    "repository": ("gpuserve.protocol",),
    "service": (
        "gpuserve.server",
        "gpuserve.cli",
        "gpuserve.protocol",
        "grpc",
        "google.protobuf",
        "httptools",
    ),
    "text": ("gpuserve.backends",),
    "server": ("gpuserve.repository.manager",),
    "server/grpc": ("gpuserve.server.http",),
    "server/http": ("gpuserve.server.grpc",),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Absolute names of every module imported by the file at ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            names.append((node.lineno, module))
            names.extend((node.lineno, f"{module}.{alias.name}") for alias in node.names)
    return names


def violations(layer: str) -> list[str]:
    found = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for line, module in imported_modules(path):
            for banned in FORBIDDEN[layer]:
                if module == banned or module.startswith(banned + "."):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    return found


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_point_one_way(layer):
    assert (PACKAGE / layer).is_dir()
    assert list((PACKAGE / layer).rglob("*.py"))
    assert violations(layer) == []


def test_the_check_sees_relative_and_local_imports(tmp_path, monkeypatch):
    fake = tmp_path / "gpuserve"
    (fake / "engine").mkdir(parents=True)
    (fake / "engine" / "bad.py").write_text(
        "from ..server import status\n"
        "def f():\n"
        "    import prometheus_client\n"
        "    from gpuserve.metrics.series import ServerMetrics\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    lines = {entry.split(":")[1].split()[0] for entry in violations("engine")}
    assert lines == {"1", "3", "4"}


def test_importing_the_engine_loads_no_server_or_metrics_module():
    modules = [
        f"gpuserve.engine.{p.stem}"
        for p in sorted((PACKAGE / "engine").glob("*.py"))
        if p.stem != "__init__"
    ]
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + "banned = ('gpuserve.server', 'gpuserve.metrics', 'prometheus_client', 'grpc', "
        "'uvicorn', 'httptools')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in banned "
        "or m.startswith(banned[:2])))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


#: Imports that once ran up the layers, each as the file that had it and the line: the
#: check must find every one of them again if it comes back.
UPWARD = [
    ("text", "truncation.py", "from gpuserve.backends.base import Admitted\n"),
    (
        "backends",
        "triton_python/auto_complete.py",
        "from gpuserve.repository.triton.config import DATATYPES\n",
    ),
    (
        "backends",
        "triton_python/backend.py",
        "from gpuserve.repository.triton_model_config import triton_model_config_dict\n",
    ),
    (
        "repository",
        "triton_model_config.py",
        "from gpuserve.protocol.protos import model_config_pb2\n",
    ),
    (
        "repository",
        "triton_scheduling.py",
        "from ..protocol.protos import model_config_pb2 as mc\n",
    ),
]


@pytest.mark.parametrize(("layer", "file", "line"), UPWARD, ids=[u[1] for u in UPWARD])
def test_the_check_finds_an_upward_import_put_back(tmp_path, monkeypatch, layer, file, line):
    fake = tmp_path / "gpuserve"
    target = fake / layer / file
    target.parent.mkdir(parents=True)
    target.write_text("from __future__ import annotations\n\n" + line)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    found = violations(layer)
    assert found and all(entry.split(":")[1].split()[0] == "3" for entry in found), found


def test_the_check_sees_a_front_end_importing_another(tmp_path, monkeypatch):
    fake = tmp_path / "gpuserve"
    (fake / "server" / "grpc").mkdir(parents=True)
    (fake / "server" / "grpc" / "bad.py").write_text(
        "from ..http.app import HttpApp\nfrom gpuserve.repository.manager import ModelManager\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert [entry.split(":")[1].split()[0] for entry in violations("server/grpc")] == ["1", "1"]
    assert [entry.split(":")[1].split()[0] for entry in violations("server")] == ["2", "2"]


@pytest.mark.parametrize("layer", ["service", "repository"])
def test_large_layers_are_grouped_by_job(layer):
    """The service and the repository layer keep sub-folders by job (as the engine does):
    a dozen modules at most at their top level, every sub-folder a package."""
    top = [p for p in (PACKAGE / layer).glob("*.py") if p.stem != "__init__"]
    folders = [p for p in (PACKAGE / layer).iterdir() if p.is_dir() and p.name != "__pycache__"]
    assert len(top) <= 12, sorted(p.name for p in top)
    assert len(folders) >= 3
    assert all((folder / "__init__.py").is_file() for folder in folders)
