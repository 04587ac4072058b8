#!/usr/bin/env python3
"""Text generation side by side: gpuserve serving a small chat model, the same engine in
process (no HTTP: the limit of the serving layer), and peers on the same weights.

Servers (``--servers``, comma-separated, measured in rounds so ratios come from one round):

* ``inprocess``: the generation engine's step loop in this process, on the server's cores,
  fed the same requests at the same concurrency (no HTTP, no event loop hop);
* ``gpuserve``: ``gpuserve serve`` on a repository holding only ``chat`` (the embedded
  SmolLM2-135M-Instruct GGUF, or ``--model-dir``), pinned to the server's cores;
* ``NAME@PRECISION+FORMAT`` (``gpuserve@bf16+int4``, ``inprocess@bf16+int8``): that server
  at its own ``precision`` and ``generate.weight_format``, so formats share a run;
* ``llamacpp`` and ``transformers``: llama.cpp's server (llama-cpp-python) on the GGUF and
  ``transformers serve --continuous-batching`` on the same weights, started by
  ``benchmarks/generate_peers.py`` (set up with ``benchmarks/peers/setup_generate.sh``; a
  peer that is not set up is skipped with the reason). With ``--model-dir X.gguf`` llama.cpp
  serves that file and transformers the folder ``hf/`` beside it
  (``benchmarks/generate_larger_model.py`` writes both for a 360M model).

Workload: prompts of real prose (``benchmarks/corpus.py``, the standard library's
docstrings) of 20 to 2,000 tokens (log-uniform), ``max_tokens`` 32 to 256, greedy, EOS
ignored where the server allows it, streamed from ``/v1/completions``. Closed loop at each
``--levels`` concurrency, then (``--open-loop``) Poisson arrivals at fractions of the
capacity measured at the highest level. Figures per level: output tokens/s, time to first
token p50/p99, inter-token latency p50/p99 (gaps between streamed events holding tokens),
requests finished.

Scenarios (``--scenario``): ``load`` (the above), ``prefix`` (time to first token of a
1,000-token shared system prompt, first request against later hits), ``hol``
(head-of-line: inter-token latency of running streams while 2,000-token prompts keep
arriving, against the same streams alone).

Writes ``results/generate-<tag>-<date>.json`` and ``.md`` (with ``lscpu``'s model name and
flags of note) and PNG plots of tokens/s and p99 latencies against concurrency.

    .venv/bin/python benchmarks/generate.py --quick                    # ~3 min, gpuserve only
    .venv/bin/python benchmarks/generate.py --servers inprocess,gpuserve,llamacpp,transformers
    .venv/bin/python benchmarks/generate.py --scenario prefix,hol --servers gpuserve
    .venv/bin/python benchmarks/generate_larger_model.py  # once: a 360M GGUF and its hf/
    .venv/bin/python benchmarks/generate.py --servers gpuserve,llamacpp,transformers \\
        --model-dir /work/peers-gen/smollm2-360m-random/smollm2-360m-random.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import httpx
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

import corpus  # noqa: E402
from generate_report import RESULTS, cpu_line, log, write_report  # noqa: E402
from generate_workload import (  # noqa: E402
    GGUF,
    build_jobs,
    default_model,
    load_tokenizer,
    request_counts,
)

from gpuserve.bench.generation import (  # noqa: E402
    Forced,
    Job,
    Level,
    Sample,
    closed_loop,
    ignore_eos,
    open_loop,
    stream_one,
    summarise,
)

#: gpuserve's and the in-process engine's KV cache unless --kv-cache-gib says otherwise
KV_CACHE_BYTES = 1 << 30
# the other generation benchmarks read them here
__all__ = ["GGUF", "RESULTS", "build_jobs", "cpu_line", "default_model", "log", "request_counts"]


# -- servers -----------------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def split_format(
    name: str, precision: str, weight_format: str | None
) -> tuple[str, str, str | None]:
    """``gpuserve@bf16+int4`` -> (``gpuserve``, ``bf16``, ``int4``); without ``@`` the
    ``--precision`` and ``--weight-format`` given."""
    server, _, fmt = name.partition("@")
    if not fmt:
        return server, precision, weight_format
    dtype, _, weights = fmt.partition("+")
    return server, dtype, weights or None


def chat_config(
    model: Path,
    precision: str,
    max_running: int,
    weight_format: str | None = None,
    kv_cache_bytes: int = KV_CACHE_BYTES,
) -> str:
    weights = f", weight_format: {weight_format}" if weight_format else ""
    return (
        "backend: huggingface\n"
        f"huggingface: {{task: text-generation, model_dir: '{model}'}}\n"
        "instance_group: [{count: 1, kind: cpu}]\n"
        f"precision: {precision}\n"
        f"generate: {{context_length: 4096, kv_cache_bytes: {kv_cache_bytes}, "
        f"max_running: {max_running}, max_tokens_per_step: 512{weights}}}\n"
    )


@contextlib.contextmanager
def serve(root: Path, cores: str | None, *extra: str) -> Iterator[str]:
    """``gpuserve serve`` of the repository ``root`` on free ports (pinned to ``cores``),
    until the context ends (``root`` is removed then); yields its base URL once ready."""
    port = free_port()
    command = [
        str(Path(sys.executable).parent / "gpuserve"),
        "serve",
        "--model-repository",
        str(root),
        "--http-port",
        str(port),
        "--grpc-port",
        str(free_port()),
        "--metrics-port",
        str(free_port()),
        "--log-level",
        "warning",
        *extra,
    ]
    if cores:
        command = ["taskset", "-c", cores, *command]
    process = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("gpuserve did not start")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(30)
        process.kill()
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def gpuserve_server(
    model: Path,
    precision: str,
    cores: str | None,
    max_running: int,
    weight_format: str | None,
    kv_cache_bytes: int = KV_CACHE_BYTES,
) -> Iterator[str]:
    """gpuserve serving ``model`` as ``chat``; yields its ``/v1`` URL."""
    root = Path(tempfile.mkdtemp(prefix="gen-bench-"))
    (root / "chat" / "1").mkdir(parents=True)
    (root / "chat" / "1" / "README.txt").write_text("weights: huggingface.model_dir\n")
    (root / "chat" / "config.yaml").write_text(
        chat_config(model, precision, max_running, weight_format, kv_cache_bytes)
    )
    with serve(root, cores) as url:
        yield f"{url}/v1"


class InProcess:
    """The engine's own step loop on the same requests (the serving layer's limit)."""

    def __init__(
        self,
        model: Path,
        precision: str,
        max_running: int,
        weight_format: str | None = None,
        kv_cache_bytes: int = KV_CACHE_BYTES,
    ) -> None:
        import torch

        from gpuserve.backends.causal_lm import load_causal_lm
        from gpuserve.backends.causal_lm.backend import GenerationModel

        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
        loaded = load_causal_lm(model, dtype, weight_format=weight_format)
        per_block = loaded.model.cache_bytes_per_block(16)
        blocks = kv_cache_bytes // per_block
        loaded.model.allocate_cache(blocks, 16)
        self.model = GenerationModel(loaded, "cpu", blocks, 16, 4096, loaded.eos_token_ids, None)
        self.max_running = max_running
        self.tokenizer = loaded.tokenizer

    def closed_loop(self, jobs: list[Job], c: int) -> Level:
        from gpuserve.backends.causal_lm.params import SamplingParams
        from gpuserve.config.generate import GenerateConfig
        from gpuserve.engine.generate.engine import DeltaSink, GenerationEngine
        from gpuserve.engine.generate.messages import GenerationDelta, GenerationRequest

        samples: list[Sample] = []
        queue = list(reversed(jobs))
        done = threading.Event()
        lock = threading.Lock()

        class Sink(DeltaSink):
            def __init__(self, job: Job) -> None:
                self.job = job
                self.started = time.perf_counter()
                self.first: float | None = None
                self.last = self.started
                self.gaps: list[float] = []

            def deliver(self, delta: GenerationDelta) -> None:
                now = time.perf_counter()
                if delta.token_ids:
                    if self.first is None:
                        self.first = now
                    else:
                        self.gaps.append(now - self.last)
                    self.last = now
                if delta.finished:
                    samples.append(
                        Sample(
                            (self.first or now) - self.started,
                            self.gaps,
                            delta.completion_tokens,
                            now - self.started,
                        )
                    )
                    submit_next()

        def publish(deltas: list[tuple[DeltaSink, GenerationDelta]]) -> None:
            for sink, delta in deltas:
                sink.deliver(delta)

        # the server's defaults: the same step policy as the served engine
        slowdown = GenerateConfig().decode_slowdown_limit
        engine = GenerationEngine(
            self.model, self.max_running, 512, True, publish, decode_slowdown=slowdown
        )

        def submit_next() -> None:
            with lock:
                if not queue:
                    if len(samples) == len(jobs):
                        done.set()
                    return
                job = queue.pop()
            ids = self.tokenizer.encode(job.prompt)
            params = SamplingParams(max_tokens=job.max_tokens, temperature=0.0, ignore_eos=True)
            engine.submit(GenerationRequest("bench", ids, params), Sink(job))

        thread = threading.Thread(target=engine.run, daemon=True)
        started = time.perf_counter()
        for _ in range(min(c, len(jobs))):
            submit_next()
        thread.start()
        done.wait()
        wall = time.perf_counter() - started
        engine.stop()
        thread.join(30)
        return summarise(f"c={c}", samples, wall)


def inproc_level(inproc: InProcess, jobs: list[Job], c: int, cores: str | None) -> Level:
    """The in-process limit on the servers' cores, with as many torch threads as a server
    pinned there has; the client's affinity back afterwards."""
    if not cores:
        return inproc.closed_loop(jobs, c)
    client, threads = os.sched_getaffinity(0), torch.get_num_threads()
    pinned = {int(x) for x in cores.split(",")}
    os.sched_setaffinity(0, pinned)
    torch.set_num_threads(len(pinned))
    try:
        return inproc.closed_loop(jobs, c)
    finally:
        os.sched_setaffinity(0, client)
        torch.set_num_threads(threads)


