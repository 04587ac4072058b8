#!/usr/bin/env python3
"""Adaptive batching against the fixed default on text_embedding: a concurrency sweep of each.

Serves the embedded ``text_embedding`` twice from temporary copies of its folder: (a) its
shipped config (fixed ``max_queue_delay_us``), (b) the same with
``dynamic_batching.adaptive.target_p99_ms`` set, and runs the same closed-loop sweep
(``gpuserve bench``) against each, level by level in turn (both servers stay up; the idle
one costs nothing), so a busy shared machine skews both alike.
Writes results/adaptive_batching-<date>.json/.md/.png.

Usage: python benchmarks/adaptive_batching.py [--target-ms 50] [--concurrency 1:64:x2]
       [--model text_embedding] [--model-repository DIR] [--window-s 2]
       [--server-cpus 1] [--client-cpus 0] [--torch-threads 1]   (as serve_vs_raw.py pins)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
from pathlib import Path

import yaml

from gpuserve.bench.benchmark import BenchConfig, run_benchmark
from gpuserve.bench.candidate_server import CandidateServer
from gpuserve.bench.loadgen import LevelResult, LoadSettings
from gpuserve.bench.report import level_row, plot_latency_throughput
from gpuserve.bench.spec import parse_cpus, parse_levels
from gpuserve.config import default_model_repository

HERE = Path(__file__).resolve().parent


def show(label: str, result: LevelResult) -> None:
    row = level_row(result)
    print(
        f"{label:>8} c={result.level:<3g} {row['throughput_infer_per_s']:8.1f}/s "
        f"p50 {row['p50_ms']:7.1f} p99 {row['p99_ms']:7.1f} ms errors {row['errors'] or 0}",
        flush=True,
    )


def interleaved(model_dir: Path, configs: dict[str, dict], args: argparse.Namespace) -> dict:
    """Serve every config at once (an idle server costs nothing) and measure them level by
    level in turn, so drift of a shared machine hits all of them alike."""
    settings = LoadSettings(warmup_s=args.warmup_s, window_s=args.window_s, max_windows=6)
    results: dict[str, list[LevelResult]] = {label: [] for label in configs}
    with tempfile.TemporaryDirectory(prefix="adaptive-") as work:
        servers = {
            label: CandidateServer(
                model_dir,
                data,
                Path(work),
                [],
                args.server_cpus,
                {"OMP_NUM_THREADS": str(args.torch_threads)},
            )
            for label, data in configs.items()
        }
        try:
            for server in servers.values():
                server.wait_ready(300, model_dir.name)
            for level in parse_levels(args.concurrency):
                for label, server in servers.items():
                    config = BenchConfig(url=server.url, model=model_dir.name, levels=[level],
                                         settings=settings)  # fmt: skip
                    [result] = run_benchmark(config).levels
                    results[label].append(result)
                    show(label, result)
        finally:
            for server in servers.values():
                server.stop()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="text_embedding")
    parser.add_argument("--model-repository", type=Path, default=default_model_repository())
    parser.add_argument("--target-ms", type=float, default=50.0)
    parser.add_argument("--concurrency", default="1:64:x2")
    parser.add_argument("--warmup-s", type=float, default=1.0)
    parser.add_argument("--window-s", type=float, default=2.0)
    parser.add_argument("--server-cpus", default="1", help="taskset list for the servers")
    parser.add_argument("--client-cpus", default="0", help="CPUs of the load generator")
    parser.add_argument("--torch-threads", type=int, default=1, help="OMP_NUM_THREADS of servers")
    args = parser.parse_args()
    if args.client_cpus:
        os.sched_setaffinity(0, parse_cpus(args.client_cpus))
    model_dir = args.model_repository / args.model
    fixed = yaml.safe_load((model_dir / "config.yaml").read_text())
    adaptive = json.loads(json.dumps(fixed))
    adaptive.setdefault("dynamic_batching", {})["adaptive"] = {"target_p99_ms": args.target_ms}
    results = interleaved(
        model_dir, {"fixed": fixed, f"adaptive {args.target_ms:g} ms": adaptive}, args
    )
    date = dt.date.today().isoformat()
    target = HERE / "results" / f"adaptive_batching-{date}"
    target.parent.mkdir(exist_ok=True)
    document = {
        "date": date,
        "model": args.model,
        "args": {k: str(v) for k, v in vars(args).items()},
        "load_average": os.getloadavg(),
        "results": {k: [level_row(r) for r in v] for k, v in results.items()},
    }
    target.with_suffix(".json").write_text(json.dumps(document, indent=2) + "\n")
    plot_latency_throughput(
        results,
        target.with_suffix(".png"),
        f"{args.model}: fixed delay vs adaptive batching",
        args.target_ms,
    )
    lines = [f"# adaptive batching vs fixed, {args.model}, {date}", "",
             "| conc | " + " | ".join(f"{k} rows/s | {k} p99 ms" for k in results) + " |",
             "|---|" + "---|---|" * len(results)]  # fmt: skip
    by_level = {k: {r.level: level_row(r) for r in v} for k, v in results.items()}
    for level in sorted({r.level for v in results.values() for r in v}):
        cells = []
        for key in results:
            row = by_level[key].get(level)
            cells += (
                ["-", "-"]
                if row is None
                else [f"{row['throughput_rows_per_s']:.1f}", f"{row['p99_ms']:.1f}"]
            )
        lines.append(f"| {level:g} | " + " | ".join(cells) + " |")
    target.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
