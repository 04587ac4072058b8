#!/usr/bin/env python3
"""The load generator's own ceiling: ``gpuserve bench`` against wrk on trivial servers.

If ``gpuserve bench`` reaches the same request rate as wrk (a C generator) against the same
server, the server is the limit and the bench measures it faithfully; the generator's CPU use
(``client_cpu``, share of one core) shows the headroom left.

Two servers, each pinned to its own core, with the generator pinned to another:

(a) null: a few lines of uvloop that answer every ``/infer`` with a fixed V2 response, so the
    generator (not the server) is the likelier limit;
(b) gpuserve: ``gpuserve serve`` with the embedded trivial ``simple`` model (int32 add/sub).

Each pair runs ``--rounds`` times alternating, at concurrency 64 (keep-alive, closed loop).
Needs ``wrk`` and ``taskset``. Writes results/bench_ceiling-<date>.json and .md.

Usage: python benchmarks/bench_ceiling.py [--duration-s 8] [--rounds 2] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent

NULL_SERVER = r"""
import asyncio, sys, uvloop
META = (b'{"name":"null","versions":["1"],"platform":"null","inputs":[{"name":"INPUT0",'
        b'"datatype":"INT32","shape":[-1,16]},{"name":"INPUT1","datatype":"INT32",'
        b'"shape":[-1,16]}],"outputs":[{"name":"OUTPUT0","datatype":"INT32","shape":[-1,16]}]}')
BODY = (b'{"model_name":"null","outputs":[{"name":"OUTPUT0","datatype":"INT32","shape":[1,16],'
        b'"data":[0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0]}]}')
def reply(body, status=b"200 OK"):
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nx-queue-time-us: 0\r\nx-compute-time-us: 0\r\n\r\n"
            + body)
INFER, METADATA, READY = reply(BODY), reply(META), reply(b'{"ready":true}')
MISSING = reply(b'{"error":"no such endpoint"}', b"404 Not Found")
class Null(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport, self.buf = transport, b""
    def data_received(self, data):
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            length = 0
            at = head.find(b"content-length:")
            if at >= 0:
                stop = head.find(b"\r\n", at)
                length = int(head[at + 15 : stop if stop > 0 else None])
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length :]
            line = head.split(b"\r\n", 1)[0]
            if b"/infer " in line:
                self.transport.write(INFER)
            elif line.startswith(b"get /v2/models/null "):
                self.transport.write(METADATA)
            elif b"/ready " in line:
                self.transport.write(READY)
            else:
                self.transport.write(MISSING)
async def main():
    server = await asyncio.get_running_loop().create_server(
        Null, "127.0.0.1", int(sys.argv[1]), backlog=4096)
    await server.serve_forever()
