#!/usr/bin/env python3
"""BC-28 timing (issue 20): a short request while a 2 MB text is being processed.

Starts ``gpuserve serve`` on the embedded default repository (``text_embedding``, CPU), pinned
to ``--server-cpus`` with one torch thread, and measures over HTTP (V2 JSON, raw text):

1. the solo latency of a short text (median of ``--solo`` requests, one at a time);
2. ``--trials`` times for each delay of ``--after-s`` (0.5 s as in BC-28, and 0.05 s, while
   the huge request is surely still in flight): a ~2.1 MB text (English words, about 720k
   tokens untruncated) is sent, and that long after it went out, one short request; both
   latencies, the huge request's status (200: truncated to max_seq_len) and the short one's.

Targets (``../shared/cases`` BC-28, issue 20): the short request within 3 x its solo latency;
the huge text 200 or a clear 4xx well under a second. Writes
``results/huge-text-<date>.md`` and ``.json``.

    python benchmarks/huge_text.py
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
PROSE = (
    "the server batches requests of similar length and truncates long texts before it "
    "tokenises them so that one huge input cannot hold up the others for seconds"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def body(text: str) -> bytes:
    return json.dumps(
        {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [text]}]}
    ).encode()


def timed_post(client: httpx.Client, payload: bytes) -> tuple[int, float]:
    """(status, seconds) of one infer."""
    started = time.perf_counter()
    response = client.post(
        "/v2/models/text_embedding/infer",
        content=payload,
        headers={"content-type": "application/json"},
    )
    return response.status_code, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server-cpus", default="1")
    parser.add_argument("--solo", type=int, default=30)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument(
        "--after-s",
        default="0.5,0.05",
        help="comma list: delays of the short request after the huge one (each --trials times)",
    )
    parser.add_argument("--megabytes", type=float, default=2.1)
    args = parser.parse_args()

    rng = random.Random(28)
    words = PROSE.split()
    huge_words: list[str] = []
    size = 0
    while size < args.megabytes * 1e6:
        word = rng.choice(words)
        huge_words.append(word)
        size += len(word) + 1
    huge = body(" ".join(huge_words))
    short = body("a short sentence from another client")

    port = free_port()
    cpus = {int(c) for c in args.server_cpus.split(",")}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "gpuserve", "serve", "--host", "127.0.0.1"]
    command += ["--http-port", str(port), "--grpc-port", "-1", "--metrics-port", "-1"]
    command += ["--log-level", "warning"]
    server = subprocess.Popen(command, env=env, preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise SystemExit("the server did not become ready within 120 s")
        with httpx.Client(base_url=url, timeout=60) as client:
            for _ in range(5):
                timed_post(client, short)  # warm-up
            solo = [timed_post(client, short)[1] for _ in range(args.solo)]
        solo_s = statistics.median(solo)
        trials = []
        for after_s in [float(a) for a in args.after_s.split(",")] * args.trials:
            result: dict[str, tuple[int, float]] = {"after": (0, after_s)}

            def send_huge(result: dict[str, tuple[int, float]] = result) -> None:
                with httpx.Client(base_url=url, timeout=60) as client:
                    result["huge"] = timed_post(client, huge)

            thread = threading.Thread(target=send_huge)
            thread.start()
            time.sleep(after_s)
            with httpx.Client(base_url=url, timeout=60) as client:
                result["short"] = timed_post(client, short)
            thread.join()
            trials.append(result)
            time.sleep(0.5)
    finally:
        server.terminate()
        server.wait(30)

    rows = [
        {
            "after_s": t["after"][1],
            "huge_status": t["huge"][0],
            "huge_s": round(t["huge"][1], 4),
            "short_status": t["short"][0],
            "short_s": round(t["short"][1], 4),
            "short_over_solo": round(t["short"][1] / solo_s, 2),
        }
        for t in trials
    ]
    worst_ratio = max(r["short_over_solo"] for r in rows)
    worst_huge = max(r["huge_s"] for r in rows)
    load = os.getloadavg()[0]
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    lines = [
        f"# BC-28 timing: a short request while a {len(huge) / 1e6:.1f} MB text is processed "
        f"({dt.datetime.now(dt.UTC).isoformat(timespec='seconds')})",
        "",
        f"Command: `python benchmarks/huge_text.py` (server on CPUs {args.server_cpus}, 1 torch "
        f"thread; load average at the end {load:.2f}). Short request solo: median "
        f"{solo_s * 1e3:.1f} ms of {args.solo}. The short request goes `after` s after the "
        "huge one went out.",
        "",
        "| trial | after s | huge status | huge s | short status | short ms | short / solo |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, 1):
        lines.append(
            f"| {i} | {r['after_s']} | {r['huge_status']} | {r['huge_s']:.3f} | "
            f"{r['short_status']} | {r['short_s'] * 1e3:.1f} | {r['short_over_solo']:.2f} |"
        )
    lines += [
        "",
        f"Targets: short <= 3 x solo: worst {worst_ratio:.2f} "
        f"({'PASS' if worst_ratio <= 3 else 'FAIL'}); huge text answered well under a second: "
        f"worst {worst_huge:.3f} s ({'PASS' if worst_huge < 1 else 'FAIL'}), statuses "
        f"{sorted({r['huge_status'] for r in rows})}.",
    ]
    out = HERE / "results" / f"huge-text-{stamp}"
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(
        json.dumps({"solo_s": solo_s, "trials": rows, "load": load}, indent=1) + "\n"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
