"""The tuner's outputs: the chosen ``config.yaml``, a markdown report, JSON and plots."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import yaml

from gpuserve.bench.report import can_plot, plot_latency_throughput, pyplot
from gpuserve.bench.tune import Evaluation, TuneResult


def _row(e: Evaluation, winner: Evaluation, baseline: Evaluation) -> str:
    mark = "**winner**" if e is winner else ("current" if e is baseline else "")
    if e.best is not None:
        best = e.best
        result = (
            f"{e.score:.1f} | {best.level:g} | {best.p99_ms:.1f} | "
            f"{best.summary.latency_ms[50]:.1f}"
        )
    else:
        result = f"- | - | {_fmt(e.min_p99_ms)} | -"
    runs = ", ".join(f"{r:.1f}" for r in e.runs) if len(e.runs) > 1 else ""
    note = e.detail or (f"runs {runs}" if runs else "")
    return (
        f"| {e.phase} | `{e.candidate.label()}` | {result} | {e.status} | "
        f"{e.seconds:.0f} | {mark} | {note} |"
    )


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def why(result: TuneResult) -> list[str]:
    """Sentences explaining the choice."""
    budget = result.settings.latency_budget_ms
    winner, baseline = result.winner, result.baseline
    lines: list[str] = []
    if winner.best is None:
        lines.append(
            f"No candidate kept p99 within {budget:g} ms at any measured concurrency; the current "
            "configuration is kept. Raise the budget or lower the load levels."
        )
        return lines
    best = winner.best
    lines.append(
        f"`{winner.candidate.label()}` has the highest throughput with p99 ≤ {budget:g} ms: "
        f"{winner.score:.1f} rows/s at concurrency {best.level:g} (p99 {best.p99_ms:.1f} ms, "
        f"p50 {best.summary.latency_ms[50]:.1f} ms)."
    )
    if winner is baseline:
        lines.append(
            "No change beat the current configuration by more than the noise margin "
            f"({result.settings.min_gain:.0%}), so it is kept."
        )
    elif baseline.best is not None:
        gain = winner.score / baseline.score - 1
        lines.append(
            f"The current configuration (`{baseline.candidate.label()}`) reaches "
            f"{baseline.score:.1f} rows/s within the budget (at concurrency "
            f"{baseline.best.level:g}, p99 {baseline.best.p99_ms:.1f} ms): the winner is "
            f"{gain:+.0%}."
        )
    else:
        lines.append(
            f"The current configuration meets the budget at no measured concurrency "
            f"(best p99 {_fmt(baseline.min_p99_ms)} ms)."
        )
    changed = [
        dim
        for dim in (
            "max_batch_size",
            "max_queue_delay_us",
            "instance_count",
            "preferred",
            "precision",
            "adaptive",
        )
        if winner.candidate.value(dim) != baseline.candidate.value(dim)
    ]
    if changed:
        lines.append(
            "Settings changed: "
            + ", ".join(
                f"{d} {baseline.candidate.value(d)} → {winner.candidate.value(d)}" for d in changed
            )
            + "."
        )
    confirmed = [e for e in result.finalists if len(e.runs) > 1]
    if confirmed:
        lines.append(
            "Measured again at the end (the mean of the runs decides): "
            + "; ".join(
                f"`{e.candidate.label()}` " + ", ".join(f"{r:.1f}" for r in e.runs)
                for e in sorted(confirmed, key=lambda e: e.score, reverse=True)
            )
            + " rows/s."
        )
    chosen = result.accuracy.get(winner.candidate.precision)
    if result.accuracy_budget is not None:
        excluded = ", ".join(f"{p} ({why})" for p, why in result.excluded.items()) or "none"
        measured = f": {chosen.line()}" if chosen is not None else " (fp32 is the reference)"
        lines.append(
            f"Accuracy budget {result.accuracy_budget.label()} against fp32 on held-out "
            f"sentences: {winner.candidate.precision} is within it{measured}. "
            f"Left out: {excluded}."
        )
    elif winner.candidate.precision != baseline.candidate.precision:
        lines.append(
            f"Precision {winner.candidate.precision} changes the model's numerics: check its "
            "accuracy before serving it (`gpuserve models accuracy`, or tune with "
            "--accuracy-budget)."
        )
    over = [e for e in result.evaluations if e.status == "over budget"]
    failed = [e for e in result.evaluations if e.status == "failed"]
    if over:
        lines.append(f"{len(over)} candidate(s) never met the budget; {len(failed)} failed.")
    return lines


def write_report(result: TuneResult, out_dir: Path, config_path: Path) -> dict[str, Path]:
    """Write report.md, report.json, candidates.png and curves.png into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "report": out_dir / "report.md",
        "json": out_dir / "report.json",
        "candidates_plot": out_dir / "candidates.png",
        "curves_plot": out_dir / "curves.png",
    }
    settings = result.settings
    lines = [
        f"# gpuserve tune: {result.model}",
        "",
        f"{dt.datetime.now(dt.UTC).isoformat(timespec='seconds')} · p99 budget "
        f"{settings.latency_budget_ms:g} ms · concurrency levels "
        f"{', '.join(f'{v:g}' for v in settings.levels)} · batch size {settings.batch_size} · "
        f"{len(result.evaluations)} candidates in {result.elapsed_s:.0f} s"
        + (" (stopped by the time budget)" if result.stopped_by_budget else ""),
        "",
        "## Why the winner won",
        "",
        *[f"- {line}" for line in why(result)],
        "",
        f"Chosen configuration: `{config_path}`",
        "",
        "## Every candidate",
        "",
        "Score = highest throughput (rows/s) at a concurrency whose p99 is within the budget "
        "without errors; each sweep stops at the first concurrency over the budget.",
        "",
        "| phase | candidate | rows/s | at conc. | p99 ms | p50 ms | status | s | | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *[_row(e, result.winner, result.baseline) for e in result.evaluations],
        "",
        "## Plots",
        "",
        "![score of every candidate](candidates.png)",
        "",
        "![latency against throughput](curves.png)",
        "",
        *_accuracy_section(result),
    ]
    paths["report"].write_text("\n".join(lines))
    paths["json"].write_text(json.dumps(_as_dict(result), indent=2) + "\n")
    if not can_plot():
        del paths["candidates_plot"], paths["curves_plot"]
        return paths
    _plot_candidates(result, paths["candidates_plot"])
    if result.accuracy_budget is not None:
        paths["accuracy_plot"] = out_dir / "accuracy.png"
        _plot_accuracy(result, paths["accuracy_plot"])
    curves = {"current": result.baseline.levels}
    if result.winner is not result.baseline:
        curves["winner"] = result.winner.levels
    ranked = sorted(
        (
            e
            for e in result.evaluations
            if e.best is not None and e not in (result.winner, result.baseline)
        ),
        key=lambda e: e.score,
        reverse=True,
    )
    for e in ranked[:2]:
        curves[e.candidate.label()] = e.levels
    plot_latency_throughput(
        {k: v for k, v in curves.items() if v},
        paths["curves_plot"],
        f"{result.model}: candidates' latency vs throughput",
        settings.latency_budget_ms,
    )
    return paths


