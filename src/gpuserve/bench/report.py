"""Presenting a benchmark: a terminal table, JSON, CSV, and a latency-throughput plot."""

from __future__ import annotations

import csv
import datetime as dt
import json
import math
from pathlib import Path
from typing import Any

from gpuserve.backends.optional import library_lock, require
from gpuserve.bench.benchmark import BenchResult
from gpuserve.bench.loadgen import LevelResult
from gpuserve.errors import ConfigError

#: Where runs go without ``--output-dir``: one new sub-folder per run.
DEFAULT_OUTPUT_ROOT = Path("gpuserve-bench")
#: The files a run writes (``write_all``); a folder holding one of them holds earlier results.
RESULT_FILES = ("bench.json", "bench.csv", "bench.png")

CSV_FIELDS = [
    "mode",
    "level",
    "batch_size",
    "throughput_infer_per_s",
    "throughput_rows_per_s",
    "throughput_tokens_per_s",
    "mean_tokens_per_request",
    "p50_ms",
    "p90_ms",
    "p95_ms",
    "p99_ms",
    "mean_ms",
    "max_ms",
    "requests",
    "ok",
    "errors",
    "server_queue_ms",
    "server_compute_ms",
    "gpu_utilization",
    "gpu_memory_used_bytes",
    "stable",
    "client_cpu",
]


