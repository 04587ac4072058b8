#!/usr/bin/env python3
"""Variable-length text at full speed (issue 20): one run measures, side by side,

  (a) the in-process limit of all-MiniLM-L6-v2 on the corpus (mixed_length_inprocess.py):
      batch 1, length-sorted batches of 8 and 32, and random-order padded batches of 8 / 32;
  (b) gpuserve serving raw text over HTTP (V2 JSON BYTES to the default repository's
      text_embedding, one text per request) at closed-loop concurrency 1, 8, 32;
  (c) PyTriton and infinity-emb serving the same model on the same texts, same pinning
      (PyTriton twice: with sentence-transformers, as its users serve this model, and with
      gpuserve's own packed encoder, which compares the serving layers alone);

for two mixes of real English prose (corpus.py: the Python standard library's docstrings):
``short`` sentences and ``chunks`` of 60-200 words. The load generator is gpuserve's own
(gpuserve.bench: RawHttpTarget + run_level), in this process on the client CPU; every
request's size in tokens is counted once with the model's tokenizer (after truncation to 256),
so the tables give req/s and real tokens/s. Writes
results/mixed-length-<tag>-<date>.md/.json and prints the markdown.

    .venv/bin/python benchmarks/mixed_length.py                      # all servers, ~12 min
    .venv/bin/python benchmarks/mixed_length.py --quick --servers gpuserve --mix short
    GPUSERVE_BASE_SRC=/tmp/base/src .venv/bin/python benchmarks/mixed_length.py \\
        --servers gpuserve-base,gpuserve                             # before/after in one run

A server that cannot run here (no peers venv, no infinity venv, no GPUSERVE_BASE_SRC) is
skipped with a line in the log and in the report.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import corpus  # noqa: E402
import mixed_length_inprocess  # noqa: E402
import mixed_length_report as report  # noqa: E402
import mixed_length_servers as servers  # noqa: E402

MAX_SEQ_LEN = 256  # the default text_embedding's truncation
# --quick: short points, a small corpus, c = 1 and 8
QUICK = {
    "duration": 1.5,
    "chunk_duration": 3.0,
    "warmup": 0.5,
    "inprocess_seconds": 1.0,
    "short_count": 200,
    "chunk_count": 60,
    "conc": "1,8",
}


def log(*parts: object) -> None:
    print(time.strftime("[%H:%M:%S]"), *parts, file=sys.stderr, flush=True)


def cpu_set(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.split(","):
        low, sep, high = part.partition("-")
        if part.strip():
            out.update(range(int(low), int(high) + 1) if sep else {int(low)})
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--servers",
        default="gpuserve-base,gpuserve,pytriton,pytriton-packed,infinity",
        help=f"comma list of {', '.join(servers.SERVER_NAMES)}, or 'none' for (a) "
        "only (default: all; those that cannot run are skipped)",
    )
    ap.add_argument("--mix", default="short,chunks", help="short, chunks or both")
    ap.add_argument("--conc", default="1,8,32", help="closed-loop concurrencies")
    ap.add_argument(
        "--duration",
        type=float,
        default=9.0,
        help="measured seconds per served point (3 windows), after a warm-up",
    )
    ap.add_argument(
        "--chunk-duration",
        type=float,
        default=30.0,
        help="measured seconds per served point of the chunks mix (3 windows): at c=32 its "
        "batches take 2-4 s and finish 32 answers at once, so a window of a few seconds "
        "counts 2 or 3 whole batches (a server measured 10.5 and 16.0 req/s in two 6 s runs)",
    )
    ap.add_argument("--warmup", type=float, default=3.0, help="warm-up seconds per point")
    ap.add_argument("--inprocess-seconds", type=float, default=5.0, help="per (a) mode")
    ap.add_argument("--inprocess-modes", default="batch1,sorted8,sorted32,random8,random32")
    ap.add_argument(
        "--inprocess-executions",
        default="torch,onnxruntime" if importlib.util.find_spec("onnxruntime") else "torch",
        help="executions of (a): torch (packed) and onnxruntime (padded; the one gpuserve's "
        "text_embedding runs on a CPU with onnxruntime installed); the best of all is the limit",
    )
    ap.add_argument("--skip-inprocess", action="store_true")
    ap.add_argument("--short-count", type=int, default=2000, help="texts in the short mix")
    ap.add_argument("--chunk-count", type=int, default=None, help="texts in the chunks mix")
    ap.add_argument(
        "--base-port",
        type=int,
        default=8161,
        help="gpuserve's port; gpuserve-base, pytriton, infinity, pytriton-packed: "
        "+10, +20, +30, +40",
    )
    ap.add_argument("--server-cpus", default="1")
    ap.add_argument("--client-cpus", default="0")
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--max-batch", type=int, default=64, help="peers' max batch")
    ap.add_argument("--batch-wait-ms", type=float, default=2.0, help="peers' max queue delay")
    ap.add_argument("--tag", default=None, help="results/mixed-length-<tag>-<date>.md")
    ap.add_argument("--out-dir", type=Path, default=HERE / "results")
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: short points, small corpus, c=1,8"
    )
    words = sys.argv[1:] if argv is None else argv
    given = {  # options on the command line, as --name value or --name=value
        a.dest
        for a in ap._actions
        for o in a.option_strings
        if any(w == o or w.startswith(o + "=") for w in words)
    }
    args = ap.parse_args(argv)
    if args.quick:  # smaller defaults; options given on the command line win
        for name, value in QUICK.items():
            if name not in given:
                setattr(args, name, value)
    args.conc = [int(c) for c in args.conc.split(",") if c]
    args.mixes = [m for m in args.mix.split(",") if m]
    for mix in args.mixes:
        if mix not in corpus.MIXES:
            ap.error(f"--mix: unknown mix {mix!r} (known: {', '.join(corpus.MIXES)})")
    for mode in args.inprocess_modes.split(","):
        try:
            mixed_length_inprocess.batches(mode, ["x"], [1])
        except ValueError as err:
            ap.error(f"--inprocess-modes: {err}")
    args.servers = [] if args.servers == "none" else [s for s in args.servers.split(",") if s]
    for name in args.servers:
        if name not in servers.SERVER_NAMES:
            ap.error(
                f"--servers: unknown server {name!r} (known: {', '.join(servers.SERVER_NAMES)})"
            )
    args.tag = args.tag or ("quick" if args.quick else "full")
    return args


# ----------------------------------------------------------------------------- corpus
class Mix:
    """One mix's texts, their token counts and a file holding them (one per line)."""

    def __init__(self, name: str, count: int | None, tokenizer, folder: Path) -> None:
        self.corpus = corpus.build(name, count)
        self.name = name
        self.texts = list(self.corpus.texts)
        self.tokens = [len(e.ids) for e in tokenizer.encode_batch(self.texts)]
        self.path = folder / f"{name}.txt"
        corpus.write_lines(self.corpus, self.path)

    def summary(self) -> dict:
        tokens = sorted(self.tokens)
        return {
            "mix": self.name,
            "texts": len(self.texts),
            "describe": corpus.describe(self.corpus),
            "tokens_min": tokens[0],
            "tokens_median": tokens[len(tokens) // 2],
            "tokens_max": tokens[-1],
            "tokens_mean": sum(tokens) / len(tokens),
            "truncated": sum(t >= MAX_SEQ_LEN for t in tokens),
            "sha256": self.corpus.sha256,
        }


def load_tokenizer():
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(servers.model_dir()) / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=MAX_SEQ_LEN)
    return tokenizer