def speed_accuracy(result: TuneResult) -> list[dict[str, Any]]:
    """Per precision: its best rows/s within the latency budget (0 when none was measured)
    and its accuracy against fp32 (fp32: the reference, cosine 1 and recall 1)."""
    precisions = dict.fromkeys(["fp32", *result.accuracy, *result.excluded])
    rows = []
    for precision in precisions:
        scores = [
            e.score for e in result.evaluations
            if e.candidate.precision == precision and e.best is not None
        ]  # fmt: skip
        report = result.accuracy.get(precision)
        rows.append(
            {
                "precision": precision,
                "rows_per_s": max(scores, default=0.0),
                "cosine_min": report.cosine_min
                if report
                else (1.0 if precision == "fp32" else None),
                "cosine_mean": report.cosine_mean if report else None,
                "max_abs_error": report.max_abs_error if report else None,
                "recall_at_10": report.recall_at_k
                if report
                else (1.0 if precision == "fp32" else None),
                "status": result.excluded.get(precision, "within budget"),
            }
        )
    return rows


def _accuracy_section(result: TuneResult) -> list[str]:
    if result.accuracy_budget is None:
        return []

    def num(value: float | None, digits: int) -> str:
        return "—" if value is None else f"{value:.{digits}f}"

    return [
        "## Speed against accuracy",
        "",
        f"Accuracy budget: {result.accuracy_budget.label()} (against fp32, held-out sentences, "
        "`gpuserve models accuracy`). rows/s: the best candidate of that precision.",
        "",
        "| precision | rows/s | cosine min | cosine mean | max abs error | recall@10 | status |",
        "|---|---|---|---|---|---|---|",
        *[
            f"| {r['precision']} | {r['rows_per_s']:.1f} | {num(r['cosine_min'], 4)} | "
            f"{num(r['cosine_mean'], 4)} | {num(r['max_abs_error'], 4)} | "
            f"{num(r['recall_at_10'], 3)} | {r['status']} |"
            for r in speed_accuracy(result)
        ],
        "",
        "![speed against accuracy](accuracy.png)",
        "",
    ]