# -- scenarios ---------------------------------------------------------------------------------


async def prefix_scenario(
    url: str, model: str, tokenizer: object, hits: int, forced: Forced | None
) -> dict[str, float]:
    """TTFT of a 1,000-token shared system prompt: the first request, then ``hits`` more."""
    texts = corpus.build("chunks").texts
    ids: list[int] = []
    i = 0
    while len(ids) < 1000:
        ids.extend(tokenizer.encode(texts[i] + " "))  # type: ignore[attr-defined]
        i += 1
    system = tokenizer.decode(ids[:1000])  # type: ignore[attr-defined]
    questions = [f"Question {k}: summarise the text above in one line." for k in range(hits + 1)]
    async with httpx.AsyncClient(timeout=600) as client:
        ttfts = []
        for question in questions:
            job = Job(system + "\n" + question, 1000, 8)
            ttfts.append((await stream_one(client, url, model, job, forced)).ttft_s)
    miss, hit = ttfts[0], statistics.median(ttfts[1:])
    return {
        "ttft_miss_ms": round(miss * 1e3, 2),
        "ttft_hit_ms": round(hit * 1e3, 2),
        "ratio": round(miss / hit, 2),
    }


async def hol_scenario(
    url: str, model: str, jobs: list[Job], tokenizer: object, forced: Forced | None
) -> dict[str, float]:
    """p99 inter-token latency of 8 running streams, alone and while 2,000-token prompts keep
    arriving (one always in flight)."""
    background = [Job(j.prompt[:200], 0, 128) for j in jobs[:16]]
    alone = await closed_loop(url, model, background, 8, forced)
    long_prompt = build_jobs(tokenizer, 4, 7, (2000, 2000), (8, 8))

    async def intruders(stop: asyncio.Event) -> None:
        # one long prompt in flight at all times: the next is sent as the last one finishes
        # (an open rate would outrun a CPU's prefill and never drain)
        async with httpx.AsyncClient(timeout=600) as client:
            k = 0
            while not stop.is_set():
                await stream_one(client, url, model, long_prompt[k % 4], forced)
                k += 1

    stop = asyncio.Event()
    task = asyncio.create_task(intruders(stop))
    crowded = await closed_loop(url, model, background, 8, forced)
    stop.set()
    await task
    return {
        "itl_p99_alone_ms": alone.itl_p99_ms,
        "itl_p99_with_long_prompts_ms": crowded.itl_p99_ms,
        "ratio": round(crowded.itl_p99_ms / alone.itl_p99_ms, 2),
    }


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--servers", default="inprocess,gpuserve")
    parser.add_argument("--scenario", default="load", help="load, prefix, hol (comma-separated)")
    parser.add_argument("--levels", default="1,8,32,64")
    parser.add_argument("--open-loop", default="", help="fractions of capacity, e.g. 0.5,0.8,0.95")
    parser.add_argument(
        "--requests",
        default="",
        help="requests at each level: one count for all, or one per --levels entry "
        "(default: 2 x level, >= 8)",
    )
    parser.add_argument("--prompt-tokens", default="20,2000")
    parser.add_argument("--max-tokens", default="32,256")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument(
        "--weight-format",
        default=None,
        choices=("int8", "int4"),
        help="generate.weight_format of gpuserve and inprocess (needs --precision bf16); a "
        "server named NAME@PRECISION+FORMAT (gpuserve@bf16+int4) sets its own",
    )
    parser.add_argument("--max-running", type=int, default=64)
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="GGUF file or HF folder (default: the embedded SmolLM2-135M-Instruct); a GGUF "
        "is llama.cpp's too, and the folder hf/ beside it transformers'",
    )
    parser.add_argument(
        "--kv-cache-gib", type=float, default=1.0, help="gpuserve's and inprocess's KV cache"
    )
    parser.add_argument("--server-cores", default=None, help="taskset list for the servers, e.g. 1")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--tag", default="cpu")
    parser.add_argument(
        "--quick", action="store_true", help="levels 1,8; short prompts and outputs"
    )
    parser.add_argument("--seed", type=int, default=20261206)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.levels, args.prompt_tokens, args.max_tokens = "1,8", "20,400", "16,64"
    model = args.model_dir or default_model()
    kv_cache_bytes = int(args.kv_cache_gib * (1 << 30))
    levels = [int(x) for x in args.levels.split(",") if x]
    counts = request_counts(args.requests, levels)
    servers = [s for s in args.servers.split(",") if s]
    scenarios = set(args.scenario.split(","))
    lengths = tuple(int(x) for x in args.prompt_tokens.split(","))
    outputs = tuple(int(x) for x in args.max_tokens.split(","))
    log(f"loading {model.name} for the tokenizer (and the in-process engine)")
    inprocs: dict[tuple[str, str | None], InProcess] = {}

    def inprocess(precision: str, weight_format: str | None) -> InProcess:
        key = (precision, weight_format)
        if key not in inprocs:
            inprocs[key] = InProcess(
                model, precision, args.max_running, weight_format, kv_cache_bytes
            )
        return inprocs[key]

    if any(split_format(s, "", None)[0] == "inprocess" for s in servers):
        tokenizer = inprocess(args.precision, args.weight_format).tokenizer
    else:  # no engine in this process: only the tokenizer, not the weights and KV cache
        tokenizer = load_tokenizer(model)
    if args.server_cores:
        os.sched_setaffinity(
            0,
            {c for c in range(os.cpu_count() or 1)} - {int(c) for c in args.server_cores.split(",")}
            or {0},
        )
    results: dict[str, object] = {
        "cpu": cpu_line(),
        "command": " ".join(
            [Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]
        ),
        "model": str(model) if args.model_dir else model.name,
        "kv_cache_bytes": kv_cache_bytes,
        "precision": args.precision,
        "weight_format": args.weight_format,
        "workload": f"prompts {lengths[0]}-{lengths[1]} tokens (log-uniform, stdlib prose), "
        f"max_tokens {outputs[0]}-{outputs[1]}, greedy, EOS ignored",
        "load": {},
        "prefix": {},
        "hol": {},
    }
    load: dict[str, list[dict[str, object]]] = {}
    for round_ in range(args.rounds):
        for server in servers:
            log(f"round {round_ + 1}: {server}")
            kind, precision, weight_format = split_format(
                server, args.precision, args.weight_format
            )
            with contextlib.ExitStack() as stack:
                url = model_id = None
                forced: Forced | None = ignore_eos
                if kind == "gpuserve":
                    url = stack.enter_context(
                        gpuserve_server(
                            model,
                            precision,
                            args.server_cores,
                            args.max_running,
                            weight_format,
                            kv_cache_bytes,
                        )
                    )
                    model_id = "chat"
                elif server in ("llamacpp", "transformers"):
                    try:
                        import generate_peers

                        peer = stack.enter_context(
                            generate_peers.start_peer(
                                server, free_port(), args.server_cores, model=args.model_dir
                            )
                        )
                    except Exception as err:  # not set up: skipped, with the reason
                        log(f"  {server} skipped: {err}")
                        results.setdefault("skipped", {})[server] = str(err)  # type: ignore[index]
                        continue
                    url, model_id = peer.base_url, peer.model
                    forced = peer.length_fields
                for c, count in zip(levels, counts, strict=True):
                    jobs = build_jobs(tokenizer, count, args.seed + c, lengths, outputs)  # type: ignore[arg-type]
                    if "load" in scenarios:
                        if kind == "inprocess":
                            inproc = inprocess(precision, weight_format)
                            level = inproc_level(inproc, jobs, c, args.server_cores)
                        else:
                            level = asyncio.run(closed_loop(url, model_id, jobs, c, forced))  # type: ignore[arg-type]
                        log(
                            f"  {server} {level.load}: {level.output_tokens_s} tok/s, "
                            f"TTFT p99 {level.ttft_p99_ms} ms, ITL p99 {level.itl_p99_ms} ms"
                        )
                        load.setdefault(server, []).append(asdict(level))
                if kind != "inprocess" and url is not None:
                    if args.open_loop and "load" in scenarios and load.get(server):
                        capacity = max(
                            lv["finished"] / lv["wall_s"] for lv in load[server] if lv["wall_s"]
                        )  # type: ignore[operator]
                        for fraction in (float(x) for x in args.open_loop.split(",")):
                            jobs = build_jobs(tokenizer, 64, args.seed, lengths, outputs)  # type: ignore[arg-type]
                            level = asyncio.run(
                                open_loop(
                                    url, model_id, jobs, capacity * fraction, forced, args.seed
                                )
                            )  # type: ignore[arg-type]
                            load[server].append(asdict(level))
                    if "prefix" in scenarios:
                        results["prefix"][server] = asyncio.run(
                            prefix_scenario(url, model_id, tokenizer, 5, forced)
                        )  # type: ignore[index, arg-type]
                        log(f"  prefix: {results['prefix'][server]}")  # type: ignore[index]
                    if "hol" in scenarios:
                        jobs = build_jobs(tokenizer, 16, args.seed, (20, 60), (128, 128))  # type: ignore[arg-type]
                        results["hol"][server] = asyncio.run(
                            hol_scenario(url, model_id, jobs, tokenizer, forced)
                        )  # type: ignore[index, arg-type]
                        log(f"  hol: {results['hol'][server]}")  # type: ignore[index]
    results["load"] = load
    if "inprocess" in load and "gpuserve" in load:
        results["ratios"] = {
            f"served/in-process {a['load']}": round(b["output_tokens_s"] / a["output_tokens_s"], 3)  # type: ignore[operator]
            for a, b in zip(load["inprocess"], load["gpuserve"], strict=False)
        }
    report = write_report(args.tag, str(results["command"]), results)
    print(report.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
