#!/usr/bin/env python3
"""Load on demand (issue 18): time to first answer of a cold model, and warm latency while
other models load and evict in the background.

One server (``gpuserve serve --load-on-demand --max-loaded-models 3``, pinned to
``--server-cpus``) on a copy of the embedded repository plus ``--churn-models`` Python models
that each hold 40 MB (touched) and answer at once; the client (this process) runs on
``--client-cpus``.

1. Cold start: the first ``text_embedding`` request after the server is ready (nothing
   loaded), from send to answer; then the same for ``text_embedding_onnx``, its ONNX export by
   ``gpuserve export`` (made before the server starts; ``--no-onnx`` leaves it out).
2. Warm latency of ``text_embedding`` (one text per request, closed loop at ``--conc``),
   ``--duration`` s without churn, then ``--duration`` s while a background client asks the
   churn models at random (each miss loads one and evicts the least recently used);
   p50/p99 of both and their ratio (target p99 within 1.5x). Both phases alternate
   ``--rounds`` times. The churn client pauses ``--churn-interval-s`` between requests
   (default 0.25 s: up to ~3 loads and evictions a second; 0 is back to back, which on one
   server core leaves the warm model a share of the CPU only).

Usage::

    .venv/bin/python benchmarks/cold_start.py                     # about 2 minutes
    .venv/bin/python benchmarks/cold_start.py --duration 5 --no-onnx

Results: ``benchmarks/results/cold-start-<date>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

CHURN_PY = """
import numpy as np

from gpuserve import PythonModel