# ----------------------------------------------------------------------------- (a)
def inprocess(
    args: argparse.Namespace, layout: servers.Layout, mix: Mix, execution: str
) -> list[dict]:
    """Run mixed_length_inprocess.py pinned like a server; its JSON lines (mode names
    prefixed with the execution: ``torch batch1``, ``onnxruntime sorted8``)."""
    cmd = [
        sys.executable,
        str(HERE / "mixed_length_inprocess.py"),
        "--texts",
        str(mix.path),
        "--seconds",
        str(args.inprocess_seconds),
        "--warmup",
        str(args.warmup),  # as a served point's: the same texts measured at batch 1 / c=1
        "--modes",
        args.inprocess_modes,
        "--threads",
        str(args.torch_threads),
        "--max-seq-len",
        str(MAX_SEQ_LEN),
        "--execution",
        execution,
    ]
    env = servers.base_env(layout)
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env=env,
        preexec_fn=lambda: os.sched_setaffinity(0, layout.server_cpus),
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0:
        log(f"(a) {mix.name}: in-process run failed: {proc.stderr[-1500:]}")
    for row in rows:
        row["mix"] = mix.name
        row["mode"] = f"{execution} {row['mode']}"
        log(
            f"(a) {mix.name:6} {row['mode']:9} {row['texts_per_s']:7.1f} texts/s "
            f"{row['tokens_per_s']:8.0f} tokens/s  padding x{row['padding_ratio']:.2f}"
        )
    return rows


