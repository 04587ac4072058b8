"""The report of benchmarks/generate.py (and the CPU line and log every generation benchmark
writes): ``results/generate-<tag>-<date>.json`` and ``.md``, and PNG plots of tokens/s and p99
latencies against concurrency, one line per server."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def log(*parts: object) -> None:
    print(time.strftime("%H:%M:%S"), *parts, file=sys.stderr, flush=True)


def cpu_line() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    name = next(
        (ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Model name")),
        "?",
    )
    flags = next(
        (ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("Flags")), []
    )
    notable = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return f"{name} ({', '.join(notable)}), {os.cpu_count()} CPUs"


def write_report(tag: str, command: str, results: dict[str, object]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"generate-{tag}-{datetime.date.today().isoformat()}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2))
    lines = [
        f"# Generation benchmark ({tag})",
        "",
        f"`{command}`",
        "",
        f"CPU: {results['cpu']}",
        "",
    ]
    if results.get("model"):
        lines += [f"Model: {results['model']}", ""]
    lines += [f"Workload: {results['workload']}", ""]
    rounds = results["load"]
    if rounds:
        lines += [
            "| server | load | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
            "| finished |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for server, levels in rounds.items():  # type: ignore[union-attr]
            for level in levels:
                lines.append(
                    f"| {server} | {level['load']} | {level['output_tokens_s']} | "
                    f"{level['ttft_p50_ms']} | "
                    f"{level['ttft_p99_ms']} | {level['itl_p50_ms']} | {level['itl_p99_ms']} | "
                    f"{level['finished']}/{level['requests']} |"
                )
        lines.append("")
    for server, why in dict(results.get("skipped") or {}).items():  # type: ignore[call-overload]
        lines += [f"Skipped {server}: {why}", ""]
    for name in ("ratios", "prefix", "hol"):
        if results.get(name):
            lines += [f"## {name}", "", "```", json.dumps(results[name], indent=2), "```", ""]
    stem.with_suffix(".md").write_text("\n".join(lines))
    plot(stem, rounds)  # type: ignore[arg-type]
    return stem.with_suffix(".md")


def plot(stem: Path, rounds: dict[str, list[dict[str, object]]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plots")
        return
    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    for server, levels in rounds.items():
        closed = [lv for lv in levels if str(lv["load"]).startswith("c=")]
        xs = [int(str(lv["load"])[2:]) for lv in closed]
        for axis, key, title in zip(
            axes,
            ("output_tokens_s", "ttft_p99_ms", "itl_p99_ms"),
            ("output tokens/s", "TTFT p99 (ms)", "ITL p99 (ms)"),
            strict=True,
        ):
            axis.plot(xs, [lv[key] for lv in closed], marker="o", label=server)
            axis.set_xscale("log", base=2)
            axis.set_xlabel("concurrency")
            axis.set_title(title)
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(stem.with_suffix(".png"))
