"""A candidate configuration served for real: ``gpuserve serve`` in a subprocess on a temporary
one-model repository (the model folder's files hard-linked, the candidate's ``config.yaml``
written), on a free port, optionally pinned to CPUs. Used by the tuner and the benchmarks.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from gpuserve.config import CONFIG_FILENAME


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


class CandidateServer:
    """``gpuserve serve`` on a temporary one-model repository with a candidate's config.

    Args:
        model_dir: The model folder; its files and version folders are linked, not copied.
        data: The candidate's config mapping, written as ``config.yaml``.
        work_dir: Where the temporary repository goes.
        extra_args: More ``gpuserve serve`` arguments.
        cpus: Pin the server to these CPUs (``taskset -c``), e.g. ``"1"``; None = no pinning.
        env: Extra environment (e.g. ``OMP_NUM_THREADS``).
    """

    def __init__(
        self,
        model_dir: Path,
        data: dict[str, Any],
        work_dir: Path,
        extra_args: list[str],
        cpus: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.repo = Path(tempfile.mkdtemp(prefix="candidate-", dir=work_dir))
        target = self.repo / model_dir.name
        target.mkdir()
        for entry in model_dir.iterdir():
            if entry.name == CONFIG_FILENAME:
                continue
            # hard links (the server refuses symlinks out of its repository); copies when the
            # temporary folder is on another file system
            if entry.is_dir():
                shutil.copytree(entry, target / entry.name, copy_function=_link_or_copy)
            else:
                _link_or_copy(str(entry), str(target / entry.name))
        (target / CONFIG_FILENAME).write_text(yaml.safe_dump(data, sort_keys=False))
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.repo / "server.log"
        self._log = self.log_path.open("wb")
        prefix = ["taskset", "-c", cpus] if cpus and shutil.which("taskset") else []
        self.proc = subprocess.Popen(
            [
                *prefix,
                sys.executable, "-m", "gpuserve", "serve",
                "--model-repository", str(self.repo),
                "--host", "127.0.0.1",
                "--http-port", str(self.port),
                "--grpc-port", "-1",
                "--metrics-port", "-1",
                "--log-level", "warning",
                *extra_args,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )  # fmt: skip

    def wait_ready(self, timeout_s: float, model: str) -> None:
        """Raises RuntimeError (with the server's last output) if it is not ready in time."""
        end = time.monotonic() + timeout_s
        url = f"{self.url}/v2/models/{model}/ready"
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except urllib.error.HTTPError as err:
                reason = self._load_failure(model)
                if err.code == 503 and reason:
                    raise RuntimeError(f"model failed to load: {reason}") from None
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"model not ready after {timeout_s:.0f} s: {self.tail()}")

    def _load_failure(self, model: str) -> str | None:
        """The reason the repository index gives for ``model`` being UNAVAILABLE, if any."""
        request = urllib.request.Request(f"{self.url}/v2/repository/index", data=b"")
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                index = json.loads(response.read())
        except (OSError, ValueError):
            return None
        for entry in index if isinstance(index, list) else []:
            if entry.get("name") == model and entry.get("state") == "UNAVAILABLE":
                return str(entry.get("reason") or "unavailable")
        return None

    def tail(self, lines: int = 6) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:]) or "(no output)"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self.repo, ignore_errors=True)
