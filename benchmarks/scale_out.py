#!/usr/bin/env python3
"""Scale-out on one machine: N gpuserve replicas behind nginx, one replica killed under load.

1. Starts ``--replicas`` (default 2) ``python -m gpuserve serve`` processes on free loopback
   ports, each serving a repository that holds only the embedded ``simple`` model
   (INPUT0, INPUT1 INT32 [1, 16] -> OUTPUT0 = sum, OUTPUT1 = difference).
2. Starts nginx (Debian package ``nginx``) from ``scale_out_nginx.conf`` beside this script:
   one upstream with every replica, ``proxy_next_upstream error timeout http_502 http_503
   non_idempotent``, and an ``X-Upstream`` response header naming the replica that answered.
   Retrying the POST /infer on another replica is safe because inference is side-effect free:
   a model maps inputs to outputs and keeps no state, so running a request twice changes
   nothing but the time spent.
3. Runs a bounded closed-loop load (``--concurrency`` Python threads, keep-alive connections,
   ``--duration-s`` seconds at most, ``--max-requests`` in all) through nginx, checking every
   answer (status 200, OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1).
4. At ``--kill-at-s`` sends ``--kill-signal`` (default KILL: a crash, no drain) to replica 0.
5. Prints requests served per replica (before and after the kill), requests nginx retried on
   another replica, and requests lost (no answer) or failed (an error status or a wrong
   result). Exit code 0 when none was lost or failed.

All traffic stays on 127.0.0.1. Needs nginx: ``apt-get install nginx`` (or pass
``--install-nginx`` to let the script run that as root).

Usage:
    python benchmarks/scale_out.py [--replicas 2] [--duration-s 20] [--kill-at-s 8]
        [--concurrency 8] [--kill-signal KILL|TERM|none] [--output results.json]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import http.client
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
NGINX_TEMPLATE = HERE / "scale_out_nginx.conf"
LOOPBACK = "127.0.0.1"
MODEL = "simple"
WIDTH = 16  # elements per row of INPUT0 / INPUT1


@dataclasses.dataclass
class Replica:
    """One ``gpuserve serve`` process."""

    index: int
    http_port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    killed_at_s: float | None = None

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.http_port}"


@dataclasses.dataclass
class Outcome:
    """What one request got back.

    Attributes:
        sent_at_s: Send time, seconds since the load started (monotonic).
        status: HTTP status, or None when no response arrived (connection error).
        upstreams: Replica addresses nginx tried, in order (``X-Upstream``); the last answered.
        correct: Status 200 and both outputs equal to the expected sum and difference.
        error: Why the request failed, empty when it succeeded.
    """

    sent_at_s: float
    status: int | None
    upstreams: list[str]
    correct: bool
    error: str = ""


# ------------------------------------------------------------------------------------------
# processes
# ------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def find_nginx(install: bool) -> str:
    """Path of the nginx binary; installs Debian's package when asked to and allowed."""
    found = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )
    if found:
        return found
    if install and os.geteuid() == 0 and shutil.which("apt-get"):
        print("installing nginx (apt-get install nginx) ...", flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "install", "-y", "-q", "nginx"], check=True, env=env)
        return find_nginx(install=False)
    sys.exit(
        "scale_out: nginx not found. Install it (Debian: `apt-get install nginx`) or rerun "
        "with --install-nginx as root."
    )


def ensure_gpuserve_importable() -> None:
    """Uses this checkout's ``src/`` when gpuserve is not installed (here and in replicas)."""
    if importlib.util.find_spec("gpuserve") is not None:
        return
    src = HERE.parent / "src"
    if not (src / "gpuserve").is_dir():
        sys.exit("scale_out: gpuserve is not installed (pip install -e .)")
    sys.path.insert(0, str(src))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(src), os.environ.get("PYTHONPATH", "")) if p
    )


def make_repository(run_dir: Path) -> Path:
    """A model repository holding only the embedded ``simple`` model (fast to load)."""
    from gpuserve.config import default_model_repository

    repository = run_dir / "models"
    shutil.copytree(default_model_repository() / MODEL, repository / MODEL)
    return repository


def start_replica(
    index: int, repository: Path, run_dir: Path, shutdown_timeout_s: float
) -> Replica:
    port = free_port()
    log_path = run_dir / f"replica-{index}.log"
    # The gRPC and metrics ports get their own free ports too, so that replicas never collide
    # on the defaults (8001, 8002) once the server listens on them.
    env = {
        **os.environ,
        "GPUSERVE_GRPC_PORT": str(free_port()),
        "GPUSERVE_METRICS_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    argv = [
        sys.executable,
        "-m",
        "gpuserve",
        "serve",
        "--model-repository",
        str(repository),
        "--host",
        LOOPBACK,
        "--http-port",
        str(port),
        "--log-level",
        "warning",
        "--shutdown-timeout-s",
        str(shutdown_timeout_s),
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL
        )
    return Replica(index=index, http_port=port, process=process, log_path=log_path)


