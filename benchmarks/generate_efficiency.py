#!/usr/bin/env python3
"""Generation efficiency: the engine's decode and prefill against what one core can do.

Measured on one core (``--core``; the process is pinned there with one torch thread):

* the core's memory bandwidth: ``sum`` over a 2 GiB array (read) and a copy of a 1 GiB
  array into another (read + write), arrays much larger than the last-level cache; best of
  ``--repeats``;
* the core's matmul peak for fp32 and bf16: ``torch.mm`` of square ``--mm-size`` matrices
  (oneDNN: AMX / AVX-512 BF16 for bf16 where the CPU has them), best of ``--repeats``;
* the generation engine in process (no HTTP, as ``benchmarks/generate.py``'s ``inprocess``)
  on the chat model (SmolLM2-135M-Instruct GGUF, or ``--model-dir``) at ``--precision``:
  the decode step at batch 1 and 32 (short prose prompts, every sequence decoding; median
  of the model's forward time and of the engine's whole step, start to start), and the
  prefill of a ``--prefill-tokens`` prose prompt (sum of its chunks' forward times).

Figures: weight bytes read per decode step (the loaded model's weight tensors, in whatever
format it serves them, the tied embedding once) and the KV bytes the step reads; the bound
memory bandwidth sets (weight bytes / read bandwidth) against the measured step: efficiency
= bound / measured; with many sequences the step's FLOPs / the matmul peak can bound it
instead (the roofline efficiency takes the larger bound). Prefill FLOPs (2 x linear
parameters x tokens + attention's 2 x layers x heads x head_dim x tokens^2 + the one logits
row) / time, against the matmul peak of the serving dtype.

Writes ``results/generate-efficiency-<tag>-<date>.json`` and ``.md`` with the command and
``lscpu``'s model name. The machine's other load counts: run it on a quiet core.

    .venv/bin/python benchmarks/generate_efficiency.py --core 1 --precision fp32
    .venv/bin/python benchmarks/generate_efficiency.py --core 1 --precision bf16 --tag bf16
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

import corpus  # noqa: E402
import generate as gen  # noqa: E402  (default_model, cpu_line, log, RESULTS)

from gpuserve.backends.causal_lm.architectures import ModelSpec  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# -- the core ----------------------------------------------------------------------------------


def best_of(repeats: int, work) -> float:  # type: ignore[no-untyped-def]
    """Shortest on-core time (this thread's CPU time: torch runs one thread, here) of
    ``repeats`` calls of ``work`` after one untimed, seconds. On-core time leaves out the
    time other processes held the core; their share of the memory bus stays in."""
    work()
    times = []
    for _ in range(repeats):
        started = time.thread_time()
        work()
        times.append(time.thread_time() - started)
    return min(times)


def read_gb_s(repeats: int) -> float:
    """GB/s (10^9 bytes) of ``sum`` over a 2 GiB float32 array."""
    big = torch.ones(2 << 30 >> 2, dtype=torch.float32)
    return big.numel() * 4 / best_of(repeats, lambda: big.sum()) / 1e9


def copy_gb_s(repeats: int) -> float:
    """GB/s (10^9 bytes read + written) of copying a 1 GiB float32 array into another."""
    src = torch.ones(1 << 30 >> 2, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / best_of(repeats, lambda: dst.copy_(src)) / 1e9


def bandwidth(repeats: int) -> dict[str, float]:
    """Read and copy bandwidth of this core, GB/s."""
    return {"read_gb_s": round(read_gb_s(repeats), 2), "copy_gb_s": round(copy_gb_s(repeats), 2)}


def matmul_peak(dtype: torch.dtype, size: int, repeats: int) -> float:
    """GFLOP/s of ``torch.mm`` of two ``size`` x ``size`` matrices of ``dtype``."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    out = torch.empty(size, size, dtype=dtype)
    seconds = best_of(repeats, lambda: torch.mm(a, b, out=out))
    return round(2 * size**3 / seconds / 1e9, 1)


# -- the engine --------------------------------------------------------------------------------


class Engine:
    """The generation engine in this thread's process, with each model forward timed."""

    def __init__(self, model_path: Path, dtype: torch.dtype, max_tokens_per_step: int) -> None:
        from gpuserve.backends.causal_lm import load_causal_lm
        from gpuserve.backends.causal_lm.backend import GenerationModel

        self.loaded = load_causal_lm(model_path, dtype)
        causal = self.loaded.model
        per_block = causal.cache_bytes_per_block(16)
        self.num_blocks = (1 << 30) // per_block
        self.per_token_kv_bytes = per_block // 16
        causal.allocate_cache(self.num_blocks, 16)
        self.model = GenerationModel(
            self.loaded, "cpu", self.num_blocks, 16, 4096, self.loaded.eos_token_ids, None
        )
        self.max_tokens_per_step = max_tokens_per_step
        #: Per forward: (start, end, tokens, chunks); start and end are the engine thread's
        #: CPU time (on-core seconds: torch runs in that thread), and wall time in ``walls``.
        self.forwards: list[tuple[float, float, int, int]] = []
        self.walls: list[float] = []
        inner = causal.forward

        def timed(batch):  # type: ignore[no-untyped-def]
            started, wall = time.thread_time(), time.perf_counter()
            logits = inner(batch)
            self.forwards.append(
                (started, time.thread_time(), int(batch.token_ids.numel()), len(batch.query_lens))
            )
            self.walls.append(time.perf_counter() - wall)
            return logits

        causal.forward = timed  # type: ignore[method-assign]

    def run(self, prompts: list[list[int]], max_tokens: int) -> list[tuple[float, float, int, int]]:
        """Generate ``max_tokens`` for every prompt at once (greedy, EOS ignored, no prefix
        cache); returns the forwards of the run."""
        from gpuserve.backends.causal_lm.params import SamplingParams
        from gpuserve.engine.generate.engine import DeltaSink, GenerationEngine
        from gpuserve.engine.generate.messages import GenerationDelta, GenerationRequest

        done = threading.Event()
        left = [len(prompts)]

        class Sink(DeltaSink):
            def deliver(self, delta: GenerationDelta) -> None:
                if delta.finished:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

        def publish(deltas: list[tuple[DeltaSink, GenerationDelta]]) -> None:
            for sink, delta in deltas:
                sink.deliver(delta)

        engine = GenerationEngine(
            self.model, max(32, len(prompts)), self.max_tokens_per_step, False, publish
        )
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for ids in prompts:
            engine.submit(GenerationRequest("efficiency", ids, params), Sink())
        self.forwards, self.walls = [], []
        thread = threading.Thread(target=engine.run, daemon=True)
        thread.start()
        done.wait()
        engine.stop()
        thread.join(30)
        return self.forwards


def prose_ids(tokenizer: object, count: int, tokens: int, offset: int) -> list[list[int]]:
    """``count`` distinct prompts of exactly ``tokens`` tokens of corpus prose."""
    texts = corpus.build("chunks").texts
    out = []
    for k in range(count):
        ids: list[int] = []
        i = offset + k * 7
        while len(ids) < tokens:
            ids.extend(tokenizer.encode(texts[i % len(texts)] + " "))  # type: ignore[attr-defined]
            i += 1
        out.append(ids[:tokens])
    return out


def decode_figures(
    engine: Engine, batch: int, prompt_tokens: int, max_tokens: int, offset: int
) -> dict[str, float]:
    """Median forward and step times of the steps where all ``batch`` sequences decode."""
    prompts = prose_ids(engine.loaded.tokenizer, batch, prompt_tokens, offset)
    forwards = engine.run(prompts, max_tokens)
    decode = [i for i, f in enumerate(forwards) if f[2] == batch and f[3] == batch]
    decode = decode[1:-1]  # not the first (warm) and not the last (sequences ending)
    forward_ms = statistics.median((forwards[i][1] - forwards[i][0]) * 1e3 for i in decode)
    step_ms = statistics.median(
        (forwards[i + 1][0] - forwards[i][0]) * 1e3 for i in decode if i + 1 < len(forwards)
    )
    wall_ms = statistics.median(engine.walls[i] * 1e3 for i in decode)
    mean_context = prompt_tokens + max_tokens / 2
    return {
        "batch": batch,
        "decode_steps": len(decode),
        "forward_ms": round(forward_ms, 2),
        "forward_wall_ms": round(wall_ms, 2),
        "step_ms": round(step_ms, 2),
        "kv_bytes_read_mean": int(batch * mean_context * engine.per_token_kv_bytes),
        "tokens_s": round(batch / step_ms * 1e3, 1),
    }


def prefill_figures(engine: Engine, tokens: int, repeats: int) -> dict[str, float]:
    """Best of ``repeats`` prefills of a ``tokens``-token prompt (each a distinct prompt)."""
    best = wall = float("inf")
    chunks = 0
    for k in range(repeats + 1):  # the first warms up
        forwards = engine.run(prose_ids(engine.loaded.tokenizer, 1, tokens, 1000 + 50 * k), 1)
        prefill = [f for f in forwards if f[2] > 1]
        seconds = sum(f[1] - f[0] for f in prefill)
        walls = sum(w for w, f in zip(engine.walls, forwards, strict=True) if f[2] > 1)
        if k:
            best, chunks, wall = min(best, seconds), len(prefill), min(wall, walls)
    return {
        "tokens": tokens,
        "chunks": chunks,
        "seconds": round(best, 4),
        "wall_s": round(wall, 4),
    }


def layer_flops_per_token(spec: ModelSpec) -> float:
    """FLOPs of every decoder layer's projections on one token (2 x their parameters)."""
    hidden, heads, kv, hd = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    mlp = (3 if spec.mlp == "swiglu" else 2) * hidden * spec.intermediate_size
    return 2.0 * spec.num_layers * (hidden * (heads + 2 * kv) * hd + heads * hd * hidden + mlp)


def prefill_flops(spec: ModelSpec, vocab: int, tokens: int) -> tuple[float, float]:
    """(linear FLOPs, attention FLOPs) of prefilling ``tokens`` tokens, causal: every
    projection on every token, scores and weighted sums over the keys before each query, and
    the logits of the last token only."""
    linear = layer_flops_per_token(spec) * tokens + 2.0 * spec.hidden_size * vocab
    attention = 2.0 * spec.num_layers * spec.num_heads * spec.head_dim * tokens**2
    return linear, attention


def decode_flops(spec: ModelSpec, vocab: int, batch: int, context: float) -> float:
    """FLOPs of one decode step of ``batch`` sequences of ``context`` tokens: projections,
    attention over the context, and a logits row each."""
    attention = 4.0 * spec.num_layers * spec.num_heads * spec.head_dim * context
    return batch * (layer_flops_per_token(spec) + 2.0 * spec.hidden_size * vocab + attention)


# -- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--core", type=int, default=1, help="the one core measured")
    parser.add_argument("--precision", default="fp32", choices=tuple(DTYPES))
    parser.add_argument("--model-dir", type=Path, default=None, help="GGUF file or HF folder")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--decode-prompt-tokens", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=48)
    parser.add_argument("--prefill-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens-per-step", type=int, default=1024)
    parser.add_argument("--mm-size", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tag", default="cpu")
    args = parser.parse_args(argv)
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    model_path = args.model_dir or gen.default_model()
    dtype = DTYPES[args.precision]

    gen.log(f"bandwidth and matmul peaks on core {args.core}")
    bw = bandwidth(args.repeats)
    peaks = {name: matmul_peak(d, args.mm_size, args.repeats) for name, d in DTYPES.items()}
    gen.log(f"  {bw}, mm GFLOP/s {peaks}")

    gen.log(f"engine: {model_path.name} at {args.precision}")
    engine = Engine(model_path, dtype, args.max_tokens_per_step)
    causal = engine.loaded.model
    weight_bytes = causal.weight_bytes
    read_bytes_s = bw["read_gb_s"] * 1e9
    decode = []
    for k, batch in enumerate(int(b) for b in args.batches.split(",")):
        row = decode_figures(engine, batch, args.decode_prompt_tokens, args.decode_tokens, 10 * k)
        bound_ms = weight_bytes / read_bytes_s * 1e3
        bound_kv_ms = (weight_bytes + row["kv_bytes_read_mean"]) / read_bytes_s * 1e3
        context = args.decode_prompt_tokens + args.decode_tokens / 2
        flops = decode_flops(causal.spec, causal.info.vocab_size, batch, context)
        compute_ms = flops / (peaks[args.precision] * 1e9) * 1e3
        row |= {
            "bound_weights_ms": round(bound_ms, 2),
            "bound_weights_kv_ms": round(bound_kv_ms, 2),
            "bound_compute_ms": round(compute_ms, 2),
            "efficiency_roofline": round(max(bound_kv_ms, compute_ms) / row["forward_ms"], 3),
            "efficiency_forward": round(bound_ms / row["forward_ms"], 3),
            "efficiency_step": round(bound_ms / row["step_ms"], 3),
        }
        gen.log(f"  decode {row}")
        decode.append(row)
    prefill = prefill_figures(engine, args.prefill_tokens, max(2, args.repeats // 2))
    linear, attention = prefill_flops(causal.spec, causal.info.vocab_size, args.prefill_tokens)
    achieved = (linear + attention) / prefill["seconds"] / 1e9
    prefill |= {
        "tokens_s": round(args.prefill_tokens / prefill["seconds"], 1),
        "gflop": round((linear + attention) / 1e9, 1),
        "attention_share": round(attention / (linear + attention), 3),
        "gflop_s": round(achieved, 1),
        "peak_gflop_s": peaks[args.precision],
        "efficiency": round(achieved / peaks[args.precision], 3),
    }
    gen.log(f"  prefill {prefill}")
    results = {
        "command": " ".join(
            [Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]
        ),
        "cpu": gen.cpu_line(),
        "core": args.core,
        "torch": torch.__version__,
        "model": model_path.name,
        "precision": args.precision,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": engine.per_token_kv_bytes,
        "bandwidth": bw,
        "matmul_peak_gflop_s": peaks,
        "decode": decode,
        "prefill": prefill,
    }
    report = write_report(args.tag, results)
    print(report.read_text())
    return 0


def write_report(tag: str, r: dict) -> Path:
    gen.RESULTS.mkdir(exist_ok=True)
    stem = gen.RESULTS / f"generate-efficiency-{tag}-{datetime.date.today().isoformat()}"
    stem.with_suffix(".json").write_text(json.dumps(r, indent=2))
    bw, p = r["bandwidth"], r["prefill"]
    lines = [
        f"# Generation efficiency ({tag})",
        "",
        f"`{r['command']}`",
        "",
        f"CPU: {r['cpu']}; one core (core {r['core']}), one torch thread; torch {r['torch']}. "
        "Times are on-core (the measuring thread's CPU time), best or median; the forward's "
        "wall time is in the table too (other processes shared the machine).",
        "",
        f"Model: {r['model']} at {r['precision']}: {r['weight_bytes'] / 1e6:.1f} MB of weights "
        f"read per decode step; KV {r['kv_bytes_per_token']} bytes per token.",
        "",
        f"Core: read {bw['read_gb_s']} GB/s, copy {bw['copy_gb_s']} GB/s; torch.mm peak "
        + ", ".join(f"{k} {v} GFLOP/s" for k, v in r["matmul_peak_gflop_s"].items()),
        "",
        "| decode batch | forward ms | forward wall ms | step ms | bound (weights / read bw) "
        "ms | bound with KV ms | efficiency (forward) | efficiency (step) | tokens/s (step) "
        "| compute bound (FLOPs / peak) ms | roofline efficiency (forward) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {d['batch']} | {d['forward_ms']} | {d['forward_wall_ms']} | {d['step_ms']} | "
            f"{d['bound_weights_ms']} | "
            f"{d['bound_weights_kv_ms']} | {d['efficiency_forward']} | {d['efficiency_step']} "
            f"| {d['tokens_s']} | {d['bound_compute_ms']} | {d['efficiency_roofline']} |"
            for d in r["decode"]
        ),
        "",
        f"Prefill of {p['tokens']} tokens ({p['chunks']} chunk(s)): {p['seconds']} s on core "
        f"({p['wall_s']} s wall), "
        f"{p['tokens_s']} tokens/s, {p['gflop']} GFLOP (attention {p['attention_share']:.1%}) "
        f"= {p['gflop_s']} GFLOP/s against the {r['precision']} peak {p['peak_gflop_s']}: "
        f"efficiency {p['efficiency']}.",
        "",
    ]
    stem.with_suffix(".md").write_text("\n".join(lines))
    return stem.with_suffix(".md")


if __name__ == "__main__":
    raise SystemExit(main())