def _num(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def level_row(result: LevelResult) -> dict[str, Any]:
    """One CSV row (and table row) per level."""
    s = result.summary
    return {
        "mode": result.mode,
        "level": result.level,
        "batch_size": result.batch_size,
        "throughput_infer_per_s": round(s.throughput, 3),
        "throughput_rows_per_s": round(s.throughput * result.batch_size, 3),
        "throughput_tokens_per_s": None if s.tokens_per_s is None else round(s.tokens_per_s, 1),
        "mean_tokens_per_request": None if s.mean_tokens is None else round(s.mean_tokens, 1),
        "p50_ms": round(s.latency_ms[50], 3),
        "p90_ms": round(s.latency_ms[90], 3),
        "p95_ms": round(s.latency_ms[95], 3),
        "p99_ms": round(s.latency_ms[99], 3),
        "mean_ms": round(s.mean_ms, 3),
        "max_ms": round(s.max_ms, 3),
        "requests": s.requests,
        "ok": s.ok,
        "errors": ";".join(f"{k}={v}" for k, v in s.errors.items()),
        "server_queue_ms": None if result.queue_ms is None else round(result.queue_ms, 3),
        "server_compute_ms": None if result.compute_ms is None else round(result.compute_ms, 3),
        "gpu_utilization": result.gpu.get("gpu_utilization"),
        "gpu_memory_used_bytes": result.gpu.get("gpu_memory_used_bytes"),
        "stable": result.stable,
        "client_cpu": None if result.client_cpu is None else round(result.client_cpu, 3),
    }


def write_json(result: BenchResult, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.as_dict(), indent=2, default=_json_default) + "\n")


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def write_csv(result: BenchResult, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for level in result.levels:
            writer.writerow(level_row(level))


def render_table(result: BenchResult) -> Any:
    """A ``rich`` table of every level (GPU columns only when the server exported GPU data)."""
    from rich.table import Table

    unit = "conc" if result.config.mode == "concurrency" else "req/s"
    batch = result.levels[0].batch_size if result.levels else 1
    table = Table(title=f"{result.model.name} · {result.target} · batch {batch}")
    headers = [unit, "infer/s", "p50", "p90", "p95", "p99", "queue", "compute", "errors"]
    counts = result.token_counts
    if counts is not None:
        headers[2:2] = [counts.label, "tokens/req" if counts.unit == "tokens" else "words/req"]
    has_gpu = any(level.gpu for level in result.levels)
    if has_gpu:
        headers += ["gpu util", "gpu mem"]
    for header in headers:
        table.add_column(header, justify="right")
    for level in result.levels:
        row = level_row(level)
        cells = [
            f"{level.level:g}" + ("" if level.stable else "*"),
            _num(row["throughput_infer_per_s"]),
            _num(row["p50_ms"], 2),
            _num(row["p90_ms"], 2),
            _num(row["p95_ms"], 2),
            _num(row["p99_ms"], 2),
            _num(row["server_queue_ms"], 2),
            _num(row["server_compute_ms"], 2),
            row["errors"] or "0",
        ]
        if counts is not None:
            cells[2:2] = [
                _num(row["throughput_tokens_per_s"], 0),
                _num(row["mean_tokens_per_request"], 1),
            ]
        if has_gpu:
            gpu_mem = row["gpu_memory_used_bytes"]
            cells += [
                _num(row["gpu_utilization"], 2),
                "-" if gpu_mem is None else f"{gpu_mem / 2**30:.2f}G",
            ]
        table.add_row(*cells)
    notes = ["latencies in ms; queue/compute: server-side means"]
    if counts is not None:
        notes.append(f"sized by {counts.detail}")
    cpu = max((level.client_cpu or 0.0) for level in result.levels) if result.levels else 0.0
    notes.append(f"generator CPU at most {cpu:.0%} of a core")
    if any(not level.stable for level in result.levels):
        notes.append("* not stable within the tolerance")
    table.caption = "; ".join(notes)
    return table


def plot_latency_throughput(
    results: dict[str, list[LevelResult]], path: Path, title: str, budget_ms: float | None = None
) -> None:
    """PNG: p50 and p99 latency against throughput, one line pair per labelled sweep.

    Raises:
        MissingDependencyError: matplotlib is not installed (the ``bench`` extra).
    """
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for index, (label, levels) in enumerate(results.items()):
        color = f"C{index}"
        points = [r for r in levels if r.summary.ok]
        xs = [r.throughput * r.batch_size for r in points]
        ax.plot(xs, [r.p99_ms for r in points], "o-", color=color, label=f"{label} p99")
        ax.plot(
            xs,
            [r.summary.latency_ms[50] for r in points],
            "s--",
            color=color,
            alpha=0.6,
            label=f"{label} p50",
        )
        for r, x in zip(points, xs, strict=True):
            ax.annotate(
                f"{r.level:g}",
                (x, r.p99_ms),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
                color=color,
            )
    if budget_ms is not None:
        ax.axhline(budget_ms, color="red", linestyle=":", label=f"budget {budget_ms:g} ms")
    ax.set_xlabel("throughput (rows/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


#: What needs matplotlib, in the message that says it is missing.
PLOT_NEEDS = "the latency plot (bench.png)"


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend (thread-safe first import).

    Raises:
        MissingDependencyError: matplotlib is not installed (``pip install 'gpuserve[bench]'``).
    """
    matplotlib = require("matplotlib", PLOT_NEEDS)
    with library_lock("matplotlib"):
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    return plt


def plot_unavailable() -> str | None:
    """Why no PNG can be drawn (one line naming the ``bench`` extra), or None."""
    try:
        require("matplotlib", PLOT_NEEDS)
    except ConfigError as err:
        return err.message
    return None


def can_plot() -> bool:
    """Whether matplotlib is installed (``pip install 'gpuserve[bench]'``)."""
    return plot_unavailable() is None


def write_all(
    result: BenchResult, out_dir: Path, stem: str = "bench", plot: bool = True
) -> dict[str, Path]:
    """JSON, CSV and the PNG plot (skipped without matplotlib)."""
    paths = {"json": out_dir / f"{stem}.json", "csv": out_dir / f"{stem}.csv"}
    write_json(result, paths["json"])
    write_csv(result, paths["csv"])
    if plot and result.levels and can_plot():
        paths["png"] = out_dir / f"{stem}.png"
        label = "concurrency" if result.config.mode == "concurrency" else "request rate"
        plot_latency_throughput(
            {result.model.name: result.levels},
            paths["png"],
            f"{result.model.name}: latency vs throughput ({label} sweep, {result.target})",
        )
    return paths


def output_folder(
    requested: Path | None, *, overwrite: bool = False, now: dt.datetime | None = None
) -> Path:
    """Where a run writes its results, never over an earlier run's unless asked.

    Args:
        requested: ``--output-dir``; None: a new folder ``gpuserve-bench/<date>-<time>/``
            (``-2``, ``-3``, ... appended when one of that name exists).
        overwrite: Allow ``requested`` to hold an earlier run's results (they are replaced).
        now: The run's start (local time; tests pass a fixed one).

    Raises:
        FileExistsError: ``requested`` holds an earlier run's results and ``overwrite`` is
            False (the message names the folder and the way out).
    """
    if requested is not None:
        earlier = [name for name in RESULT_FILES if (requested / name).exists()]
        if earlier and not overwrite:
            raise FileExistsError(
                f"{requested} holds the results of an earlier run ({', '.join(earlier)}); "
                "pass --overwrite to replace them, or another --output-dir"
            )
        return requested
    stamp = (now or dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
    folder = DEFAULT_OUTPUT_ROOT / stamp
    suffix = 2
    while folder.exists():
        folder = DEFAULT_OUTPUT_ROOT / f"{stamp}-{suffix}"
        suffix += 1
    return folder
