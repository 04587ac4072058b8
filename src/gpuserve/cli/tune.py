"""``gpuserve tune``: find the serving configuration with the most throughput within a p99
latency budget, by serving and benchmarking candidates for real.

    gpuserve tune --model text_embedding --latency-budget-ms 100 --output tuned/

Writes ``config.yaml`` (the winner; drop it into the model folder) and ``report.md``,
``report.json``, ``candidates.png``, ``curves.png`` to ``--output`` (a folder; or a ``.yaml``
path, the report then going beside it). Exit status: 0 done, 1 no candidate met the budget,
2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from gpuserve.cli.bench import add_load_arguments, settings_from_args


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def register(sub: Any) -> None:
    tune = sub.add_parser(
        "tune",
        help="search max_batch_size, queue delay, instances, precision for a p99 budget",
        description=__doc__.split("\n\n")[0],
    )
    tune.add_argument(
        "--model-repository",
        type=Path,
        help="repository holding the model (default: the embedded repository)",
    )
    tune.add_argument("-m", "--model", required=True, help="model to tune")
    tune.add_argument(
        "--latency-budget-ms",
        type=float,
        required=True,
        help="p99 latency a configuration must keep, milliseconds",
    )
    tune.add_argument(
        "--output",
        type=Path,
        default=None,
        help="folder for config.yaml and the report (default tuned-<model>), or a .yaml file path",
    )
    tune.add_argument(
        "--budget-s", type=float, default=1800.0, help="total tuning time, seconds (default 1800)"
    )
    add_load_arguments(tune, default_concurrency="1:64:x2")
    tune.add_argument(
        "--max-batch-sizes",
        type=_ints,
        default=None,
        help="values to try (default 4,8,16,32,64,128)",
    )
    tune.add_argument(
        "--queue-delays-us",
        type=_ints,
        default=None,
        help="values to try (default 0,500,1000,2000,5000,10000,20000)",
    )
    tune.add_argument(
        "--instance-counts", type=_ints, default=None, help="values to try (default 1,2,4)"
    )
    tune.add_argument(
        "--precisions", default="fp32,bf16,fp16", help="values to try (default fp32,bf16,fp16)"
    )
    tune.add_argument(
        "--preferred",
        default="none,max,half",
        help="preferred_batch_sizes modes: none, max ([mbs]), half ([mbs/2, mbs])",
    )
    tune.add_argument(
        "--adaptive",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also try adaptive batching with the budget as its target",
    )
    tune.add_argument(
        "--min-gain-pct",
        type=float,
        default=3.0,
        help="improvement a change must bring to be kept (default 3)",
    )
    tune.add_argument("--max-passes", type=int, default=2, help="coordinate-descent passes")
    tune.add_argument(
        "--confirm",
        type=int,
        default=3,
        help="best candidates measured again at the end (default 3; 0 = none)",
    )
    tune.add_argument(
        "--server-cpus",
        help="pin each candidate's server to these CPUs (taskset "
        "list, e.g. 1 or 2-7); keeps the generator from skewing the server",
    )
    tune.add_argument(
        "--accuracy-budget",
        help="keep only precisions within this accuracy against fp32 on held-out sentences, "
        "e.g. cosine=0.99,recall=0.95[,abs=0.05] (measured in-process before the search)",
    )
    tune.add_argument("--client-cpus", help="pin the load generator to these CPUs (e.g. 0)")
    tune.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of each candidate's server, e.g. OMP_NUM_THREADS=1",
    )
    tune.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpuserve.bench.spec import parse_levels
    from gpuserve.bench.tune import PREFERRED_MODES, SearchSpace, Tuner, TuneSettings
    from gpuserve.bench.tune_report import write_config, write_report
    from gpuserve.config import default_model_repository
    from gpuserve.errors import ConfigError

    def fail(message: str) -> int:
        print(f"gpuserve tune: {message}", file=sys.stderr)
        return 2

    repository = args.model_repository or default_model_repository()
    model_dir = repository / args.model
    if not (model_dir / "config.yaml").is_file():
        return fail(f"no model '{args.model}' in {repository} (no {model_dir}/config.yaml)")
    if args.latency_budget_ms <= 0:
        return fail("--latency-budget-ms must be > 0")
    try:
        levels = parse_levels(args.concurrency or "1:64:x2")
    except ValueError as err:
        return fail(str(err))
    space = SearchSpace()
    if args.max_batch_sizes:
        space.max_batch_size = args.max_batch_sizes
    if args.queue_delays_us:
        space.max_queue_delay_us = args.queue_delays_us
    if args.instance_counts:
        space.instance_count = args.instance_counts
    space.precision = [p.strip() for p in args.precisions.split(",") if p.strip()]
    accuracy_budget = None
    if args.accuracy_budget:
        from gpuserve.bench.tune_accuracy import parse_accuracy_budget

        try:
            accuracy_budget = parse_accuracy_budget(args.accuracy_budget)
        except ValueError as err:
            return fail(str(err))
    space.preferred = [p.strip() for p in args.preferred.split(",") if p.strip()]
    bad = [p for p in space.preferred if p not in PREFERRED_MODES]
    if bad:
        return fail(f"--preferred: unknown mode(s) {bad}; use none, max, half")
    space.adaptive = [None, args.latency_budget_ms] if args.adaptive else [None]
    load = settings_from_args(args, warmup_s=1.0, window_s=1.5, tolerance_pct=15.0, max_windows=5)
    server_env = {}
    for item in args.server_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            return fail(f"--server-env {item!r}: expected KEY=VALUE")
        server_env[key] = value
    if args.client_cpus:
        import os

        from gpuserve.bench.spec import parse_cpus

        try:
            os.sched_setaffinity(0, parse_cpus(args.client_cpus))
        except (ValueError, OSError) as err:
            return fail(f"--client-cpus {args.client_cpus!r}: {err}")
    settings = TuneSettings(
        latency_budget_ms=args.latency_budget_ms,
        levels=levels,
        load=load,
        budget_s=args.budget_s,
        min_gain=args.min_gain_pct / 100.0,
        max_passes=args.max_passes,
        confirm=args.confirm,
        batch_size=args.batch_size,
        server_cpus=args.server_cpus,
        server_env=server_env,
    )
    output: Path = args.output or Path(f"tuned-{args.model}")
    if output.suffix in (".yaml", ".yml"):
        config_path, report_dir = output, output.with_name(output.stem + "-report")
    else:
        config_path, report_dir = output / "config.yaml", output
    try:
        tuner = Tuner(
            model_dir,
            space,
            settings,
            log=lambda line: print(line, flush=True),
            accuracy_budget=accuracy_budget,
        )
    except ConfigError as err:
        return fail(str(err))
    print(
        f"tuning {args.model}: p99 budget {args.latency_budget_ms:g} ms, "
        f"time budget {args.budget_s:g} s",
        flush=True,
    )
    result = tuner.run()
    write_config(result, config_path)
    paths = write_report(result, report_dir, config_path)
    from gpuserve.bench.report import plot_unavailable

    unplotted = plot_unavailable()
    if unplotted is not None:
        print(f"gpuserve tune: plots skipped: {unplotted}", file=sys.stderr)
    from gpuserve.bench.tune_report import why

    print()
    for line in why(result):
        print(line)
    print(f"config: {config_path}")
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0 if result.winner.best is not None else 1