def wait_ready(
    port: int,
    deadline_s: float,
    process: subprocess.Popen[bytes] | None,
    name: str,
    log_path: Path | None = None,
) -> None:
    """Polls GET /v2/health/ready until 200; fails with the process's log past the deadline."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if process is not None and process.poll() is not None:
            break
        try:
            conn = http.client.HTTPConnection(LOOPBACK, port, timeout=2)
            conn.request("GET", "/v2/health/ready")
            if conn.getresponse().status == 200:
                conn.close()
                return
            conn.close()
        except OSError:
            pass
        time.sleep(0.2)
    log = log_path.read_text(errors="replace")[-4000:] if log_path and log_path.exists() else ""
    raise RuntimeError(f"{name} on port {port} did not become ready\n{log}")


def write_nginx_conf(run_dir: Path, listen_port: int, replicas: list[Replica]) -> Path:
    servers = "\n".join(
        f"        server {r.address} max_fails=1 fail_timeout=5s;" for r in replicas
    )
    text = (
        NGINX_TEMPLATE.read_text()
        .replace("@RUN_DIR@", str(run_dir))
        .replace("@SERVERS@", servers)
        .replace("@LISTEN_PORT@", str(listen_port))
        .replace("@TRIES@", str(len(replicas)))
    )
    leftover = re.findall(r"@[A-Z_]+@", text)
    if leftover:
        raise ValueError(f"unfilled placeholders in {NGINX_TEMPLATE.name}: {leftover}")
    path = run_dir / "nginx.conf"
    path.write_text(text)
    return path


def stop(process: subprocess.Popen[bytes], sig: signal.Signals, timeout_s: float) -> None:
    if process.poll() is not None:
        return
    process.send_signal(sig)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=5)


# ------------------------------------------------------------------------------------------
# load
# ------------------------------------------------------------------------------------------


def infer_body(rng: random.Random) -> tuple[bytes, list[int], list[int]]:
    a = [rng.randrange(-1000, 1000) for _ in range(WIDTH)]
    b = [rng.randrange(-1000, 1000) for _ in range(WIDTH)]
    body = {
        "inputs": [
            {"name": "INPUT0", "shape": [1, WIDTH], "datatype": "INT32", "data": a},
            {"name": "INPUT1", "shape": [1, WIDTH], "datatype": "INT32", "data": b},
        ]
    }
    return json.dumps(body).encode(), a, b


def check_result(payload: bytes, a: list[int], b: list[int]) -> str:
    """Empty string when OUTPUT0 = a + b and OUTPUT1 = a - b, else what is wrong."""
    try:
        outputs = {o["name"]: o["data"] for o in json.loads(payload)["outputs"]}
    except (ValueError, KeyError, TypeError) as err:
        return f"unreadable response: {err!r}"
    if outputs.get("OUTPUT0") != [x + y for x, y in zip(a, b, strict=True)]:
        return "wrong OUTPUT0"
    if outputs.get("OUTPUT1") != [x - y for x, y in zip(a, b, strict=True)]:
        return "wrong OUTPUT1"
    return ""


def preflight(port: int, name: str) -> None:
    """One checked inference straight to ``port``; stops the run early if it fails."""
    body, a, b = infer_body(random.Random(0))
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=30)
    try:
        conn.request(
            "POST", f"/v2/models/{MODEL}/infer", body, {"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        payload = response.read()
    finally:
        conn.close()
    problem = check_result(payload, a, b) if response.status == 200 else f"HTTP {response.status}"
    if problem:
        raise RuntimeError(f"{name}: a single inference failed ({problem}): {payload[:300]!r}")


class Load:
    """Closed-loop clients: each thread sends one request, waits for its answer, repeats."""

    def __init__(self, port: int, concurrency: int, duration_s: float, max_requests: int) -> None:
        self.port = port
        self.concurrency = concurrency
        self.duration_s = duration_s
        self.max_requests = max_requests
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._issued = 0
        self.started = 0.0

    def _take_ticket(self) -> bool:
        with self._lock:
            if self._issued >= self.max_requests:
                return False
            self._issued += 1
            return True

    def _worker(self, seed: int) -> None:
        rng = random.Random(seed)
        path = f"/v2/models/{MODEL}/infer"
        conn: http.client.HTTPConnection | None = None
        end = self.started + self.duration_s
        while time.monotonic() < end and self._take_ticket():
            body, a, b = infer_body(rng)
            sent = time.monotonic() - self.started
            if conn is None:
                conn = http.client.HTTPConnection(LOOPBACK, self.port, timeout=30)
            try:
                conn.request("POST", path, body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                payload = response.read()
            except (OSError, http.client.HTTPException) as err:
                # No answer at all: the request is lost as far as the client knows.
                conn.close()
                conn = None
                outcome = Outcome(sent, None, [], False, f"no response: {err!r}")
            else:
                upstreams = [
                    u.strip()
                    for u in (response.getheader("X-Upstream") or "").split(",")
                    if u.strip()
                ]
                if response.status == 200:
                    problem = check_result(payload, a, b)
                else:
                    problem = f"HTTP {response.status}: {payload[:200]!r}"
                outcome = Outcome(sent, response.status, upstreams, not problem, problem)
                if response.getheader("Connection", "").lower() == "close":
                    conn.close()
                    conn = None
            with self._lock:
                self.outcomes.append(outcome)
        if conn is not None:
            conn.close()

    def run(self, at_s: float | None, action: Callable[[], None] | None) -> None:
        """Runs the load; calls ``action()`` once, ``at_s`` seconds into it."""
        self.started = time.monotonic()
        threads = [
            threading.Thread(target=self._worker, args=(seed,), daemon=True)
            for seed in range(self.concurrency)
        ]
        for thread in threads:
            thread.start()
        if at_s is not None and action is not None:
            time.sleep(max(0.0, at_s - (time.monotonic() - self.started)))
            action()
        for thread in threads:
            # Each request has a 30 s socket timeout; past that the thread is abandoned.
            thread.join(timeout=self.duration_s + 60)


# ------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------


def summarise(
    load: Load, replicas: list[Replica], kill_at_s: float | None, kill_signal: str
) -> dict[str, object]:
    by_address = {r.address: r.index for r in replicas}
    per_replica: collections.Counter[int] = collections.Counter()
    before: collections.Counter[int] = collections.Counter()
    after: collections.Counter[int] = collections.Counter()
    retried = 0
    lost = 0
    failed = 0
    errors: collections.Counter[str] = collections.Counter()
    for o in load.outcomes:
        if o.status is None:
            lost += 1
            errors[o.error.split(":")[0]] += 1
            continue
        if len(o.upstreams) > 1:
            retried += 1
        if not o.correct:
            failed += 1
            errors[o.error[:80]] += 1
            continue
        replica = by_address.get(o.upstreams[-1], -1) if o.upstreams else -1
        per_replica[replica] += 1
        if kill_at_s is not None and o.sent_at_s >= kill_at_s:
            after[replica] += 1
        else:
            before[replica] += 1
    elapsed = max((o.sent_at_s for o in load.outcomes), default=0.0)
    total = len(load.outcomes)
    return {
        "replicas": len(replicas),
        "concurrency": load.concurrency,
        "duration_s": round(elapsed, 2),
        "kill_signal": kill_signal,
        "killed_replica": 0 if kill_at_s is not None else None,
        "kill_at_s": kill_at_s,
        "requests": total,
        "throughput_rps": round(total / elapsed, 1) if elapsed else 0.0,
        "served_per_replica": {str(k): per_replica[k] for k in sorted(per_replica)},
        "served_before_kill": {str(k): before[k] for k in sorted(before)},
        "served_after_kill": {str(k): after[k] for k in sorted(after)},
        "retried_on_another_replica": retried,
        "lost_no_response": lost,
        "failed_error_or_wrong_result": failed,
        "errors": dict(errors),
    }


def print_report(result: dict[str, object]) -> None:
    print()
    print(
        f"replicas: {result['replicas']}, concurrency: {result['concurrency']}, "
        f"load: {result['duration_s']} s, {result['requests']} requests "
        f"({result['throughput_rps']} req/s)"
    )
    if result["kill_at_s"] is not None:
        print(f"replica 0 got SIG{result['kill_signal']} at {result['kill_at_s']} s")
    print(f"{'replica':>8} {'served':>8} {'before kill':>12} {'after kill':>11}")
    served = result["served_per_replica"]
    before = result["served_before_kill"]
    after = result["served_after_kill"]
    assert isinstance(served, dict) and isinstance(before, dict) and isinstance(after, dict)
    for key in served:
        print(f"{key:>8} {served[key]:>8} {before.get(key, 0):>12} {after.get(key, 0):>11}")
    print(f"retried by nginx on another replica: {result['retried_on_another_replica']}")
    print(f"lost (no response): {result['lost_no_response']}")
    print(f"failed (error status or wrong result): {result['failed_error_or_wrong_result']}")
    if "killed_replica_exit_code" in result:
        print(f"replica 0 exit code after SIGTERM: {result['killed_replica_exit_code']}")
    if result["errors"]:
        print(f"errors: {result['errors']}")


# ------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8, help="client threads")
    parser.add_argument("--duration-s", type=float, default=20.0, help="load duration, seconds")
    parser.add_argument("--max-requests", type=int, default=200_000, help="cap on requests sent")
    parser.add_argument(
        "--kill-at-s",
        type=float,
        default=8.0,
        help="seconds into the load at which replica 0 gets --kill-signal",
    )
    parser.add_argument(
        "--kill-signal",
        choices=["KILL", "TERM", "none"],
        default="KILL",
        help="KILL: a crash; TERM: a graceful drain; none: no replica is stopped",
    )
    parser.add_argument(
        "--shutdown-timeout-s", type=float, default=10.0, help="replicas' drain timeout on SIGTERM"
    )
    parser.add_argument(
        "--install-nginx",
        action="store_true",
        help="apt-get install nginx when it is missing (as root)",
    )
    parser.add_argument("--output", type=Path, help="also write the figures as JSON here")
    parser.add_argument("--keep", action="store_true", help="keep the run folder (logs, config)")
    args = parser.parse_args()
    if args.replicas < 2 and args.kill_signal != "none":
        parser.error("killing a replica needs --replicas 2 or more")

    nginx = find_nginx(args.install_nginx)
    ensure_gpuserve_importable()
    run_dir = Path(tempfile.mkdtemp(prefix="gpuserve-scale-out-"))
    # nginx workers run as an unprivileged user when started as root: let them reach the run
    # folder's temp paths.
    run_dir.chmod(0o755)
    replicas: list[Replica] = []
    nginx_proc: subprocess.Popen[bytes] | None = None
    try:
        repository = make_repository(run_dir)
        replicas = [
            start_replica(i, repository, run_dir, args.shutdown_timeout_s)
            for i in range(args.replicas)
        ]
        for r in replicas:
            wait_ready(r.http_port, 180.0, r.process, f"replica {r.index}", r.log_path)
        print(
            f"{len(replicas)} replicas ready: {', '.join(r.address for r in replicas)}", flush=True
        )

        listen_port = free_port()
        conf = write_nginx_conf(run_dir, listen_port, replicas)
        nginx_log = (run_dir / "nginx.out").open("wb")
        nginx_proc = subprocess.Popen(
            [nginx, "-p", str(run_dir), "-c", str(conf)],
            stdout=nginx_log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        wait_ready(listen_port, 15.0, nginx_proc, "nginx", run_dir / "nginx-error.log")
        preflight(listen_port, "nginx")
        print(
            f"nginx on {LOOPBACK}:{listen_port}; load: {args.concurrency} clients for "
            f"{args.duration_s} s",
            flush=True,
        )

        kill_at = args.kill_at_s if args.kill_signal != "none" else None

        def kill_first() -> None:
            victim = replicas[0]
            sig = signal.SIGKILL if args.kill_signal == "KILL" else signal.SIGTERM
            victim.process.send_signal(sig)
            victim.killed_at_s = args.kill_at_s
            print(
                f"sent SIG{args.kill_signal} to replica 0 (pid {victim.process.pid}) at "
                f"{args.kill_at_s} s",
                flush=True,
            )

        load = Load(listen_port, args.concurrency, args.duration_s, args.max_requests)
        load.run(kill_at, kill_first if kill_at is not None else None)

        result = summarise(load, replicas, kill_at, args.kill_signal)
        if args.kill_signal == "TERM":
            code = replicas[0].process.wait(timeout=args.shutdown_timeout_s + 30)
            result["killed_replica_exit_code"] = code
        print_report(result)
        if args.output:
            args.output.write_text(json.dumps(result, indent=2) + "\n")
        ok = result["lost_no_response"] == 0 and result["failed_error_or_wrong_result"] == 0
        return 0 if ok else 1
    finally:
        if nginx_proc is not None:
            stop(nginx_proc, signal.SIGQUIT, 10)
        for r in replicas:
            stop(r.process, signal.SIGTERM, args.shutdown_timeout_s + 15)
        if args.keep:
            print(f"run folder kept: {run_dir}")
        else:
            shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
