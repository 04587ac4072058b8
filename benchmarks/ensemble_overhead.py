#!/usr/bin/env python3
"""What running text_embedding as an ensemble costs: tokenizer -> encoder -> pooling inside the
server (``text_embedding_pipeline``) against the one-model ``text_embedding``, same server,
same run.

One ``gpuserve serve`` serves ``examples/ensemble/model_repository`` (both models). First the
two are checked to agree (cosine >= 0.9999 per sentence); then ``gpuserve bench`` loads each
in turn at a closed-loop concurrency of 32 with one sentence per request, alternating the
order round by round so that drift on a shared machine hits both alike. The result is the
median throughput of each and their ratio (target: ensemble / single >= 0.9), with p50/p99
latencies, written to ``benchmarks/results/ensemble_overhead-<date>.json`` and ``.md``.

Usage: python benchmarks/ensemble_overhead.py [--window-s 10] [--rounds 3] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
REPOSITORY = HERE.parent / "examples" / "ensemble" / "model_repository"
SINGLE, ENSEMBLE = "text_embedding", "text_embedding_pipeline"
SENTENCES = [
    "The quick brown fox jumps over the lazy dog near the quiet river bank.",
    "gpuserve batches requests dynamically.",
    "An ensemble runs a pipeline of models inside the server without a client round trip.",
    "Short text.",
    "Sentence embeddings map text to vectors whose cosine similarity reflects meaning, "
    "which makes them useful for search, clustering and deduplication.",
    "Each step of the pipeline batches with its own model's traffic.",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(repository: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "gpuserve", "serve",
        "--model-repository", str(repository),
        "--http-port", str(port), "--grpc-port", "-1", "--metrics-port", "-1",
    ]  # fmt: skip
    with log.open("wb") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2).status_code == 200:
                ready = [
                    httpx.get(f"http://127.0.0.1:{port}/v2/models/{m}/ready", timeout=2)
                    for m in (SINGLE, ENSEMBLE)
                ]
                if all(r.status_code == 200 for r in ready):
                    return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.kill()
    raise TimeoutError("the server was not ready after 300 s")


def embed(url: str, model: str) -> np.ndarray:
    body = {
        "inputs": [
            {"name": "TEXT", "datatype": "BYTES", "shape": [len(SENTENCES), 1], "data": SENTENCES}
        ]
    }
    answer = httpx.post(f"{url}/v2/models/{model}/infer", json=body, timeout=60)
    answer.raise_for_status()
    out = answer.json()["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def bench(url: str, model: str, lines: Path, args: argparse.Namespace, out: Path) -> dict:
    """One ``gpuserve bench`` level; returns its ``levels[0]`` record."""
    command = [
        sys.executable, "-m", "gpuserve", "bench", "--url", url, "-m", model,
        "--concurrency", str(args.concurrency), "--input-lines", str(lines),
        "--warmup-s", str(args.warmup_s), "--window-s", str(args.window_s),
        "--stable-windows", "1", "--max-windows", "1", "--tokens", "words",
        "--output-dir", str(out), "--overwrite", "--no-plot", "--quiet",
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=args.window_s * 4 + 120)
    level: dict = json.loads((out / "bench.json").read_text())["levels"][0]
    return level


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window-s", type=float, default=10.0, help="measurement per run")
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each model")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--repository", type=Path, default=REPOSITORY)
    parser.add_argument("--output-dir", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)

    scratch = Path(tempfile.mkdtemp(prefix="ensemble-overhead-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(args.repository, port, scratch / "server.log")
    runs: dict[str, list[dict]] = {SINGLE: [], ENSEMBLE: []}
    try:
        single, pipeline = embed(url, SINGLE), embed(url, ENSEMBLE)
        cosines = (single * pipeline).sum(axis=1)
        print(f"cosine ensemble vs single: min {cosines.min():.6f}")
        lines = scratch / "sentences.txt"
        lines.write_text("\n".join(SENTENCES) + "\n")
        for index in range(args.rounds):
            order = (SINGLE, ENSEMBLE) if index % 2 == 0 else (ENSEMBLE, SINGLE)
            for model in order:
                level = bench(url, model, lines, args, scratch / f"{model}-{index}")
                runs[model].append(level)
                print(
                    f"round {index + 1} {model:24s} {level['throughput_infer_per_s']:8.1f} req/s "
                    f"p50 {level['latency_ms']['p50']:7.1f} ms  errors {level['errors']}"
                )
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()

    def median(model: str, key: str) -> float:
        values = [
            r["throughput_infer_per_s"] if key == "rps" else r["latency_ms"][key]
            for r in runs[model]
        ]
        return float(statistics.median(values))

    ratio = median(ENSEMBLE, "rps") / median(SINGLE, "rps")
    per_round = [
        e["throughput_infer_per_s"] / s["throughput_infer_per_s"]
        for e, s in zip(runs[ENSEMBLE], runs[SINGLE], strict=True)
    ]
    result = {
        "benchmark": "ensemble_overhead",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host_cpus": os.cpu_count(),
        "concurrency": args.concurrency,
        "window_s": args.window_s,
        "rounds": args.rounds,
        "cosine_min": float(cosines.min()),
        "single_rps": median(SINGLE, "rps"),
        "ensemble_rps": median(ENSEMBLE, "rps"),
        "ratio": ratio,
        "ratio_per_round": per_round,
        "single_p50_ms": median(SINGLE, "p50"),
        "ensemble_p50_ms": median(ENSEMBLE, "p50"),
        "single_p99_ms": median(SINGLE, "p99"),
        "ensemble_p99_ms": median(ENSEMBLE, "p99"),
        "target_ratio": 0.9,
        "runs": runs,
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    stem = args.output_dir / f"ensemble_overhead-{dt.date.today().isoformat()}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    table = (
        f"# Ensemble overhead ({result['date']}, {os.cpu_count()} CPUs, c={args.concurrency})\n\n"
        "| model | req/s (median) | p50 ms | p99 ms |\n|---|---|---|---|\n"
        f"| {SINGLE} | {result['single_rps']:.1f} | {result['single_p50_ms']:.1f} | "
        f"{result['single_p99_ms']:.1f} |\n"
        f"| {ENSEMBLE} | {result['ensemble_rps']:.1f} | {result['ensemble_p50_ms']:.1f} | "
        f"{result['ensemble_p99_ms']:.1f} |\n\n"
        f"ratio ensemble / single: **{ratio:.3f}** (target >= 0.9; per round "
        f"{', '.join(f'{r:.3f}' for r in per_round)}); cosine min {result['cosine_min']:.6f}\n"
    )
    stem.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