# ----------------------------------------------------------------------------- (b), (c)
def reference_embeddings(texts: list[str]) -> list[list[float]]:
    from gpuserve.models.sentence_embedding import SentenceEmbedder

    return SentenceEmbedder.load(max_seq_len=MAX_SEQ_LEN).encode(texts).tolist()


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)) or 1.0)


def measure(spec: servers.ServerSpec, mix: Mix, c: int, args: argparse.Namespace, pid: int) -> dict:
    """One closed-loop point with gpuserve's load generator (``pid``: the server's)."""
    from gpuserve.bench.loadgen import LoadSettings, run_async, run_level
    from gpuserve.bench.raw_target import RawHttpTarget

    target = RawHttpTarget(
        spec.url, [servers.body(spec, t) for t in mix.texts], timeout_s=60.0, tokens=mix.tokens
    )
    settings = LoadSettings(
        warmup_s=args.warmup,
        window_s=(args.chunk_duration if mix.name == "chunks" else args.duration) / 3,
        stable_windows=3,
        tolerance=0.10,
        max_windows=3,
        timeout_s=60.0,
    )

    async def one():
        try:
            return await run_level(target, "concurrency", float(c), settings)
        finally:
            await target.close()

    before = servers.scrape_batches(spec)
    threads_before = servers.thread_cpu_s(pid)
    level = run_async(one())
    threads_after = servers.thread_cpu_s(pid)
    after = servers.scrape_batches(spec)
    batches = servers.batch_means(before, after)
    requests = servers.rows_done(after) - servers.rows_done(before)
    cpu = servers.cpu_per_request(pid, threads_before, threads_after, requests)
    s = level.summary
    return {
        "server": spec.name,
        "mix": mix.name,
        "concurrency": c,
        "rps": s.throughput,
        "tokens_per_s": s.tokens_per_s,
        "p50_ms": s.latency_ms[50],
        "p99_ms": s.latency_ms[99],
        "ok": s.ok,
        "errors": s.errors,
        "stable": level.stable,
        "windows_rps": [w.throughput for w in level.windows],
        "client_cpu": level.client_cpu,
        "batches": batches,  # gpuserve's own histograms over the point (warm-up included)
        "server_cpu_us": cpu,  # per request, by thread, over the same span
    }


