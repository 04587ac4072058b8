"""``gpuserve bench``: a load generator for any KServe V2 server (gpuserve, Triton, others).

    gpuserve bench --model text_embedding --concurrency 1:64:x2
    gpuserve bench --model simple --request-rate 100:800:+100 --arrival poisson
    gpuserve bench --model simple --protocol grpc --grpc-url 127.0.0.1:8001 --tensor-format binary
    gpuserve bench --model text_embedding --input-lines texts.txt --concurrency 1,8,32

``--input-lines FILE`` sends varied inputs: one request per line, a V2 JSON body or (for a
model with one BYTES input) a plain text. Each request is sized in tokens before the run
(``--tokens``: the server's own count from ``/v1/embeddings`` when it offers one, a
tokenizer file, or words as a labelled approximation) and the table adds tokens/s.

Writes a table to stdout and ``bench.json``, ``bench.csv`` and ``bench.png`` (latency against
throughput) to a new folder ``gpuserve-bench/<date>-<time>/`` per run, or to ``--output-dir``
(refused when it holds an earlier run's results, unless ``--overwrite``). The PNG needs
matplotlib (``pip install 'gpuserve[bench]'``); without it the run says so and writes the rest.

A sweep stops when a level ends a window with failures and not one success (a wrong address
or model); when that is the first level, nothing is written. Exit status: 0 done,
1 no request succeeded, 2 bad arguments, the server/model could not be reached, or the output
folder holds earlier results.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any


def add_load_arguments(parser: argparse.ArgumentParser, *, default_concurrency: str) -> None:
    """Measurement flags shared by ``bench`` and ``tune``."""
    parser.add_argument(
        "--concurrency",
        default=None,
        help=f"closed-loop workers: N, N,M,... or START:END:xF / START:END:+N "
        f"(default {default_concurrency})",
    )
    parser.add_argument("--batch-size", type=int, default=1, help="rows per request (default 1)")
    parser.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="NAME:DIMS",
        help="non-batch dims of a variable input, e.g. INPUT0:16 (repeatable)",
    )
    parser.add_argument("--warmup-s", type=float, default=None, help="warm-up per level, seconds")
    parser.add_argument("--window-s", type=float, default=None, help="measurement window, seconds")
    parser.add_argument(
        "--stable-windows", type=int, default=3, help="windows that must agree (default 3)"
    )
    parser.add_argument(
        "--tolerance-pct",
        type=float,
        default=None,
        help="allowed spread of throughput and mean latency across them",
    )
    parser.add_argument(
        "--max-windows",
        type=int,
        default=None,
        help="most windows per level before reporting it unstable",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=30.0,
        help="a request unanswered this long is a timeout error (default 30)",
    )


def register(sub: Any) -> None:
    bench = sub.add_parser(
        "bench",
        help="load-test a KServe V2 server: latency percentiles, throughput, queue/compute",
        description=__doc__.split("\n\n")[0],
    )
    bench.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="HTTP base URL of the server (default http://127.0.0.1:8000)",
    )
    bench.add_argument("-m", "--model", help="model name (default: the server's only model)")
    bench.add_argument("--model-version", help="version (default: the server's choice)")
    bench.add_argument(
        "--protocol", choices=["http", "grpc"], default="http", help="KServe V2 over HTTP or gRPC"
    )
    bench.add_argument("--grpc-url", default="127.0.0.1:8001", help="gRPC host:port")
    bench.add_argument(
        "--tensor-format",
        choices=["json", "binary"],
        default=None,
        help="json tensors or the binary extension / raw contents "
        "(default: json over HTTP, binary over gRPC)",
    )
    add_load_arguments(bench, default_concurrency="1:64:x2")
    bench.add_argument(
        "--request-rate",
        default=None,
        help="open loop instead: requests/s, e.g. 200 or 100:800:+100",
    )
    bench.add_argument(
        "--arrival",
        choices=["constant", "poisson"],
        default="constant",
        help="open-loop arrival process (default constant)",
    )
    bench.add_argument(
        "--max-connections",
        type=int,
        default=512,
        help="open loop: most requests in flight (default 512)",
    )
    bench.add_argument(
        "--input-data", type=Path, help="JSON file of requests ({'data': [{INPUT: values}, ...]})"
    )
    bench.add_argument(
        "--input-lines",
        type=Path,
        metavar="FILE",
        help="one request per line: a V2 JSON body, or a text for a model with one BYTES input",
    )
    bench.add_argument(
        "--input-format",
        choices=["auto", "json", "text"],
        default="auto",
        help="how --input-lines is read (default auto: JSON when every line is an object)",
    )
    bench.add_argument(
        "--tokens",
        default=None,
        metavar="HOW",
        help="how requests are sized for tokens/s: auto (the server's /v1/embeddings count, "
        "else words), server, words, or a tokenizer.json file / model folder "
        "(default: auto with --input-lines, off otherwise)",
    )
    bench.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="truncation in tokens for a --tokens tokenizer (default: its folder's)",
    )
    bench.add_argument(
        "--metrics-url", help="Prometheus endpoint with GPU series (default URL/metrics)"
    )
    bench.add_argument(
        "--token",
        default=os.environ.get("GPUSERVE_API_TOKEN"),
        help="the server's API bearer token, sent with every call (default $GPUSERVE_API_TOKEN)",
    )
    bench.add_argument(
        "--ca-file",
        type=Path,
        help="PEM file that signs the server's TLS certificate, for https:// URLs and "
        "grpcs:// gRPC addresses (default: the system's CAs)",
    )
    bench.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        help="where bench.json, bench.csv and bench.png go (default: a new folder "
        "gpuserve-bench/<date>-<time>/ per run)",
    )
    bench.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the results an earlier run left in --output-dir (default: refuse)",
    )
    bench.add_argument(
        "--generate",
        action="store_true",
        help="the model generates text: stream /v1/completions (prompts from --input-lines, "
        "else built-in sentences) and report output tokens/s, time to first token and "
        "inter-token latency per concurrency level",
    )
    bench.add_argument(
        "--max-tokens",
        type=int,
        default=128,
        help="--generate: tokens generated per call (EOS ignored; default 128)",
    )
    bench.add_argument("--no-plot", action="store_true", help="skip the PNG")
    bench.add_argument(
        "--quiet", action="store_true", help="no progress (the line per level, the bar)"
    )
    bench.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace, **defaults: float) -> Any:
    from gpuserve.bench.loadgen import LoadSettings

    def pick(name: str) -> Any:
        value = getattr(args, name, None)
        return defaults[name] if value is None else value

    return LoadSettings(
        warmup_s=pick("warmup_s"),
        window_s=pick("window_s"),
        stable_windows=args.stable_windows,
        tolerance=pick("tolerance_pct") / 100.0,
        max_windows=int(pick("max_windows")),
        timeout_s=args.timeout_s,
        arrival=getattr(args, "arrival", "constant"),
        max_connections=getattr(args, "max_connections", 512),
    )


def level_line(result: Any, done: int, total: int) -> str:
    """One line on a measured level (the progress of a sweep): its throughput, p50 and p99,
    how many windows it took and whether they agreed, and its failures."""
    summary = result.summary
    unit = "concurrency" if result.mode == "concurrency" else "rate"
    line = (
        f"[{done}/{total}] {unit} {result.level:g}: {summary.throughput:.1f} infer/s, "
        f"p50 {summary.latency_ms.get(50, 0.0):.1f} ms, p99 {summary.latency_ms.get(99, 0.0):.1f} "
        f"ms ({len(result.windows)} windows{'' if result.stable else ', not stable'})"
    )
    if summary.errors:
        line += ", failures " + ", ".join(f"{k}: {v}" for k, v in sorted(summary.errors.items()))
    return line


def progress_hooks(
    quiet: bool, levels: list[float], unit: str, tty: bool = True
) -> tuple[Any, Any, Any]:
    """Progress on stderr: (context manager, on_window, on_level). One line per measured
    level, as it ends (a sweep takes minutes: never silent); on a terminal, also a progress
    bar showing the current window (the lines print above it). Nothing with ``quiet``."""
    import contextlib

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    if quiet:
        return contextlib.nullcontext(), None, None
    done = [0]
    if not tty:

        def print_level(result: Any) -> None:
            done[0] += 1
            print(f"gpuserve bench: {level_line(result, done[0], len(levels))}", file=sys.stderr)
            sys.stderr.flush()

        return contextlib.nullcontext(), None, print_level
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} levels"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    task = progress.add_task("starting", total=len(levels))

    def on_window(level: float, index: int, window: Any) -> None:
        progress.update(
            task,
            description=f"{unit} {level:g} window {index}: {window.throughput:.1f} infer/s, "
            f"p99 {window.latency_ms[99]:.1f} ms",
        )

    def on_level(result: Any) -> None:
        done[0] += 1
        line = level_line(result, done[0], len(levels))
        progress.console.print(line, markup=False, highlight=False, soft_wrap=True)
        progress.advance(task)

    return progress, on_window, on_level


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from gpuserve.bench.benchmark import BenchConfig, run_benchmark
    from gpuserve.bench.loadgen import describe_failing
    from gpuserve.bench.report import (
        RESULT_FILES,
        output_folder,
        plot_unavailable,
        render_table,
        write_all,
    )
    from gpuserve.bench.server_info import ServerError
    from gpuserve.bench.spec import parse_levels, parse_shapes

    err = Console(stderr=True, soft_wrap=True)  # one line per message, never wrapped
    if args.concurrency and args.request_rate:
        err.print("gpuserve bench: give --concurrency or --request-rate, not both")
        return 2
    try:
        if args.request_rate:
            mode, levels = "rate", parse_levels(args.request_rate, integer=False)
        else:
            mode, levels = "concurrency", parse_levels(args.concurrency or "1:64:x2")
        shapes = parse_shapes(args.shape)
    except ValueError as error:
        err.print(f"gpuserve bench: {error}")
        return 2
    if args.batch_size < 1:
        err.print("gpuserve bench: --batch-size must be >= 1")
        return 2
    if args.generate:
        if mode != "concurrency":
            err.print("gpuserve bench: --generate runs closed-loop levels (--concurrency)")
            return 2
        from gpuserve.cli.bench_generate import run_generate

        return run_generate(args, levels)
    if args.input_lines is not None and args.input_data is not None:
        err.print("gpuserve bench: give --input-data or --input-lines, not both")
        return 2
    if args.input_lines is not None and not args.input_lines.is_file():
        err.print(f"gpuserve bench: --input-lines {args.input_lines}: no such file", markup=False)
        return 2
    try:  # before the run: a refused folder must not cost a whole sweep
        out_dir = output_folder(args.output_dir, overwrite=args.overwrite)
    except FileExistsError as error:
        err.print(f"gpuserve bench: {error}", markup=False, highlight=False)
        return 2
    settings = settings_from_args(
        args, warmup_s=1.0, window_s=2.0, tolerance_pct=10.0, max_windows=8
    )
    binary = (args.tensor_format or ("binary" if args.protocol == "grpc" else "json")) == "binary"
    config = BenchConfig(
        url=args.url,
        model=args.model,
        version=args.model_version,
        protocol=args.protocol,
        grpc_url=args.grpc_url,
        binary=binary,
        mode=mode,  # type: ignore[arg-type]
        levels=levels,
        batch_size=args.batch_size,
        shapes=shapes,
        input_data=args.input_data,
        input_lines=args.input_lines,
        input_format=args.input_format,
        tokens=args.tokens,
        max_seq_len=args.max_seq_len,
        metrics_url=args.metrics_url,
        token=args.token,
        ca_file=args.ca_file,
        settings=settings,
    )
    unit = "concurrency" if mode == "concurrency" else "rate"
    progress, on_window, on_level = progress_hooks(
        args.quiet, levels, unit, tty=sys.stderr.isatty()
    )
    if not args.quiet:  # the first level's line comes after its warm-up and windows
        target = args.grpc_url if args.protocol == "grpc" else args.url
        sweep = ", ".join(f"{value:g}" for value in levels)
        err.print(
            f"gpuserve bench: {args.model} at {target}, {unit} {sweep}: a line per level as "
            "it ends",
            markup=False,
            highlight=False,
        )
    try:
        with progress:
            result = run_benchmark(config, on_window=on_window, on_level=on_level)
    except (ServerError, ValueError, RuntimeError) as error:
        err.print(f"gpuserve bench: {error}", markup=False, highlight=False)
        return 2
    if result.levels and result.levels[0].failing:  # nothing worth a table or a file
        message = describe_failing(result.levels[0], result.target)
        err.print(f"gpuserve bench: {message}; nothing written", markup=False, highlight=False)
        return 1
    Console().print(render_table(result))
    if result.token_counts is not None:
        print(f"tokens: {result.token_counts.detail}")
    last = result.levels[-1] if result.levels else None
    if last is not None and last.failing:
        message = describe_failing(last, result.target)
        err.print(f"gpuserve bench: {message} (the levels before it are written)", markup=False)
    unplotted = None if args.no_plot else plot_unavailable()
    if unplotted is not None:
        err.print(
            f"gpuserve bench: bench.png skipped: {unplotted} (or pass --no-plot)",
            markup=False,
            highlight=False,
        )
    if args.overwrite:  # an earlier run's PNG must not outlive it beside this run's results
        for name in RESULT_FILES:
            (out_dir / name).unlink(missing_ok=True)
    paths = write_all(result, out_dir, plot=not args.no_plot)
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0 if any(level.summary.ok for level in result.levels) else 1
