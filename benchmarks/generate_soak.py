#!/usr/bin/env python3
"""Generation soak: memory and KV cache bookkeeping of ``gpuserve serve`` over a long run.

Serves the embedded ``chat`` model (SmolLM2-135M-Instruct GGUF; ``--model-dir`` for another)
from a temporary repository holding the default chat config with a smaller KV cache
(``--kv-cache-mib``), so that the scheduler preempts sometimes, and drives a closed loop of
``--concurrency`` streamed ``/v1/completions`` calls (prompts of real prose,
``benchmarks/corpus.py``, 20 to 2,000 tokens log-uniform; ``max_tokens`` 16 to 256; greedy,
EOS ignored) for ``--duration-s`` seconds. Then it stops sending and waits for every call in
flight to end.

Every ``--sample-s`` seconds it records the server's RSS (VmRSS of the process and its
children, from ``/proc``) and its ``/metrics``: KV blocks and usage, empty slots
(``gpuserve_generation_kv_cache_empty_slots``: token slots in held blocks that hold no
token), running, waiting, preemptions, requests finished by reason.

Figures: RSS after the warm-up (``--warmup-s``, default the first 2 minutes) against the end
(mean of the last minute), its drift in % and its maximum; the empty slots' share of the KV
budget at steady state (mean and max over the samples after the warm-up); preemptions; calls
sent, answered (HTTP 200, a finish reason, the ``max_tokens`` asked for) and lost.

Writes ``results/generate-soak-<tag>-<date>.json`` and ``.md`` with the command and the CPU.

    taskset -c 0 .venv/bin/python benchmarks/generate_soak.py --server-cores 1   # 20 min
    .venv/bin/python benchmarks/generate_soak.py --duration-s 120 --warmup-s 30 --tag quick
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import generate as gen  # noqa: E402  (serve, build_jobs, cpu_line, default_model)

#: Tokens per KV block: the chat config leaves ``generate.block_size`` at its default.
BLOCK_SIZE = 16
CHAT_CONFIG = HERE.parent / "src" / "gpuserve" / "default_repository" / "chat" / "config.yaml"


# -- the server --------------------------------------------------------------------------------


def soak_repository(model: Path, kv_cache_bytes: int, max_running: int) -> Path:
    """A temporary repository holding ``chat``: the default chat config with ``model_dir``,
    ``kv_cache_bytes`` and ``max_running`` replaced (removed by ``gen.serve`` at the end)."""
    lines = []
    for line in CHAT_CONFIG.read_text().splitlines():
        key = line.split(":", 1)[0].strip()
        indent = line[: len(line) - len(line.lstrip())]
        if key == "model_dir":
            line = f"{indent}model_dir: '{model}'"
        elif key == "kv_cache_bytes":
            line = f"{indent}kv_cache_bytes: {kv_cache_bytes}"
        elif key == "max_running":
            line = f"{indent}max_running: {max_running}"
        lines.append(line)
    root = Path(tempfile.mkdtemp(prefix="gen-soak-"))
    (root / "chat" / "1").mkdir(parents=True)
    (root / "chat" / "1" / "README.txt").write_text("weights: huggingface.model_dir\n")
    (root / "chat" / "config.yaml").write_text("\n".join(lines) + "\n")
    return root


def server_pids(port: int) -> list[int]:
    """The ``gpuserve serve`` listening on ``port`` and its descendants."""
    parents: dict[int, int] = {}
    root = None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            if b"serve" in argv and str(port).encode() in argv and b"taskset" not in argv[0]:
                root = int(entry.name)
    if root is None:
        raise RuntimeError(f"no gpuserve process listens on port {port}")
    found, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, ppid in parents.items() if ppid in frontier]
        found += frontier
    return found


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


def scrape(url: str) -> dict[str, float]:
    """The generation gauges and counters of ``chat`` (finished requests by reason)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("gpuserve_generation_") or sample.name.endswith(
                ("_bucket", "_sum", "_count", "_created")
            ):
                continue
            if sample.labels.get("model") != "chat":
                continue
            name = sample.name.removeprefix("gpuserve_generation_")
            if "reason" in sample.labels:
                name += ":" + sample.labels["reason"]
            out[name] = sample.value
    return out


# -- the load ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Tally:
    """What the client saw: calls sent, answered, and how the others failed."""

    sent: int = 0
    answered: int = 0
    tokens: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)

    def fail(self, why: str) -> None:
        self.failures[why] = self.failures.get(why, 0) + 1