def bench_server(
    spec: servers.ServerSpec,
    mixes: list[Mix],
    refs: dict[str, list[float]],
    args: argparse.Namespace,
    layout: servers.Layout,
    logdir: Path,
) -> dict:
    res: dict = {"server": spec.name, "label": spec.label, "points": []}
    log_path = logdir / f"{spec.name}.log"
    log(f"[{spec.name}] starting: {spec.label}")
    proc = servers.start(spec, layout, log_path)
    try:
        first = mixes[0]
        ready_s, raw = servers.wait_ready(proc, spec, servers.body(spec, first.texts[0]))
        res["ready_s"] = ready_s
        res["info"] = servers.bench_info(log_path)
        for mix in mixes:
            _, raw = servers.post(spec.url, servers.body(spec, mix.texts[0]))
            similarity = cosine(servers.embedding_of(spec, raw), refs[mix.name])
            res.setdefault("cosine", {})[mix.name] = similarity
            if similarity < 0.999:
                raise RuntimeError(f"wrong embedding for {mix.name}[0]: cosine {similarity:.5f}")
        log(
            f"[{spec.name}] ready after {ready_s:.1f}s, answers checked (cosine "
            + ", ".join(f"{k} {v:.6f}" for k, v in res["cosine"].items())
            + ")"
            + "".join(f"; {line}" for line in res["info"])
        )
        for mix in mixes:
            for c in args.conc:
                point = measure(spec, mix, c, args, proc.pid)
                res["points"].append(point)
                tps = point["tokens_per_s"] or 0.0
                log(
                    f"[{spec.name}] {mix.name:6} c={c:>2}: {point['rps']:7.1f} req/s "
                    f"{tps:8.0f} tokens/s  p50 {point['p50_ms']:7.1f} ms  p99 "
                    f"{point['p99_ms']:7.1f} ms  errors {sum(point['errors'].values())}"
                    + ("" if point["stable"] else "  (windows spread > 10%)")
                )
        if proc.poll() is not None:
            raise RuntimeError(f"{spec.name} exited with code {proc.returncode} during the run")
    except Exception as err:
        res["error"] = str(err)
        log(f"[{spec.name}] FAILED: {err} (log: {log_path})")
        with contextlib.suppress(OSError):
            res["log_tail"] = log_path.read_text(errors="replace")[-2000:]
    finally:
        servers.stop(proc, spec)
    return res


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    layout = servers.Layout(
        cpu_set(args.server_cpus),
        cpu_set(args.client_cpus),
        args.torch_threads,
        args.max_batch,
        args.batch_wait_ms,
    )
    t0 = time.monotonic()
    stamp = dt.datetime.now()
    work = Path(tempfile.mkdtemp(prefix="mixed-length-"))
    logdir = work  # server logs: beside the corpus files, outside the checkout
    args.out_dir.mkdir(parents=True, exist_ok=True)
    info = {
        "date": stamp.isoformat(timespec="seconds"),
        "logs": str(logdir),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "quiet_file": os.path.exists("/work/notes/QUIET"),
        "base_src": os.environ.get("GPUSERVE_BASE_SRC"),
    }
    tokenizer = load_tokenizer()
    counts = {"short": args.short_count, "chunks": args.chunk_count}
    mixes = [Mix(name, counts[name], tokenizer, work) for name in args.mixes]
    for mix in mixes:
        log("corpus", mix.summary()["describe"])
    os.sched_setaffinity(0, layout.client_cpus)  # the load generator's CPU from here on
    specs = servers.specs(layout, args.base_port)
    chosen, skipped = [], []
    for name in args.servers:
        spec = specs[name]
        if spec.skip:
            log(f"SKIPPING {name}: {spec.skip}")
            skipped.append((name, spec.skip))
        else:
            chosen.append(spec)
    refs = {}
    if chosen:  # what every server's first answer per mix is checked against
        embeddings = reference_embeddings([m.texts[0] for m in mixes])
        refs = {m.name: e for m, e in zip(mixes, embeddings, strict=True)}
    fwd: list[dict] = []
    if not args.skip_inprocess:
        for mix in mixes:
            for execution in args.inprocess_executions.split(","):
                fwd += inprocess(args, layout, mix, execution)
    results = [bench_server(spec, mixes, refs, args, layout, logdir) for spec in chosen]
    info["loadavg_end"] = os.getloadavg()
    info["elapsed_s"] = time.monotonic() - t0
    doc = {
        "info": info,
        "config": {
            k: (sorted(v) if isinstance(v, set) else v)
            for k, v in vars(args).items()
            if k != "out_dir"
        },
        "corpus": [m.summary() for m in mixes],
        "inprocess": fwd,
        "servers": results,
        "skipped": skipped,
    }
    text = report.render(doc)
    base = args.out_dir / f"mixed-length-{args.tag}-{stamp:%Y-%m-%d}"
    base.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str))
    base.with_suffix(".md").write_text(text)
    log(f"done in {info['elapsed_s'] / 60:.1f} min: {base}.md / .json")
    print(text)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
