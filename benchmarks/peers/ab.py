#!/usr/bin/env python3
"""Before/after per-request cost of gpuserve: a change against a base commit, measured so that
drift cancels.

run.py's before/after table restarts each server once per round and measures each point for
several seconds; on a shared machine whose speed drifts by tens of percent within minutes, a
5% difference then needs many runs to show. This script keeps both servers running (the idle
one costs nothing: its CPU use is checked) and alternates short points between them in ABBA
order, so a slow minute hits both equally, then reports per concurrency:

- mean req/s and server CPU µs/request of each, and the paired ratio new/base (the mean of
  the per-pair ratios, with a 95% interval: mean ± 1.96 standard errors);
- with ``--instructions N``: user-space instructions per request of each server, counted by
  valgrind's callgrind over N requests after a warm-up (both threads, deterministic to about
  1%: the one figure here that does not move with the machine's load). Kernel time is not in
  it; the CPU µs/request column has it.

  GPUSERVE_BASE_SRC=/work/bench-before/src .venv/bin/python ab.py --conc 8,64 --pairs 12 \\
      --instructions 2000 --tag ab-x

Writes results/<tag>-<date>.md and .json. Servers and settings as run.py's ``gpuserve-base``
and ``gpuserve`` entries (servers.toml), pinned to --server-cpus, the load (wrk) to
--client-cpus.
"""
import argparse
import asyncio
import datetime as dt
import json
import math
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import run
from run import BODY, log

NAMES = ("gpuserve-base", "gpuserve")


def ab_order(pairs: int) -> list[tuple[int, int]]:
    """(first, second) server indexes per pair: ABBA ABBA..., so a linear drift within each
    four points favours neither."""
    return [(0, 1) if i % 2 == 0 else (1, 0) for i in range(pairs)]


def paired(ratios: list[float]) -> tuple[float, float]:
    """Mean of per-pair ratios and the half-width of its 95% interval (normal approximation)."""
    n = len(ratios)
    mean = sum(ratios) / n
    if n < 2:
        return mean, math.nan
    var = sum((r - mean) ** 2 for r in ratios) / (n - 1)
    return mean, 1.96 * math.sqrt(var / n)


def own_ports(srv) -> None:
    """gRPC and metrics on the two ports after the server's HTTP port: both servers run at once."""
    os.environ["BENCH_GRPC_PORT"] = str(srv["port"] + 1)
    os.environ["BENCH_METRICS_PORT"] = str(srv["port"] + 2)


# -- callgrind: instructions per request ------------------------------------------------------


async def _send(port: int, model: str, count: int, conns: int) -> None:
    """Exactly ``count`` V2 requests over ``conns`` keep-alive connections."""
    body = Path(BODY[model]).read_bytes()
    head = (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: bench\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    left = [count]

    async def one_connection() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while left[0] > 0:
            left[0] -= 1
            writer.write(head + body)
            status = await reader.readuntil(b"\r\n\r\n")
            if not status.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"server answered {status[:40]!r}")
            length = next(int(line.split(b":")[1]) for line in status.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            await reader.readexactly(length)
        writer.close()

    await asyncio.gather(*(one_connection() for _ in range(conns)))


def instructions_per_request(args, srv, model: str, conns: int, count: int, logdir: str) -> float:
    """Start ``srv`` under callgrind (instrumentation off), warm it up, count the instructions
    of ``count`` requests at ``conns`` connections, stop it."""
    out = os.path.join(logdir, f"{srv['name']}-c{conns}.callgrind")
    grind = dict(srv, cmd=["valgrind", "--tool=callgrind", "--instr-atstart=no",
                           f"--callgrind-out-file={out}", *srv["cmd"]])
    own_ports(srv)
    proc = run.start_server(args, grind, model, logdir)
    url = run.DEFAULT_URL.format(port=srv["port"], model=model)
    try:
        run.wait_ready(proc, url, Path(BODY[model]).read_bytes(), 600)
        asyncio.run(_send(srv["port"], model, 300, conns))
        subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True, capture_output=True)
        asyncio.run(_send(srv["port"], model, count, conns))
        subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], check=True, capture_output=True)
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
        dumps = sorted(Path(logdir).glob(os.path.basename(out) + ".*"), key=os.path.getmtime)
        totals = [line for line in dumps[-1].read_text().splitlines() if line.startswith("totals:")]
        return int(totals[0].split()[1]) / count
    finally:
        run.stop_server(proc, srv["port"])


# -- the report -------------------------------------------------------------------------------