async def one_call(client: httpx.AsyncClient, url: str, job: gen.Job, tally: Tally) -> None:
    body = {
        "model": "chat",
        "prompt": job.prompt,
        "max_tokens": job.max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    tally.sent += 1
    reason = None
    usage = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as answer:
            if answer.status_code != 200:
                await answer.aread()
                tally.fail(f"http {answer.status_code}")
                return
            async for line in answer.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                for choice in event.get("choices") or []:
                    reason = choice.get("finish_reason") or reason
                usage = event.get("usage") or usage
    except httpx.HTTPError as err:
        tally.fail(type(err).__name__)
        return
    if reason is None:
        tally.fail("no finish reason")
        return
    tally.reasons[reason] = tally.reasons.get(reason, 0) + 1
    completion = (usage or {}).get("completion_tokens", -1)
    if completion != job.max_tokens:
        tally.fail(f"{completion} tokens of {job.max_tokens}")
        return
    tally.answered += 1
    tally.tokens += completion


async def closed_loop(
    url: str,
    jobs: list[gen.Job],
    concurrency: int,
    duration_s: float,
    drain_s: float,
    tally: Tally,
) -> float:
    """Send ``jobs`` round and round from ``concurrency`` workers until ``duration_s``; the
    calls in flight then finish (those still running after ``drain_s`` more are cancelled and
    count as unfinished). Returns the wall time, seconds."""
    deadline = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=concurrency + 4)
    cursor = iter(range(10**9))
    started = time.monotonic()
    # no read timeout: on a slow core a call can wait many minutes for its first token, and a
    # client that gives up aborts it (that is the client's loss, not the server's)
    timeout = httpx.Timeout(None, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def worker() -> None:
            while time.monotonic() < deadline:
                await one_call(client, url, jobs[next(cursor) % len(jobs)], tally)

        workers = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*workers), duration_s + drain_s)
    return time.monotonic() - started


def sampler(
    url: str, pids: list[int], every_s: float, stop: threading.Event
) -> tuple[list[dict], threading.Thread]:
    """Samples of RSS and metrics every ``every_s`` seconds until ``stop``, taken by the
    returned (started) thread."""
    samples: list[dict] = []
    started = time.monotonic()

    def run() -> None:
        while not stop.is_set():
            row: dict[str, float] = {"t_s": round(time.monotonic() - started, 1)}
            row["rss_bytes"] = rss_bytes(pids)
            with contextlib.suppress(httpx.HTTPError):
                row.update(scrape(url))
            samples.append(row)
            stop.wait(every_s)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return samples, thread


# -- figures -----------------------------------------------------------------------------------


def figures(samples: list[dict], warmup_s: float, tally: Tally, wall_s: float) -> dict:
    steady = [s for s in samples if s["t_s"] >= warmup_s] or samples
    end_t = samples[-1]["t_s"]
    warm = statistics.fmean(s["rss_bytes"] for s in steady if s["t_s"] < warmup_s + 60)
    tail = [s["rss_bytes"] for s in steady if s["t_s"] >= end_t - 60]
    end = statistics.fmean(tail)
    rss = [s["rss_bytes"] for s in samples]
    slots = [
        (s["kv_cache_empty_slots"], s["kv_cache_blocks"] * BLOCK_SIZE)
        for s in steady
        if "kv_cache_empty_slots" in s and s.get("kv_cache_blocks")
    ]
    shares = [100.0 * empty / budget for empty, budget in slots]
    busy = [
        100.0
        * s["kv_cache_empty_slots"]
        / (s["kv_cache_usage"] * s["kv_cache_blocks"] * BLOCK_SIZE)
        for s in steady
        if "kv_cache_empty_slots" in s and s.get("kv_cache_usage")
    ]
    last = samples[-1]
    finished = {k.split(":", 1)[1]: v for k, v in last.items() if k.startswith("requests_finished")}
    return {
        "wall_s": round(wall_s, 1),
        "rss_after_warmup_mb": round(warm / 2**20, 1),
        "rss_end_mb": round(end / 2**20, 1),
        "rss_drift_pct": round(100.0 * (end - warm) / warm, 2),
        "rss_max_mb": round(max(rss) / 2**20, 1),
        "rss_min_after_warmup_mb": round(min(s["rss_bytes"] for s in steady) / 2**20, 1),
        "empty_slots_share_of_budget_pct_mean": round(statistics.fmean(shares), 3)
        if shares
        else None,
        "empty_slots_share_of_budget_pct_max": round(max(shares), 3) if shares else None,
        "empty_slots_share_of_held_pct_mean": round(statistics.fmean(busy), 3) if busy else None,
        "kv_usage_mean": round(statistics.fmean(s.get("kv_cache_usage", 0) for s in steady), 3),
        "running_mean": round(statistics.fmean(s.get("running", 0) for s in steady), 1),
        "waiting_max": max(s.get("waiting", 0) for s in steady),
        "preemptions": last.get("preemptions_total"),
        "server_finished_by_reason": finished,
        "sent": tally.sent,
        "answered": tally.answered,
        "lost": tally.sent - tally.answered,
        "failures": tally.failures,
        "unfinished_at_drain_deadline": tally.sent - tally.answered - sum(tally.failures.values()),
        "client_finish_reasons": tally.reasons,
        "output_tokens_s": round(tally.tokens / wall_s, 1),
    }