uvloop.run(main())
"""

BODY = {
    "inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16},
    ]
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pinned(cpu: str, argv: list[str]) -> list[str]:
    return ["taskset", "-c", cpu, *argv]


def wait_ready(url: str, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} not ready")


def start_null(cpu: str) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    proc = subprocess.Popen(pinned(cpu, [sys.executable, "-c", NULL_SERVER, str(port)]))
    url = f"http://127.0.0.1:{port}"
    wait_ready(f"{url}/v2/models/null/ready", 30)
    return proc, url, "null"


def start_gpuserve(cpu: str, repo: Path) -> tuple[subprocess.Popen, str, str]:
    from gpuserve.config import default_model_repository

    shutil.copytree(default_model_repository() / "simple", repo / "simple")
    port = free_port()
    proc = subprocess.Popen(
        pinned(cpu, [sys.executable, "-m", "gpuserve", "serve", "--model-repository", str(repo),
                     "--host", "127.0.0.1", "--http-port", str(port), "--grpc-port", "-1",
                     "--metrics-port", "-1", "--log-level", "warning"]),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_ready(f"{url}/v2/models/simple/ready")
    return proc, url, "simple"


def run_wrk(cpu: str, url: str, model: str, args: argparse.Namespace, body: Path) -> dict:
    command = pinned(cpu, ["wrk", "-t1", f"-c{args.concurrency}", f"-d{args.duration_s}s",
                           "-s", str(HERE / "wrk_post.lua"), "--timeout", "10s",
                           f"{url}/v2/models/{model}/infer"])  # fmt: skip
    env = {**os.environ, "GPUSERVE_BENCH_BODY": str(body)}
    start = os.times()
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    end = os.times()
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    result = json.loads(line[7:])
    seconds = result["duration_us"] / 1e6
    cpu_s = (end.children_user - start.children_user) + (
        end.children_system - start.children_system
    )
    return {
        "req_per_s": result["requests"] / seconds,
        "p50_ms": result["p50_us"] / 1000,
        "p99_ms": result["p99_us"] / 1000,
        "errors": result["errors"],
        "client_cpu": cpu_s / seconds,
    }


def run_bench(cpu: str, url: str, model: str, args: argparse.Namespace, out: Path) -> dict:
    command = pinned(cpu, [sys.executable, "-m", "gpuserve", "bench", "--url", url, "-m", model,
                           "--concurrency", str(args.concurrency), "--warmup-s", "1",
                           "--window-s", str(args.duration_s / 3), "--max-windows", "3",
                           "--stable-windows", "3", "--output-dir", str(out), "--no-plot",
                           "--quiet"])  # fmt: skip
    subprocess.run(command, capture_output=True, text=True, check=True)
    level = json.loads((out / "bench.json").read_text())["levels"][0]
    return {
        "req_per_s": level["throughput_infer_per_s"],
        "p50_ms": level["latency_ms"]["p50"],
        "p99_ms": level["latency_ms"]["p99"],
        "errors": sum(level["errors"].values()),
        "client_cpu": level["client_cpu"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration-s", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--server-cpu", default="1")
    parser.add_argument("--client-cpu", default="0")
    args = parser.parse_args()
    for tool in ("wrk", "taskset"):
        if not shutil.which(tool):
            print(f"{tool} is needed (apt-get install wrk util-linux)", file=sys.stderr)
            return 2
    results: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory() as work:
        work_dir = Path(work)
        body = work_dir / "body.json"
        body.write_text(json.dumps(BODY))
        for name in ("null", "gpuserve"):
            repo = work_dir / f"repo-{name}"
            repo.mkdir()
            if name == "null":
                proc, url, model = start_null(args.server_cpu)
            else:
                proc, url, model = start_gpuserve(args.server_cpu, repo)
            runs: dict[str, list[dict]] = {"wrk": [], "gpuserve bench": []}
            try:
                for round_ in range(args.rounds):
                    runs["wrk"].append(run_wrk(args.client_cpu, url, model, args, body))
                    out = work_dir / f"bench-{name}-{round_}"
                    runs["gpuserve bench"].append(run_bench(args.client_cpu, url, model, args, out))
                    print(name, round_, {k: v[-1] for k, v in runs.items()}, flush=True)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
            results[name] = runs
    date = dt.date.today().isoformat()
    report = {"date": date, "args": vars(args), "load_average": os.getloadavg(), "results": results}
    target = HERE / "results" / f"bench_ceiling-{date}"
    target.parent.mkdir(exist_ok=True)
    target.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# bench_ceiling {date}", "",
             f"concurrency {args.concurrency}, {args.duration_s} s per run, server on CPU "
             f"{args.server_cpu}, generator on CPU {args.client_cpu}; best of {args.rounds}",
             "", "| server | generator | req/s | p50 ms | p99 ms | errors | generator CPU |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, runs in results.items():
        for tool, items in runs.items():
            best = max(items, key=lambda r: r["req_per_s"])
            lines.append(
                f"| {name} | {tool} | {best['req_per_s']:.0f} | {best['p50_ms']:.2f} | "
                f"{best['p99_ms']:.2f} | {best['errors']} | {best['client_cpu']:.0%} |"
            )
    target.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
