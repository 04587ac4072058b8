"""What request tracing costs: requests/s with tracing off and on, in interleaved rounds.

Each round starts ``gpuserve serve`` (a child process) on a repository holding only the
built-in ``simple`` model (INT32 add/sub of two [1, 16] tensors: next to no compute, so
the serving path is all there is), once per arm, and drives it for ``--seconds`` with
``--concurrency`` closed-loop HTTP clients (httpx, JSON tensors). The arms:

* ``off, no extra``: no tracing, the ``tracing`` extra hidden from the server process (as
  if ``opentelemetry`` were not installed);
* ``off``: no tracing, the extra installed;
* ``otel rate=1000``: ``--trace-config mode=opentelemetry`` at Triton's default rate;
* ``otel rate=1``: every request traced and exported (OTLP/HTTP to a receiver in this
  process that answers 200 and drops the spans).

The arms' order rotates from round to round. Prints the median requests/s per arm and its
ratio to ``off, no extra``::

    .venv/bin/python benchmarks/tracing_cost.py --rounds 3 --seconds 5
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers import SubprocessServer  # noqa: E402

HIDE = ROOT / "tests" / "fixtures" / "hide_modules"
BODY = {
    "inputs": [
        {"name": n, "datatype": "INT32", "shape": [1, 16], "data": list(range(16))}
        for n in ("INPUT0", "INPUT1")
    ]
}


class Sink:
    """An OTLP/HTTP endpoint that accepts every export and keeps only a count of bytes."""

    def __init__(self) -> None:
        self.bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                sink.bytes += len(self.rfile.read(int(self.headers.get("content-length", 0))))
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def arms(sink: Sink) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Arm -> (extra serve flags, extra environment)."""
    otel = ["--trace-config", "mode=opentelemetry", "--trace-config", "level=TIMESTAMPS"]
    otel += ["--trace-config", f"opentelemetry,url={sink.url}"]
    hidden = {
        "PYTHONPATH": f"{HIDE}:{ROOT / 'src'}",
        "GPUSERVE_TEST_HIDE_MODULES": "opentelemetry",
    }
    return {
        "off, no extra": ([], hidden),
        "off": ([], {}),
        "otel rate=1000": ([*otel, "--trace-config", "rate=1000"], {}),
        "otel rate=1": ([*otel, "--trace-config", "rate=1"], {}),
    }


async def drive(url: str, concurrency: int, seconds: float) -> float:
    """Requests/s of ``concurrency`` closed-loop clients over ``seconds``."""
    done = 0
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as http:

        async def worker(until: float) -> None:
            nonlocal done
            while time.perf_counter() < until:
                answer = await http.post("/v2/models/simple/infer", json=BODY)
                assert answer.status_code == 200, answer.text
                done += 1

        warm = time.perf_counter() + 1.0
        await asyncio.gather(*(worker(warm) for _ in range(concurrency)))
        done = 0
        start = time.perf_counter()
        await asyncio.gather(*(worker(start + seconds) for _ in range(concurrency)))
        return done / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    sink = Sink()
    repository = Path(tempfile.mkdtemp(prefix="gpuserve-tracing-cost-"))
    shutil.copytree(ROOT / "src/gpuserve/default_repository/simple", repository / "simple")
    plan = arms(sink)
    names = list(plan)
    rates: dict[str, list[float]] = {name: [] for name in names}
    try:
        for round_index in range(args.rounds):
            order = names[round_index % len(names) :] + names[: round_index % len(names)]
            for name in order:
                flags, env = plan[name]
                server = SubprocessServer("--model-repository", str(repository), *flags, env=env)
                try:
                    rate = asyncio.run(drive(server.url, args.concurrency, args.seconds))
                finally:
                    server.stop()
                rates[name].append(rate)
                print(f"round {round_index + 1} {name}: {rate:.0f} req/s", flush=True)
    finally:
        shutil.rmtree(repository, ignore_errors=True)
    base = statistics.median(rates[names[0]])
    for name in names:
        median = statistics.median(rates[name])
        rounds = ", ".join(f"{r:.0f}" for r in rates[name])
        ratio = median / base
        print(f"{name}: {median:.0f} req/s (x{ratio:.3f} of off, no extra; rounds {rounds})")
    print(f"spans exported to the sink: {sink.bytes} bytes")


if __name__ == "__main__":
    main()
