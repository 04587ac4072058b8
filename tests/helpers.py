"""RunningServer: the real gpuserve server on a free port, for integration and e2e tests.

Two flavours with one interface (``url``, ``port``, ``grpc_url``, ``grpc_port``, ``stop()``):

* :class:`InProcessServer` runs :class:`gpuserve.server.runner.GpuServer` on a thread of the
  test process (fast; lets a test inspect fixture models' module state).
* :class:`SubprocessServer` runs the real ``gpuserve serve`` CLI as a child process, prints its
  output on failure, and stops it with SIGTERM.

Both poll ``/v2/health/ready`` with a deadline before handing the server to the test.
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, deadline_s: float, alive=lambda: True) -> None:
    end = time.monotonic() + deadline_s
    last = ""
    while time.monotonic() < end:
        if not alive():
            raise RuntimeError("server exited before it became ready")
        try:
            response = httpx.get(f"{url}/v2/health/ready", timeout=2.0)
            if response.status_code == 200:
                return
            last = f"{response.status_code} {response.text}"
        except httpx.HTTPError as err:
            last = repr(err)
        time.sleep(0.05)
    raise TimeoutError(f"server at {url} not ready after {deadline_s} s (last: {last})")


class InProcessServer:
    """GpuServer on a background thread with its own event loop."""

    def __init__(self, repository: Path, ready_timeout_s: float = 120.0, **settings) -> None:
        from gpuserve.config import ServerConfig
        from gpuserve.server.runner import GpuServer

        settings.setdefault("metrics_port", 0)  # a free port: never collide on 8002
        settings.setdefault("grpc_port", 0)
        config = ServerConfig(
            model_repository=repository,
            host="127.0.0.1",
            http_port=0,
            log_level="warning",
            **settings,
        )
        self.server = GpuServer(config)
        self.thread = threading.Thread(target=self.server.run, name="gpuserve-test", daemon=True)
        self.thread.start()
        end = time.monotonic() + ready_timeout_s
        while not self.server.started.is_set():
            if not self.thread.is_alive() or time.monotonic() > end:
                raise RuntimeError("in-process server failed to start")
            time.sleep(0.01)
        self.port = self.server.port
        self.url = f"http://127.0.0.1:{self.port}"
        self.grpc_port = self.server.grpc_port
        self.grpc_url = f"127.0.0.1:{self.grpc_port}"  # host:port, as tritonclient.grpc wants
        if not self.server.loaded.wait(ready_timeout_s):
            raise TimeoutError("models did not finish loading")

    @property
    def manager(self):
        return self.server.manager

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(60)


class SubprocessServer:
    """``python -m gpuserve serve`` as a child process."""

    def __init__(
        self,
        *args: str,
        ready_timeout_s: float = 180.0,
        env: dict | None = None,
        wait: bool = True,
        cwd: Path | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if "--grpc-port" in args:
            self.grpc_port = int(args[args.index("--grpc-port") + 1])
        else:
            self.grpc_port = free_port()
            args = ("--grpc-port", str(self.grpc_port), *args)
        self.grpc_url = f"127.0.0.1:{self.grpc_port}"
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the server
        full_env = {**os.environ, **(env or {})}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpuserve",
                "serve",
                "--host",
                "127.0.0.1",
                "--http-port",
                str(self.port),
                "--metrics-port",
                "0",
                *args,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=cwd,
        )
        if wait:
            try:
                wait_ready(self.url, ready_timeout_s, alive=lambda: self.proc.poll() is None)
            except Exception:
                self.stop()
                print(self.output(), file=sys.stderr)
                raise

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


# -- polling with deadlines (never a fixed sleep as synchronisation) -------------------------

#: One TLS context for the polling calls below: httpx builds one per call otherwise (~0.1 s).
_TLS = ssl.create_default_context()


def wait_until(condition, deadline_s: float = 10.0, what: str = "the condition") -> None:
    """Poll ``condition()`` every 5 ms until it is true; AssertionError after ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not true after {deadline_s} s")
        time.sleep(0.005)


@dataclass(frozen=True)
class QueueState:
    """One model version's requests, from the Prometheus gauges a client can scrape.

    Attributes:
        queued: ``gpuserve_queue_depth``: requests waiting for a batch.
        in_flight: ``gpuserve_inflight_requests``: admitted and not yet answered (queued plus
            executing).
    """

    queued: int
    in_flight: int

    @property
    def executing(self) -> int:
        """Requests in a batch that runs now."""
        return self.in_flight - self.queued


def queue_state(url: str, model: str, version: str = "1") -> QueueState:
    """The queue of ``model`` (version ``version``) as ``GET {url}/metrics`` reports it."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {"model": model, "version": version}
    found = {"gpuserve_queue_depth": 0.0, "gpuserve_inflight_requests": 0.0}
    text = httpx.get(f"{url}/metrics", timeout=10, verify=_TLS).text
    # only the two gauges' samples: parsing every histogram would take most of the time
    lines = [line for line in text.splitlines() if line.startswith(tuple(found))]
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            if sample.name in found and sample.labels == wanted:
                found[sample.name] = sample.value
    return QueueState(int(found["gpuserve_queue_depth"]), int(found["gpuserve_inflight_requests"]))


def wait_queue(
    url: str,
    model: str,
    executing: int | None = None,
    queued: int | None = None,
    deadline_s: float = 10.0,
) -> QueueState:
    """Poll :func:`queue_state` until at least ``executing`` requests run and at least
    ``queued`` wait (either None: any); returns the state seen."""
    seen: list[QueueState] = []

    def reached() -> bool:
        state = queue_state(url, model)
        seen.append(state)
        return (executing is None or state.executing >= executing) and (
            queued is None or state.queued >= queued
        )

    wait_until(reached, deadline_s, f"{model}: {executing} executing and {queued} queued")
    return seen[-1]


def ran_rows(server: InProcessServer, model: str) -> list[float]:
    """The first element of every row a fixture model that logs its rows has run (the
    ``RAN`` list of ``slow_fp32``'s ``model.py``, found through the loaded model)."""
    return _fixture_globals(server, model)["RAN"]


def held_rows(server: InProcessServer, model: str) -> dict:
    """The ``HOLD`` map of ``slow_fp32``'s ``model.py`` (tag -> threading.Event): a batch
    holding a row whose tag is mapped waits for that event before it returns."""
    return _fixture_globals(server, model)["HOLD"]


def _fixture_globals(server: InProcessServer, model: str) -> dict:
    instance = server.manager.runner(model, None).instances[0]
    return type(instance.backend.model).forward.__globals__
