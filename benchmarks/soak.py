#!/usr/bin/env python3
"""Soak test: sustained mixed load with a share of bad requests, watching memory and tails.

Starts ``gpuserve serve`` on the test fixture repository (tests/fixtures/repository), then for
``--duration-s`` seconds keeps ``--concurrency`` clients busy with a random mix:

* double_fp32: 1-8 rows of FP32 [16], JSON or binary tensors;
* varlen_fp32: random row length 0-64 (exercises shape grouping);
* echo_bytes: random UTF-8 strings, 0-200 bytes;
* a share (``--bad-share``) of bad requests: malformed JSON, wrong datatype, wrong element
  count, unknown model, unknown input, truncated binary body.

Every response is checked: good requests must return 200 with the right values; bad requests
must get their 4xx. Anything else is a failure of the kind named in the report. Every
``--window-s`` seconds it records the server's resident memory (from /proc) and the window's
p50/p99 latency. Writes results/soak-<date>.json and .md.

Usage: python benchmarks/soak.py --duration-s 600
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime as dt
import json
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
REPOSITORY = HERE.parent / "tests" / "fixtures" / "repository"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def make_request(rng: random.Random, bad_share: float):
    """Return (path, content, headers, expected_status, check) for one random request."""
    if rng.random() < bad_share:
        kind = rng.choice(["json", "datatype", "count", "model", "input", "binary"])
        good = {
            "inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 16}]
        }
        path = "/v2/models/double_fp32/infer"
        headers = {"content-type": "application/json"}
        if kind == "json":
            return path, b'{"inputs": [', headers, 400, None, "bad:json"
        if kind == "datatype":
            good["inputs"][0]["datatype"] = "INT32"
        elif kind == "count":
            good["inputs"][0]["data"] = [1.0] * 15
        elif kind == "model":
            return (
                "/v2/models/nope/infer",
                json.dumps(good).encode(),
                headers,
                404,
                None,
                "bad:model",
            )
        elif kind == "input":
            good["inputs"][0]["name"] = "NOPE"
        elif kind == "binary":
            header = json.dumps(
                {
                    "inputs": [
                        {
                            "name": "INPUT0",
                            "shape": [1, 16],
                            "datatype": "FP32",
                            "parameters": {"binary_data_size": 64},
                        }
                    ]
                }
            ).encode()
            headers["inference-header-content-length"] = str(len(header))
            return path, header + b"\0" * 40, headers, 400, None, "bad:binary"
        return path, json.dumps(good).encode(), headers, 400, None, f"bad:{kind}"
    kind = rng.choice(["double", "double_binary", "varlen", "bytes"])
    if kind.startswith("double"):
        rows = rng.randint(1, 8)
        x = np.asarray(
            [[rng.uniform(-100, 100) for _ in range(16)] for _ in range(rows)], dtype=np.float32
        )
        expected = (x * 2).ravel()
        if kind == "double_binary":
            header = json.dumps(
                {
                    "inputs": [
                        {
                            "name": "INPUT0",
                            "shape": [rows, 16],
                            "datatype": "FP32",
                            "parameters": {"binary_data_size": x.nbytes},
                        }
                    ],
                    "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
                }
            ).encode()
            headers = {"inference-header-content-length": str(len(header))}

            def check(response: httpx.Response) -> bool:
                n = int(response.headers["inference-header-content-length"])
                return np.array_equal(np.frombuffer(response.content[n:], "<f4"), expected)

            return ("/v2/models/double_fp32/infer", header + x.tobytes(), headers, 200, check, kind)
        body = {
            "inputs": [
                {
                    "name": "INPUT0",
                    "shape": [rows, 16],
                    "datatype": "FP32",
                    "data": x.ravel().tolist(),
                }
            ]
        }
        return (
            "/v2/models/double_fp32/infer",
            json.dumps(body).encode(),
            {"content-type": "application/json"},
            200,
            lambda r: np.allclose(r.json()["outputs"][0]["data"], expected),
            kind,
        )
    if kind == "varlen":
        width = rng.randint(0, 64)
        x = np.asarray([rng.uniform(-1, 1) for _ in range(width)], dtype=np.float32)
        body = {
            "inputs": [{"name": "X", "shape": [1, width], "datatype": "FP32", "data": x.tolist()}]
        }
        return (
            "/v2/models/varlen_fp32/infer",
            json.dumps(body).encode(),
            {"content-type": "application/json"},
            200,
            lambda r: np.allclose(r.json()["outputs"][0]["data"], x + 1),
            kind,
        )
    text = "".join(rng.choice("abcdé✓ \u0000xyz") for _ in range(rng.randint(0, 60)))
    body = {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [text]}]}

    def check_text(response: httpx.Response) -> bool:
        outputs = {o["name"]: o["data"] for o in response.json()["outputs"]}
        return outputs["TEXT_OUT"] == [text] and outputs["LEN"] == [len(text.encode())]

    return (
        "/v2/models/echo_bytes/infer",
        json.dumps(body).encode(),
        {"content-type": "application/json"},
        200,
        check_text,
        kind,
    )


async def run(args: argparse.Namespace) -> dict:
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpuserve",
            "serve",
            "--model-repository",
            str(REPOSITORY),
            "--host",
            "127.0.0.1",
            "--http-port",
            str(port),
            "--log-level",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(
            base_url=url, timeout=30, limits=httpx.Limits(max_connections=args.concurrency)
        ) as client:
            for _ in range(600):
                try:
                    if (await client.get("/v2/health/ready")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)
            outcomes: collections.Counter[str] = collections.Counter()
            window_latencies: list[float] = []
            windows: list[dict] = []
            start = time.monotonic()
            end = start + args.duration_s

            async def worker(seed: int) -> None:
                rng = random.Random(seed)
                while time.monotonic() < end:
                    path, content, headers, status, check, kind = make_request(rng, args.bad_share)
                    t0 = time.monotonic()
                    try:
                        response = await client.post(path, content=content, headers=headers)
                    except httpx.HTTPError as err:
                        outcomes[f"failure:{kind}:{type(err).__name__}"] += 1
                        continue
                    window_latencies.append(time.monotonic() - t0)
                    if response.status_code != status:
                        outcomes[f"failure:{kind}:status {response.status_code}"] += 1
                    elif check is not None and not check(response):
                        outcomes[f"failure:{kind}:wrong output"] += 1
                    else:
                        outcomes["ok:" + kind] += 1

            async def sampler() -> None:
                while time.monotonic() < end:
                    await asyncio.sleep(args.window_s)
                    lat = sorted(window_latencies)
                    window_latencies.clear()
                    windows.append(
                        {
                            "t_s": round(time.monotonic() - start, 1),
                            "rss_mib": round(rss_bytes(server.pid) / 2**20, 1),
                            "requests": len(lat),
                            "p50_ms": round(lat[len(lat) // 2] * 1000, 2) if lat else None,
                            "p99_ms": round(lat[int(len(lat) * 0.99)] * 1000, 2) if lat else None,
                        }
                    )
                    print(windows[-1], flush=True)

            await asyncio.gather(sampler(), *(worker(i) for i in range(args.concurrency)))
    finally:
        server.send_signal(signal.SIGTERM)
        exit_code = server.wait(60)
    rss = [w["rss_mib"] for w in windows]
    settled = rss[len(rss) // 4 :] or rss
    return {
        "date": dt.date.today().isoformat(),
        "args": vars(args),
        "windows": windows,
        "outcomes": dict(outcomes),
        "failures": {k: v for k, v in outcomes.items() if k.startswith("failure")},
        "rss_first_mib": rss[0] if rss else None,
        "rss_last_mib": rss[-1] if rss else None,
        "rss_growth_after_warmup_mib": (settled[-1] - settled[0]) if settled else None,
        "server_exit_code": exit_code,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration-s", type=float, default=600)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--bad-share", type=float, default=0.1)
    parser.add_argument("--window-s", type=float, default=30)
    args = parser.parse_args()
    report = asyncio.run(run(args))
    out = HERE / "results" / f"soak-{report['date']}"
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    total = sum(report["outcomes"].values())
    lines = [
        f"# soak {report['date']}: {args.duration_s:.0f} s, concurrency {args.concurrency}, "
        f"{args.bad_share:.0%} bad requests",
        "",
        f"requests: {total}; failures (anything but the intended status/output): "
        f"{sum(report['failures'].values())} {report['failures'] or ''}",
        f"resident memory: {report['rss_first_mib']} MiB -> {report['rss_last_mib']} MiB "
        f"(growth after the first quarter: {report['rss_growth_after_warmup_mib']} MiB)",
        f"server exit code after SIGTERM: {report['server_exit_code']}",
        "",
        "| t (s) | RSS MiB | requests | p50 ms | p99 ms |",
        "|---|---|---|---|---|",
        *(
            f"| {w['t_s']} | {w['rss_mib']} | {w['requests']} | {w['p50_ms']} | {w['p99_ms']} |"
            for w in report["windows"]
        ),
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:5]))
    return 0 if not report["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
