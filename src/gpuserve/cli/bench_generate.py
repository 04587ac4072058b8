"""``gpuserve bench --generate``: load on a generative model through its streamed
``/v1/completions`` (any OpenAI-compatible server), one closed-loop level per concurrency:
output tokens/s, time to first token and inter-token latency p50/p99, calls finished."""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict
from importlib import resources
from pathlib import Path

#: Calls per level: this many per worker (at least 8 per level).
CALLS_PER_WORKER = 4


def prompts(path: Path | None) -> list[str]:
    """One prompt per non-empty line of ``path``, else the built-in English sentences."""
    if path is not None:
        text = path.read_text(encoding="utf-8")
    else:
        text = resources.files("gpuserve.text.data").joinpath("reference_sentences.txt").read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path}: no prompt in it")
    return lines


def run_generate(args: argparse.Namespace, levels: list[float]) -> int:
    """Measure each level and print the table; ``bench.json`` in ``--output-dir`` if given."""
    from rich.console import Console
    from rich.table import Table

    from gpuserve.bench.generation import Job, closed_loop, ignore_eos

    console = Console()
    try:
        texts = prompts(args.input_lines)
    except (OSError, ValueError) as error:
        Console(stderr=True).print(f"gpuserve bench: {error}")
        return 2
    model = args.model or "chat"
    base = args.url.rstrip("/") + "/v1"
    table = Table(title=f"{model}: streamed /v1/completions, max_tokens {args.max_tokens}")
    for column in ("load", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"):
        table.add_column(column, justify="right")
    table.add_column("finished", justify="right")
    results = []
    for level in levels:
        c = int(level)
        count = max(8, CALLS_PER_WORKER * c)
        jobs = [Job(texts[i % len(texts)], 0, args.max_tokens) for i in range(count)]
        if not args.quiet:
            Console(stderr=True).print(f"c={c}: {count} calls")
        result = asyncio.run(closed_loop(base, model, jobs, c, ignore_eos))
        results.append(asdict(result))
        table.add_row(
            result.load,
            f"{result.output_tokens_s:.1f}",
            f"{result.ttft_p50_ms:.1f}",
            f"{result.ttft_p99_ms:.1f}",
            f"{result.itl_p50_ms:.1f}",
            f"{result.itl_p99_ms:.1f}",
            f"{result.finished}/{result.requests}",
        )
    console.print(table)
    if args.output_dir is not None:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        (args.output_dir / "bench.json").write_text(json.dumps(results, indent=2))
    return 0 if all(r["finished"] == r["requests"] for r in results) else 1


__all__ = ["run_generate"]