def _plot_accuracy(result: TuneResult, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    for row in speed_accuracy(result):
        if row["cosine_min"] is None:
            continue
        inside = row["status"] == "within budget"
        ax.scatter(row["cosine_min"], row["rows_per_s"], color="tab:green" if inside else "tab:red")
        ax.annotate(row["precision"], (row["cosine_min"], row["rows_per_s"]), fontsize=8)
    budget = result.accuracy_budget
    if budget is not None and budget.min_cosine is not None:
        ax.axvline(budget.min_cosine, color="gray", linestyle="--", linewidth=1)
    ax.set_xlabel("min cosine to fp32 (held-out sentences)")
    ax.set_ylabel("rows/s within the latency budget")
    ax.set_title(f"{result.model}: speed against accuracy (red = outside the budget)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_candidates(result: TuneResult, path: Path) -> None:
    plt = pyplot()
    evaluations = result.evaluations
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(evaluations) + 1.5), dpi=110)
    labels = [f"{i + 1}. {e.candidate.label()}" for i, e in enumerate(evaluations)]
    colors = [
        "tab:green" if e is result.winner else "tab:blue" if e.best is not None else "tab:gray"
        for e in evaluations
    ]
    ax.barh(range(len(evaluations)), [e.score for e in evaluations], color=colors)
    ax.set_yticks(range(len(evaluations)), labels, fontsize=7)
    ax.invert_yaxis()
    for i, e in enumerate(evaluations):
        text = (
            f" c={e.best.level:g} p99={e.best.p99_ms:.0f}ms"
            if e.best is not None
            else f" {e.status}"
        )
        ax.text(e.score, i, text, va="center", fontsize=7)
    ax.set_xlabel(f"rows/s within p99 ≤ {result.settings.latency_budget_ms:g} ms")
    ax.set_title(f"{result.model}: candidates in search order (green = winner)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _as_dict(result: TuneResult) -> dict[str, Any]:
    def evaluation(e: Evaluation) -> dict[str, Any]:
        return {
            "phase": e.phase,
            "candidate": e.candidate.label(),
            "settings": {
                d: e.candidate.value(d)
                for d in (
                    "max_batch_size",
                    "max_queue_delay_us",
                    "instance_count",
                    "preferred",
                    "precision",
                    "adaptive",
                )
            },
            "status": e.status,
            "detail": e.detail,
            "score_rows_per_s": e.score,
            "runs": e.runs,
            "best_level": e.best.level if e.best is not None else None,
            "seconds": e.seconds,
            "levels": [level.as_dict() for level in e.levels],
        }

    return {
        "tool": "gpuserve tune",
        "model": result.model,
        "latency_budget_ms": result.settings.latency_budget_ms,
        "elapsed_s": result.elapsed_s,
        "stopped_by_budget": result.stopped_by_budget,
        "winner": result.winner.candidate.label(),
        "why": why(result),
        "evaluations": [evaluation(e) for e in result.evaluations],
        "accuracy_budget": result.accuracy_budget.label() if result.accuracy_budget else None,
        "speed_accuracy": speed_accuracy(result) if result.accuracy_budget else [],
    }


def write_config(result: TuneResult, path: Path) -> None:
    """The chosen configuration as ``config.yaml``, with a comment saying where it came from."""
    path.parent.mkdir(parents=True, exist_ok=True)
    winner = result.winner
    header = [
        f"# Chosen by gpuserve tune for p99 <= {result.settings.latency_budget_ms:g} ms",
    ]
    if winner.best is not None:
        header.append(
            f"# {winner.score:.1f} rows/s at concurrency {winner.best.level:g} "
            f"(p99 {winner.best.p99_ms:.1f} ms) on {_host()}"
        )
    path.write_text("\n".join(header) + "\n" + yaml.safe_dump(result.config, sort_keys=False))


def _host() -> str:
    import platform

    return platform.node() or "this machine"