class Model(PythonModel):
    def load(self, context):
        self.ballast = np.ones(40 * 1024 * 1024 // 8, dtype=np.float64)

    def forward(self, batch):
        return {"OUTPUT0": batch["INPUT0"]}
"""

CHURN_CONFIG = """backend: python
max_batch_size: 4
inputs: [{name: INPUT0, datatype: FP32, shape: [1]}]
outputs: [{name: OUTPUT0, datatype: FP32, shape: [1]}]
instance_group: [{count: 1, kind: cpu}]
"""

TEXT_BODY = {
    "inputs": [
        {
            "name": "TEXT",
            "shape": [1, 1],
            "datatype": "BYTES",
            "data": ["a short sentence about serving many models on one device"],
        }
    ]
}
CHURN_BODY = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def build_repository(root: Path, churn: int, onnx: bool) -> float | None:
    """The default repository, ``churn`` churn models, and (``onnx``) text_embedding's ONNX
    export; returns the export's duration in seconds, or None."""
    from gpuserve.config import default_model_repository

    shutil.copytree(default_model_repository(), root, ignore=shutil.ignore_patterns("__pycache__"))
    for i in range(churn):
        folder = root / f"churn{i}"
        (folder / "1").mkdir(parents=True)
        (folder / "config.yaml").write_text(CHURN_CONFIG)
        (folder / "1" / "model.py").write_text(CHURN_PY)
    if not onnx:
        return None
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "gpuserve", "export", "text_embedding", "--model-repository",
         str(root), "--to-model", "text_embedding_onnx"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode != 0:
        print("export failed, ONNX point left out:", done.stderr[-2000:], file=sys.stderr)
        return None
    return time.monotonic() - started


class Server:
    def __init__(self, repo: Path, cpus: str, max_loaded: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable, "-m", "gpuserve", "serve", "--model-repository", str(repo),
            "--host", "127.0.0.1", "--http-port", str(self.port), "--grpc-port", "-1",
            "--metrics-port", "-1", "--load-on-demand", "--max-loaded-models", str(max_loaded),
            "--log-level", "warning",
        ]  # fmt: skip
        if shutil.which("taskset") and cpus:
            command = ["taskset", "-c", cpus, *command]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_NUM_THREADS": "1"}
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the server
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        end = time.monotonic() + 120
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(self.output())
            try:
                if httpx.get(f"{self.url}/v2/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError("server not ready")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def first_answer_s(url: str, model: str) -> float:
    started = time.monotonic()
    response = httpx.post(f"{url}/v2/models/{model}/infer", json=TEXT_BODY, timeout=300)
    elapsed = time.monotonic() - started
    response.raise_for_status()
    return elapsed


def warm_latencies(url: str, duration_s: float, conc: int) -> list[float]:
    samples: list[float] = []
    lock = threading.Lock()
    end = time.monotonic() + duration_s

    def loop() -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            mine = []
            while time.monotonic() < end:
                started = time.monotonic()
                response = client.post("/v2/models/text_embedding/infer", json=TEXT_BODY)
                mine.append(time.monotonic() - started)
                response.raise_for_status()
            with lock:
                samples.extend(mine)

    threads = [threading.Thread(target=loop) for _ in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return samples


class Churn:
    """A background client asking the churn models at random (loads and evictions)."""

    def __init__(self, url: str, models: int, interval_s: float) -> None:
        self.url, self.models, self.interval_s = url, models, interval_s
        self.stop_event = threading.Event()
        self.requests = 0
        self.failures = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Churn:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        self.thread.join(60)

    def _run(self) -> None:
        rng = random.Random(7)
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self.stop_event.is_set():
                name = f"churn{rng.randrange(self.models)}"
                response = client.post(f"/v2/models/{name}/infer", json=CHURN_BODY)
                self.requests += 1
                self.failures += response.status_code != 200
                self.stop_event.wait(self.interval_s)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def evictions(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("gpuserve_model_evictions_total{")
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=12.0, help="seconds per phase")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--conc", type=int, default=4)
    parser.add_argument("--churn-models", type=int, default=6)
    parser.add_argument("--max-loaded-models", type=int, default=4)
    parser.add_argument(
        "--churn-interval-s",
        type=float,
        default=0.25,
        help="pause of the churn client between its requests (0: back to back)",
    )
    parser.add_argument("--server-cpus", default="1")
    parser.add_argument("--client-cpus", default="0")
    parser.add_argument("--no-onnx", action="store_true")
    args = parser.parse_args()
    if args.client_cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in args.client_cpus.split(",")})
    result: dict[str, object] = {"args": vars(args), "load_avg_start": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        export_s = build_repository(repo, args.churn_models, not args.no_onnx)
        result["onnx_export_s"] = export_s
        server = Server(repo, args.server_cpus, args.max_loaded_models)
        try:
            result["cold_text_embedding_s"] = first_answer_s(server.url, "text_embedding")
            if export_s is not None:
                result["cold_text_embedding_onnx_s"] = first_answer_s(
                    server.url, "text_embedding_onnx"
                )
            warm_latencies(server.url, 2.0, args.conc)  # warm-up
            quiet: list[float] = []
            churned: list[float] = []
            churn_requests = churn_failures = 0
            before = evictions(server.url)
            for _ in range(args.rounds):
                quiet += warm_latencies(server.url, args.duration, args.conc)
                with Churn(server.url, args.churn_models, args.churn_interval_s) as churn:
                    churned += warm_latencies(server.url, args.duration, args.conc)
                churn_requests += churn.requests
                churn_failures += churn.failures
            result["evictions_during_churn"] = evictions(server.url) - before
        finally:
            server.stop()
    for label, values in (("no_churn", quiet), ("churn", churned)):
        result[label] = {
            "requests": len(values),
            "p50_ms": 1000 * statistics.median(values),
            "p99_ms": 1000 * percentile(values, 0.99),
        }
    result["churn_requests"] = churn_requests
    result["churn_failures"] = churn_failures
    no_churn, churn_point = result["no_churn"], result["churn"]
    assert isinstance(no_churn, dict) and isinstance(churn_point, dict)
    result["p50_ratio"] = churn_point["p50_ms"] / no_churn["p50_ms"]
    result["p99_ratio"] = churn_point["p99_ms"] / no_churn["p99_ms"]
    result["load_avg_end"] = os.getloadavg()
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"cold-start-{dt.date.today().isoformat()}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    lines = [
        "# Load on demand: cold start and warm latency under churn",
        "",
        f"command: `{' '.join(sys.argv)}`",
        "",
        f"- cold text_embedding, first answer: {result['cold_text_embedding_s']:.2f} s",
    ]
    if "cold_text_embedding_onnx_s" in result:
        lines.append(
            f"- cold text_embedding_onnx, first answer: {result['cold_text_embedding_onnx_s']:.2f}"
            f" s (export took {export_s:.1f} s)"
        )
    lines += [
        "",
        "| phase | requests | p50 ms | p99 ms |",
        "|---|---|---|---|",
        f"| no churn | {no_churn['requests']} | {no_churn['p50_ms']:.2f} | "
        f"{no_churn['p99_ms']:.2f} |",
        f"| churn | {churn_point['requests']} | {churn_point['p50_ms']:.2f} | "
        f"{churn_point['p99_ms']:.2f} |",
        "",
        f"ratio churn/no churn: p50 {result['p50_ratio']:.2f}x, p99 {result['p99_ratio']:.2f}x "
        f"(target p99 <= 1.5x); churn: {churn_requests} requests, {churn_failures} failed, "
        f"{result['evictions_during_churn']:.0f} evictions; load average "
        f"{result['load_avg_start']} -> {result['load_avg_end']}",
    ]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
