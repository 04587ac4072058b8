#!/usr/bin/env python3
"""Interactive and bulk on one server: what a batch job costs the interactive traffic, and
how fast the job runs.

One ``gpuserve serve`` of the default repository's ``text_embedding`` (pinned with
``--server-cores``), and in turn:

1. **interactive alone**: an open loop of single-sentence ``/v1/embeddings`` calls at
   ``--rate`` per second for ``--seconds``: latency p50/p99;
2. **plain bulk calls**: ``/v1/embeddings`` calls of ``--per-line`` sentences each, closed
   loop at ``--concurrency``: rows/s (the server's rate on ordinary calls);
3. **the job alone**: a Batch API job of ``--inputs`` sentences (``--per-line`` per JSONL
   line): rows/s from creation to completion;
4. **interactive with the job**: the open loop of (1) while the same job runs: latency
   p50/p99.

With ``--rounds N`` (N > 1) the four are interleaved instead, so that what is compared is
measured under the same background load of the machine: each of N rounds makes 1/N of the
plain calls, runs a job of 1/N of the inputs, then runs one steady open loop: ``--seconds``/N
without a job, then a job is started and, from a second later (its lines running), as long
again (the job is then cancelled and waited for); each rate and p99 is over all rounds.

Targets: p99 of (4) <= 1.5 x p99 of (1); rows/s of (3) >= 0.9 x rows/s of (2). The sentences
are real prose (``benchmarks/corpus.py``). Writes ``results/bulk-lanes-<date>.json``/``.md``
with the CPU (``lscpu``) and the command.

    .venv/bin/python benchmarks/bulk_lanes.py                     # 200,000 inputs, ~10 min
    .venv/bin/python benchmarks/bulk_lanes.py --inputs 20000 --seconds 20 --server-cores 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import io
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import corpus  # noqa: E402
from generate import cpu_line, log, serve  # noqa: E402

from gpuserve.bench.generation import pct  # noqa: E402

RESULTS = HERE / "results"


@contextlib.contextmanager
def server(cores: str | None, bulk_rows: int | None) -> Iterator[str]:
    """gpuserve serving a copy of the default ``text_embedding`` (its
    ``dynamic_batching.bulk_max_batch_size`` set to ``bulk_rows`` when given)."""
    from gpuserve.config import default_model_repository

    root = Path(tempfile.mkdtemp(prefix="bulk-bench-"))
    shutil.copytree(default_model_repository() / "text_embedding", root / "text_embedding")
    if bulk_rows:
        config = root / "text_embedding" / "config.yaml"
        text = config.read_text().replace(
            "dynamic_batching:\n", f"dynamic_batching:\n  bulk_max_batch_size: {bulk_rows}\n", 1
        )
        config.write_text(text)
    with serve(root, cores, "--state-dir", str(root / "state")) as url:
        yield url


async def interactive(
    url: str,
    texts: list[str],
    rate: float,
    seconds: float,
    raw: bool = False,
    stop: asyncio.Event | None = None,
) -> dict[str, Any]:
    """An open loop of single-text calls at ``rate`` per second for ``seconds`` (or, with
    ``stop``, until it is set): the latency summary, or with ``raw`` the calls as
    ``(sent, latency)`` pairs (``time.perf_counter`` seconds) and the failure count."""
    rng = random.Random(1)
    calls: list[tuple[float, float]] = []
    failures = 0
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=256)) as client:

        async def one(text: str) -> None:
            nonlocal failures
            started = time.perf_counter()
            answer = await client.post(
                f"{url}/v1/embeddings", json={"model": "text_embedding", "input": text}
            )
            if answer.status_code != 200:
                failures += 1
                return
            calls.append((started, time.perf_counter() - started))

        tasks = []
        end = time.perf_counter() + seconds
        while not stop.is_set() if stop is not None else time.perf_counter() < end:
            tasks.append(asyncio.create_task(one(rng.choice(texts))))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    if raw:
        return {"calls": calls, "failures": failures}
    return summary([latency for _, latency in calls], failures)


async def steady_round(
    url: str, texts: list[str], data: bytes, rate: float, part: float
) -> tuple[list[float], list[float], int]:
    """One steady open loop: ``part`` seconds without a job, then a job of ``data`` is started
    and, once its lines run (a second later), ``part`` seconds more; then the job is cancelled
    and waited for. Latencies (seconds) of the calls sent before the job's creation and
    after its lines started; calls sent in between count in neither; and the failures."""
    stop = asyncio.Event()
    loop = asyncio.create_task(interactive(url, texts, rate, 0.0, raw=True, stop=stop))
    await asyncio.sleep(part)
    created = time.perf_counter()
    client, batch_id = await asyncio.to_thread(start_job, url, data)
    await asyncio.sleep(1.0)  # validated, its lines queued and running
    running = time.perf_counter()
    await asyncio.sleep(part)
    stop.set()
    result = await loop
    await asyncio.to_thread(client.batches.cancel, batch_id)  # type: ignore[attr-defined]
    await asyncio.to_thread(wait_final, client, batch_id)
    alone = [latency for sent, latency in result["calls"] if sent < created]
    crowded = [latency for sent, latency in result["calls"] if sent >= running]
    return alone, crowded, result["failures"]


async def plain_calls(
    url: str, texts: list[str], per_call: int, concurrency: int, calls: int
) -> float:
    async with httpx.AsyncClient(timeout=300) as client:
        queue = list(range(calls))

        async def worker() -> None:
            while queue:
                i = queue.pop()
                chunk = [texts[(i * per_call + k) % len(texts)] for k in range(per_call)]
                answer = await client.post(
                    f"{url}/v1/embeddings", json={"model": "text_embedding", "input": chunk}
                )
                answer.raise_for_status()

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return calls * per_call / (time.perf_counter() - started)


def job_file(texts: list[str], inputs: int, per_line: int) -> bytes:
    lines = []
    for i in range(0, inputs, per_line):
        chunk = [texts[(i + k) % len(texts)] for k in range(min(per_line, inputs - i))]
        lines.append(
            json.dumps(
                {
                    "custom_id": f"line-{i // per_line}",
                    "method": "POST",
                    "url": "/v1/embeddings",
                    "body": {"model": "text_embedding", "input": chunk},
                }
            )
        )
    return ("\n".join(lines) + "\n").encode()


def start_job(url: str, data: bytes) -> tuple[object, str]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    upload = client.files.create(file=("job.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    return client, batch.id


def wait_final(client: object, batch_id: str) -> str:
    """Wait until the batch is final (after a cancel: its lines in flight finished)."""
    while True:
        batch = client.batches.retrieve(batch_id)  # type: ignore[attr-defined]
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return str(batch.status)
        time.sleep(0.2)


def interleaved(
    url: str, texts: list[str], args: argparse.Namespace, calls: int
) -> dict[str, object]:
    """(1) to (4) in ``args.rounds`` rounds, each with its share of the plain calls, a job of
    its share of the inputs, and ``seconds / rounds`` of the open loop without and then
    with a job running (cancelled at the round's end, and waited for); rates and latencies
    are over all rounds."""
    rounds = args.rounds
    part = args.seconds / rounds
    alone: list[float] = []
    crowded: list[float] = []
    failures = 0
    plain_s = job_s = 0.0
    plain_rows = job_rows = 0
    crowd = job_file(texts, args.inputs, args.per_line)  # runs past each round's end
    for index in range(rounds):
        log(f"round {index + 1}/{rounds}: plain calls")
        share = max(1, calls // rounds)
        plain_s += share * args.per_line / asyncio.run(
            plain_calls(url, texts, args.per_line, args.concurrency, share)
        )
        plain_rows += share * args.per_line
        log("  the job alone")
        inputs = max(args.per_line, args.inputs // rounds)
        client, batch_id = start_job(url, job_file(texts, inputs, args.per_line))
        job_s += wait_job(client, batch_id)
        job_rows += inputs
        log("  interactive, then a job starts")
        alone_part, crowded_part, failed = asyncio.run(
            steady_round(url, texts, crowd, args.rate, part)
        )
        alone.extend(alone_part)
        crowded.extend(crowded_part)
        failures += failed
    return {
        "plain_rows_s": round(plain_rows / plain_s, 1),
        "job_rows_s": round(job_rows / job_s, 1),
        "interactive_alone": summary(alone, 0),
        "interactive_with_job": summary(crowded, 0),
        "interactive_failures": failures,
    }


def summary(latencies: list[float], failures: int) -> dict[str, float]:
    """Count, failures, p50 and p99 (milliseconds) of ``latencies`` (seconds)."""
    return {
        "requests": len(latencies),
        "failures": failures,
        "p50_ms": round(pct(latencies, 0.5) * 1e3, 2),
        "p99_ms": round(pct(latencies, 0.99) * 1e3, 2),
    }


def wait_job(client: object, batch_id: str) -> float:
    started = time.perf_counter()
    while True:
        batch = client.batches.retrieve(batch_id)  # type: ignore[attr-defined]
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            if batch.status != "completed":
                raise RuntimeError(f"the job ended {batch.status}: {batch.errors}")
            return time.perf_counter() - started
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--inputs", type=int, default=200_000)
    parser.add_argument("--per-line", type=int, default=64)
    parser.add_argument("--rate", type=float, default=20.0, help="interactive calls per second")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--server-cores", default=None)
    parser.add_argument(
        "--bulk-max-batch-size", type=int, default=None, help="the model's bulk batch rows"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="interleave the interactive runs without and with the job in this many rounds",
    )
    parser.add_argument("--tag", default="", help="added to the results file's name")
    args = parser.parse_args(argv)
    texts = list(corpus.build("short").texts)
    results: dict[str, object] = {
        "cpu": cpu_line(),
        "command": " ".join(["bulk_lanes.py", *(argv or sys.argv[1:])]),
    }
    calls = max(20, args.inputs // args.per_line // 10)
    with server(args.server_cores, args.bulk_max_batch_size) as url:
        if args.rounds > 1:
            results.update(interleaved(url, texts, args, calls))
        else:
            log("interactive alone")
            results["interactive_alone"] = asyncio.run(
                interactive(url, texts, args.rate, args.seconds)
            )
            log(f"  {results['interactive_alone']}")
            log(f"plain calls: {calls} x {args.per_line} inputs")
            plain = asyncio.run(plain_calls(url, texts, args.per_line, args.concurrency, calls))
            results["plain_rows_s"] = round(plain, 1)
            data = job_file(texts, args.inputs, args.per_line)
            log(f"the job alone: {args.inputs} inputs")
            client, batch_id = start_job(url, data)
            job_s = wait_job(client, batch_id)
            results["job_rows_s"] = round(args.inputs / job_s, 1)
            log("interactive with the job running")
            client, batch_id = start_job(url, data)
            results["interactive_with_job"] = asyncio.run(
                interactive(url, texts, args.rate, args.seconds)
            )
            client.batches.cancel(batch_id)  # type: ignore[attr-defined]
        log(f"  alone {results['interactive_alone']}, with {results['interactive_with_job']}")
        results["load_average"] = os.getloadavg()  # of the whole machine, at the end
    alone = results["interactive_alone"]["p99_ms"]  # type: ignore[index]
    crowded = results["interactive_with_job"]["p99_ms"]  # type: ignore[index]
    results["targets"] = {
        "p99 with job / alone (<= 1.5)": round(crowded / alone, 2),
        "job rows/s / plain rows/s (>= 0.9)": round(
            results["job_rows_s"] / results["plain_rows_s"],  # type: ignore[operator]
            2,
        ),
    }
    RESULTS.mkdir(exist_ok=True)
    tag = f"-{args.tag}" if args.tag else ""
    stem = RESULTS / f"bulk-lanes-{datetime.date.today().isoformat()}{tag}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2))
    text = "\n".join(
        [
            "# Interactive and bulk on one server",
            "",
            f"`{results['command']}`",
            "",
            f"CPU: {results['cpu']}",
            "",
            "```",
            json.dumps(results, indent=2),
            "```",
            "",
        ]
    )
    stem.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