def write_report(tag: str, results: dict) -> Path:
    gen.RESULTS.mkdir(exist_ok=True)
    stem = gen.RESULTS / f"generate-soak-{tag}-{datetime.date.today().isoformat()}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2))
    f = results["figures"]
    rows = [
        ("RSS after warm-up (mean of the minute after it)", f"{f['rss_after_warmup_mb']} MB"),
        ("RSS at the end (mean of the last minute)", f"{f['rss_end_mb']} MB"),
        ("RSS drift", f"{f['rss_drift_pct']:+} % (target: within ±2 %)"),
        ("RSS max", f"{f['rss_max_mb']} MB"),
        (
            "empty KV slots / budget, steady state",
            f"mean {f['empty_slots_share_of_budget_pct_mean']} %, max "
            f"{f['empty_slots_share_of_budget_pct_max']} % (target: < 4 %)",
        ),
        ("empty KV slots / held slots, mean", f"{f['empty_slots_share_of_held_pct_mean']} %"),
        ("KV usage mean; running mean; waiting max",
         f"{f['kv_usage_mean']}; {f['running_mean']}; {f['waiting_max']}"),
        ("preemptions", str(f["preemptions"])),
        ("calls sent / answered / lost", f"{f['sent']} / {f['answered']} / {f['lost']}"),
        ("server: finished by reason", json.dumps(f["server_finished_by_reason"])),
        ("output tokens/s", str(f["output_tokens_s"])),
    ]  # fmt: skip
    lines = [
        f"# Generation soak ({tag})",
        "",
        f"`{results['command']}`",
        "",
        f"CPU: {results['cpu']}",
        "",
        f"Setup: {results['setup']}",
        "",
        "| figure | value |",
        "|---|---|",
        *(f"| {a} | {b} |" for a, b in rows),
        "",
        f"Samples: {len(results['samples'])}, every {results['sample_s']} s "
        "(all of them in the JSON file).",
        "",
    ]
    stem.with_suffix(".md").write_text("\n".join(lines))
    return stem.with_suffix(".md")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration-s", type=float, default=1200.0)
    parser.add_argument("--warmup-s", type=float, default=120.0)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--drain-s", type=float, default=900.0, help="wait for calls in flight")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--kv-cache-mib", type=int, default=384, help="the chat config's: 512")
    parser.add_argument("--max-running", type=int, default=32)
    parser.add_argument("--prompt-tokens", default="20,2000")
    parser.add_argument("--max-tokens", default="16,256")
    parser.add_argument("--jobs", type=int, default=400, help="distinct prompts, sent in turn")
    parser.add_argument("--model-dir", type=Path, default=None, help="GGUF file or HF folder")
    parser.add_argument("--server-cores", default=None, help="taskset list, e.g. 1")
    parser.add_argument("--tag", default="cpu")
    parser.add_argument("--seed", type=int, default=20261206)
    args = parser.parse_args(argv)
    model = args.model_dir or gen.default_model()
    if args.server_cores:  # the client on the other cores
        server = {int(c) for c in args.server_cores.split(",")}
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)) - server or {0})
    import transformers

    gen.log(f"tokenizer of {model.name}; {args.jobs} prompts")
    tokenizer = (
        transformers.AutoTokenizer.from_pretrained(str(model.parent), gguf_file=model.name)
        if model.is_file()
        else transformers.AutoTokenizer.from_pretrained(str(model))
    )
    lo, hi = (int(x) for x in args.prompt_tokens.split(","))
    fewest, most = (int(x) for x in args.max_tokens.split(","))
    lengths, outputs = (lo, hi), (fewest, most)
    jobs = gen.build_jobs(tokenizer, args.jobs, args.seed, lengths, outputs)
    random.Random(args.seed).shuffle(jobs)
    root = soak_repository(model, args.kv_cache_mib << 20, args.max_running)
    tally = Tally()
    with gen.serve(root, args.server_cores) as url:
        pids = server_pids(int(url.rsplit(":", 1)[1]))
        gen.log(f"server up (pids {pids}); soak of {args.duration_s:.0f} s at c={args.concurrency}")
        stop = threading.Event()
        samples, thread = sampler(url, pids, args.sample_s, stop)
        wall = asyncio.run(
            closed_loop(url, jobs, args.concurrency, args.duration_s, args.drain_s, tally)
        )
        time.sleep(args.sample_s)  # one sample after the last call
        stop.set()
        thread.join(30)
    results = {
        "command": " ".join(
            [Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]
        ),
        "cpu": gen.cpu_line(),
        "setup": f"chat = {model.name}, default chat config with kv_cache_bytes "
        f"{args.kv_cache_mib} MiB, max_running {args.max_running}; closed loop c="
        f"{args.concurrency}, prompts {lengths[0]}-{lengths[1]} tokens (log-uniform, stdlib "
        f"prose, {args.jobs} distinct), max_tokens {outputs[0]}-{outputs[1]}, greedy, EOS "
        f"ignored, {args.duration_s:.0f} s; server on cores {args.server_cores or 'all'}",
        "sample_s": args.sample_s,
        "figures": figures(samples, args.warmup_s, tally, wall),
        "samples": samples,
    }
    report = write_report(args.tag, results)
    print(report.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