def report(args, rows, grind, info) -> str:
    lines = [
        f"# gpuserve before/after: {args.model}, {args.pairs} ABBA pairs of {args.seconds:g} s points",
        "",
        f"Date {info['date']}; base `{info['base']}`, new `{info['new']}`; server CPUs "
        f"{args.server_cpus}, client CPUs {args.client_cpus}; load average at start {info['load']}.",
        "",
        f"Command: `{info['command']}`",
        "",
        "| c | base req/s | new req/s | new/base (paired, 95%) | base CPU µs/req | new CPU µs/req "
        "| new/base CPU (paired, 95%) |",
        "|---:|---:|---:|---|---:|---:|---|",
    ]
    for c, row in rows.items():
        rps, rps_ci = row["rps_ratio"]
        cpu, cpu_ci = row["cpu_ratio"]
        lines.append(
            f"| {c} | {row['base_rps']:.0f} | {row['new_rps']:.0f} | {rps:.3f} ± {rps_ci:.3f} "
            f"| {row['base_cpu_us']:.1f} | {row['new_cpu_us']:.1f} | {cpu:.3f} ± {cpu_ci:.3f} |")
    if grind:
        lines += ["", f"User-space instructions per request (callgrind, {args.instructions} requests "
                  "after 300 of warm-up, both threads):", "",
                  "| c | base | new | new/base |", "|---:|---:|---:|---:|"]
        for c, (base, new) in grind.items():
            lines.append(f"| {c} | {base:,.0f} | {new:,.0f} | {new / base:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="identity", choices=sorted(BODY))
    ap.add_argument("--conc", default="8,64")
    ap.add_argument("--pairs", type=int, default=12, help="ABBA pairs of points per concurrency")
    ap.add_argument("--seconds", type=float, default=3.0, help="length of one point")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of load per server and c first")
    ap.add_argument("--instructions", type=int, default=0,
                    help="also count instructions/request under callgrind over this many requests")
    ap.add_argument("--server-cpus", default="1")
    ap.add_argument("--client-cpus", default="0")
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--batch-wait-ms", type=float, default=2.0)
    ap.add_argument("--wrk-timeout", type=int, default=10)
    ap.add_argument("--tag", default="ab")
    args = ap.parse_args()
    conc = [int(c) for c in args.conc.split(",")]
    if not os.environ.get("GPUSERVE_BASE_SRC"):
        sys.exit("set GPUSERVE_BASE_SRC=<exported base commit>/src (README.md)")
    if args.instructions and not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        sys.exit("--instructions needs valgrind (Debian: apt-get install valgrind)")
    with open(os.path.join(run.BENCH, "servers.toml"), "rb") as f:
        registry = {s["name"]: s for s in tomllib.load(f)["server"]}
    servers = [registry[name] for name in NAMES]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    logdir = os.path.join(run.BENCH, "results", "logs", f"ab-{stamp}")
    os.makedirs(logdir, exist_ok=True)
    info = {"date": dt.date.today().isoformat(), "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "command": " ".join(["ab.py", *sys.argv[1:]]),
            "base": os.environ["GPUSERVE_BASE_SRC"], "new": "this checkout"}
    body = Path(BODY[args.model]).read_bytes()
    procs, urls = [], []
    try:
        for srv in servers:
            own_ports(srv)
            proc = run.start_server(args, srv, args.model, logdir)
            url = run.DEFAULT_URL.format(port=srv["port"], model=args.model)
            ready_s, raw = run.wait_ready(proc, url, body, srv.get("ready_timeout_s", 180))
            problem = run.check_response(args.model, raw)
            if problem:
                raise RuntimeError(f"{srv['name']}: {problem}")
            log(f"[{srv['name']}] ready after {ready_s:.1f}s;", *run.bench_info_lines(proc.logfile))
            procs.append(proc)
            urls.append(url)
        rows = {}
        for c in conc:
            for proc, url in zip(procs, urls):
                run.run_wrk(args, url, BODY[args.model], c, args.warmup)
                run.drain(url, body)
            points: list[list[dict]] = [[], []]
            for first, second in ab_order(args.pairs):
                for i in (first, second):
                    point = run.measure_point(args, procs[i], urls[i], args.model, c, args.seconds)
                    run.drain(urls[i], body, settle=0.2)
                    points[i].append(point)
                log(f"c={c} pair {len(points[0])}: base {points[0][-1]['rps']:.0f} req/s, "
                    f"new {points[1][-1]['rps']:.0f} req/s")
            base, new = points
            rows[c] = {
                "base_rps": sum(p["rps"] for p in base) / len(base),
                "new_rps": sum(p["rps"] for p in new) / len(new),
                "base_cpu_us": sum(p["cpu_us_per_req"] for p in base) / len(base),
                "new_cpu_us": sum(p["cpu_us_per_req"] for p in new) / len(new),
                "rps_ratio": paired([n["rps"] / b["rps"] for b, n in zip(base, new)]),
                "cpu_ratio": paired([n["cpu_us_per_req"] / b["cpu_us_per_req"] for b, n in zip(base, new)]),
                "points": {"base": base, "new": new},
            }
    finally:
        for proc, srv in zip(procs, servers):
            run.stop_server(proc, srv["port"])
    grind = {}
    for c in conc if args.instructions else ():
        grind[c] = tuple(instructions_per_request(args, srv, args.model, c, args.instructions, logdir)
                         for srv in servers)
        log(f"c={c}: instructions/request base {grind[c][0]:,.0f}, new {grind[c][1]:,.0f}")
    md = report(args, rows, grind, info)
    out = os.path.join(run.BENCH, "results", f"{args.tag}-{info['date']}")
    Path(out + ".md").write_text(md)
    Path(out + ".json").write_text(json.dumps(
        {"info": info, "rows": rows, "instructions": grind}, indent=1, default=str))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
