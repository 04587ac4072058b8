"""Start-up errors of the real CLI (issue 19): each ends the command at once, non-zero, with
one line naming what to change.

* ``gpuserve serve`` with a mistyped, unreadable or non-folder ``--model-repository``, or a
  port that another process holds (metrics, gRPC, HTTP: the line names the port and the
  flag), exits 2 before it imports the server, and never leaves a server running.
* The server itself (a bind that fails after those checks, a repository that is gone by the
  time the models load) logs one line naming the setting and exits 1.
* ``gpuserve --version``; ``gpuserve export`` and ``gpuserve bench`` on the base install
  (the optional packages hidden) name the extra to install.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuserve.config import ServerConfig
from tests.fixtures.lifecycle_support import make_repository

pytestmark = pytest.mark.timeout(120)

HIDE = Path(__file__).parents[1] / "fixtures" / "hide_modules"


def gpuserve(*args: str, hide: str = "", timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    env = {**os.environ}
    if hide:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HIDE), env.get("PYTHONPATH")]))
        env["GPUSERVE_TEST_HIDE_MODULES"] = hide
    return subprocess.run(
        [sys.executable, "-m", "gpuserve", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
    )


#: Every listener on a free port: a start never tries gpuserve's default ports, which belong
#: to the user's own server (were they taken, the start would report them too).
FREE_PORTS = ("--http-port", "0", "--grpc-port", "0", "--metrics-port", "0")


def serve(*args: str) -> subprocess.CompletedProcess:
    return gpuserve("serve", "--host", "127.0.0.1", *FREE_PORTS, *args)


def one_line(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture()
def taken_port():
    """A port held by a listening socket for the test's duration."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_mistyped_repository_exits_at_once_naming_the_path(tmp_path):
    missing = tmp_path / "modles"
    started = time.monotonic()
    result = serve("--model-repository", str(missing))
    assert result.returncode == 2
    line = one_line(result)
    assert str(missing) in line and "no such folder" in line and "--model-repository" in line
    assert time.monotonic() - started < 30  # exits; nothing keeps running

    a_file = tmp_path / "models.txt"
    a_file.write_text("not a repository\n")
    result = serve("--model-repository", str(a_file))
    assert result.returncode == 2 and "is a file, not a folder" in one_line(result)

    result = serve("--model-repository", str(a_file / "x"))
    assert result.returncode == 2 and str(a_file / "x") in one_line(result)

    env_result = subprocess.run(
        [sys.executable, "-m", "gpuserve", "serve", *FREE_PORTS],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "GPUSERVE_MODEL_REPOSITORY": str(missing)},
    )
    assert env_result.returncode == 2
    assert "GPUSERVE_MODEL_REPOSITORY" in one_line(env_result) and str(missing) in env_result.stderr


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_an_unreadable_repository_exits_naming_the_path(tmp_path):
    locked = make_repository(tmp_path / "locked", "double4_fp32")
    locked.chmod(0)
    try:
        command = [sys.executable, "-m", "gpuserve", "serve", *FREE_PORTS]
        command += ["--model-repository", str(locked)]
        if os.geteuid() == 0:  # root reads any folder: drop the capabilities that allow it
            command = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *command]
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
        if result.returncode != 2 and "Operation not permitted" in result.stderr:
            pytest.skip(f"cannot drop capabilities here: {result.stderr.strip()}")
        assert result.returncode == 2, result.stderr
        line = one_line(result)
        assert str(locked) in line and "permission denied" in line
    finally:
        locked.chmod(0o755)


@pytest.mark.parametrize(
    ("flag", "what"),
    [("--metrics-port", "Prometheus metrics"), ("--grpc-port", "gRPC"), ("--http-port", "HTTP")],
)
def test_a_taken_port_names_the_port_and_the_flag(flag, what, taken_port):
    ports = {"--metrics-port": "0", "--grpc-port": "0", "--http-port": "0", flag: str(taken_port)}
    args = [item for pair in ports.items() for item in pair]
    result = gpuserve("serve", "--host", "127.0.0.1", *args)
    assert result.returncode == 2
    line = one_line(result)
    assert f"cannot listen for {what} on 127.0.0.1:{taken_port}" in line
    assert flag in line and "address already in use" in line
    assert "Traceback" not in result.stderr


def test_every_taken_port_and_the_repository_are_reported_at_once(tmp_path, taken_port):
    """Three problems, three lines, one run: no second start to find the next taken port."""
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        second = other.getsockname()[1]
        result = gpuserve(
            "serve", "--host", "127.0.0.1", "--model-repository", str(tmp_path / "modles"),
            "--http-port", str(taken_port), "--grpc-port", str(second), "--metrics-port", "0",
        )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 3, result.stderr
    assert "modles" in lines[0] and "no such folder" in lines[0]
    assert f"gRPC on 127.0.0.1:{second} (--grpc-port" in lines[1]
    assert f"HTTP on 127.0.0.1:{taken_port} (--http-port" in lines[2]
    assert all(line.startswith("gpuserve: ") for line in lines)


def test_the_server_maps_a_late_bind_failure_and_a_vanished_repository(
    tmp_path, taken_port, caplog, monkeypatch
):
    """GpuServer itself (after the CLI's checks passed, something changed): one line, exit 1."""
    from gpuserve.server.runner import GpuServer

    repo = make_repository(tmp_path / "repo", "double4_fp32")
    config = ServerConfig(
        model_repository=repo, host="127.0.0.1", http_port=0, grpc_port=taken_port, metrics_port=-1
    )
    with (
        caplog.at_level(logging.ERROR, "gpuserve.server.runner"),
        pytest.raises(SystemExit) as exit,
    ):
        GpuServer(config).run()
    assert exit.value.code == 1
    assert "(--grpc-port / GPUSERVE_GRPC_PORT): address already in use" in caplog.text
    assert "Traceback" not in caplog.text

    gone = config.model_copy(update={"grpc_port": -1, "model_repository": tmp_path / "gone"})
    caplog.clear()
    with (
        caplog.at_level(logging.ERROR, "gpuserve.server.runner"),
        pytest.raises(SystemExit) as exit,
    ):
        GpuServer(gone).run()  # the runner's own check, before any port is bound
    assert exit.value.code == 1 and "no such folder" in caplog.text

    # Gone between that check and the scan: the load stops the server instead of leaving
    # it live and never ready.
    monkeypatch.setattr("gpuserve.server.runner.repository_problem", lambda path: None)
    caplog.clear()
    server = GpuServer(gone)
    with (
        caplog.at_level(logging.ERROR, "gpuserve.server.runner"),
        pytest.raises(SystemExit) as exit,
    ):
        server.run()
    assert exit.value.code == 1 and "is not a folder" in caplog.text
    assert server.fatal is not None and "Traceback" not in caplog.text


def test_version_and_flags_without_a_subcommand():
    result = gpuserve("--version")
    assert result.returncode == 0 and result.stdout.startswith("gpuserve ")
    assert result.stdout.split()[1][0].isdigit()
    # serves, as `gpuserve` does
    result = gpuserve("--model-repository", "/nonexistent/modles", *FREE_PORTS)
    assert result.returncode == 2 and "/nonexistent/modles" in one_line(result)


def test_export_on_the_base_install_names_the_extra(tmp_path):
    repo = make_repository(tmp_path / "repo", "torch_linear")
    result = gpuserve(
        "export", "--model-repository", str(repo), "torch_linear", hide="onnx,onnxruntime"
    )
    assert result.returncode == 1
    line = one_line(result)
    assert "needs onnx" in line and "pip install 'gpuserve[onnx]'" in line
    assert not (repo / "torch_linear_onnx").exists()


def test_models_init_copies_the_embedded_repository_once(tmp_path, capsys):
    from gpuserve.cli.main import main

    target = tmp_path / "models"
    assert main(["models", "init", str(target)]) == 0
    assert sorted(p.name for p in target.iterdir()) == ["chat", "simple", "text_embedding"]
    assert (target / "text_embedding" / "config.yaml").is_file()
    assert main(["models", "validate", "--model-repository", str(target)]) == 0
    assert main(["models", "init", str(target)]) == 1  # never over an existing model
    assert "already has chat, simple, text_embedding; nothing copied" in capsys.readouterr().err


def test_trace_config_errors_and_the_missing_tracing_extra_exit_in_one_line(tmp_path):
    repo = make_repository(tmp_path / "repo", "double4_fp32")
    quiet = ("--model-repository", str(repo), "--log-level", "error", "--metrics-port", "-1")
    result = serve(*quiet, "--grpc-port", "-1", "--trace-config", "mode=jaeger")
    assert result.returncode == 2
    assert "--trace-config 'mode=jaeger': expected mode=triton or mode=opentelemetry" in one_line(
        result
    )
    result = gpuserve(
        "serve",
        "--host",
        "127.0.0.1",
        "--http-port",
        "0",
        "--grpc-port",
        "-1",
        *quiet,
        "--trace-config",
        "mode=opentelemetry",
        hide="opentelemetry",
    )
    assert result.returncode == 2
    line = one_line(result)
    assert "needs opentelemetry-sdk" in line and "pip install 'gpuserve[tracing]'" in line
