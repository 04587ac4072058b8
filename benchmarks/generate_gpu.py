#!/usr/bin/env python3
"""Generation on a GPU: the engine's step loop in-process, CUDA graphs off and on, and vLLM
beside it when it is installed.

Model: a Llama-family folder with random weights written here with safetensors (nothing is
downloaded; the GPU machine has no registry): ``--shape smollm2-135m`` (SmolLM2-135M's
shape: 30 layers, hidden 576, 9 heads / 3 KV heads) or ``qwen-0.5b`` (24 layers, hidden 896,
14 / 2 heads, vocabulary 151,936, as a Llama). Prompts are random token ids of 20 to 2,000
tokens (log-uniform), ``max_tokens`` 32 to 256, EOS ignored, greedy.

Per variant (``eager``: every step eager; ``graphs``: decode steps replayed from CUDA graphs,
one per batch-size bucket; FlashAttention's paged kernels where ``flash_attn`` is installed,
with ``bf16``/``fp16`` and blocks of 256, else SDPA) and concurrency (closed loop,
``--levels``): output tokens/s, time to first token p50/p99 and inter-token latency
p50/p99, as the engine's deltas arrive. Then the step time of decode-only batches of 1, 8,
32 and 64 sequences at a 512-token context, eager against graphs. With ``vllm`` importable, its offline engine on the same folder and prompts
(token ids, no tokenizer) gives the peer's output tokens/s at the highest level.

Writes results/generate-gpu-<date>.md and .json. On a CPU (``--device cpu --quick``) the
graph variant is skipped with its reason: the run checks the script, not the GPU.

    python benchmarks/generate_gpu.py                       # cuda:0, about 3 minutes
    python benchmarks/generate_gpu.py --device cpu --quick  # smoke run
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from gpuserve.backends.causal_lm import load_causal_lm  # noqa: E402
from gpuserve.backends.causal_lm.backend import GenerationModel, decode_graphs  # noqa: E402
from gpuserve.backends.causal_lm.params import SamplingParams  # noqa: E402
from gpuserve.backends.causal_lm.step import ChunkInput, StepBatch  # noqa: E402
from gpuserve.config.generate import GenerateConfig  # noqa: E402
from gpuserve.engine.generate.engine import DeltaSink, GenerationEngine  # noqa: E402
from gpuserve.engine.generate.messages import GenerationDelta, GenerationRequest  # noqa: E402

SHAPES = {
    "smollm2-135m": dict(hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536, vocab=49152),
    "qwen-0.5b": dict(hidden=896, layers=24, heads=14, kv_heads=2, ffn=4864, vocab=151936),
}
CONTEXT = 4096


def write_llama(folder: Path, shape: dict[str, int]) -> Path:
    """A Llama folder of ``shape`` with random weights (std 0.02), written with safetensors."""
    from safetensors.torch import save_file

    hidden, heads, kv, ffn, vocab = (
        shape[k] for k in ("hidden", "heads", "kv_heads", "ffn", "vocab")
    )
    head = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": shape["layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
        "max_position_embeddings": CONTEXT,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "eos_token_id": 2,
        "bos_token_id": 1,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)

    def rand(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen) * 0.02).to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": rand(vocab, hidden),
        "model.norm.weight": torch.ones(hidden),
    }
    for i in range(shape["layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(heads * head, hidden),
            p + "self_attn.k_proj.weight": rand(kv * head, hidden),
            p + "self_attn.v_proj.weight": rand(kv * head, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head),
            p + "mlp.gate_proj.weight": rand(ffn, hidden),
            p + "mlp.up_proj.weight": rand(ffn, hidden),
            p + "mlp.down_proj.weight": rand(hidden, ffn),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


class IdsAsText:
    """The benchmark's tokenizer (the folder has none, the GPU machine no ``tokenizers``):
    decodes ids to their decimal text, so the engine's incremental detokenisation runs at
    about the cost of a small BPE vocabulary's ``decode`` without one."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f" {i}" for i in ids)


@dataclass(slots=True)
class Job:
    prompt: list[int]
    max_tokens: int


def build_jobs(count: int, vocab: int, seed: int, quick: bool) -> list[Job]:
    rng = random.Random(seed)
    low, high = (20, 200) if quick else (20, 2000)
    outputs = (8, 32) if quick else (32, 256)
    jobs = []
    for _ in range(count):
        length = int(math.exp(rng.uniform(math.log(low), math.log(high))))
        jobs.append(Job([rng.randrange(3, vocab) for _ in range(length)], rng.randint(*outputs)))
    return jobs


def load_model(folder: Path, device: str, dtype: torch.dtype, graphs: bool, max_running: int):
    """The GenerationModel a server would build (block size 256 where graphs are wanted)."""
    settings = GenerateConfig(
        block_size=256 if device.startswith("cuda") else 16, max_running=max_running
    )
    loaded = load_causal_lm(folder, dtype, device, load_tokenizer=False)
    loaded.tokenizer = IdsAsText()
    per_block = loaded.model.cache_bytes_per_block(settings.block_size)
    blocks = max(
        2 * -(-CONTEXT // settings.block_size), (max_running * CONTEXT) // settings.block_size
    )
    cap = (4 << 30) if device.startswith("cuda") else (512 << 20)  # bytes of KV cache
    blocks = min(blocks, cap // per_block)
    loaded.model.allocate_cache(blocks + 1 if graphs else blocks, settings.block_size)
    recorded = decode_graphs(loaded.model, settings, blocks, CONTEXT) if graphs else None
    model = GenerationModel(
        loaded, device, blocks, settings.block_size, CONTEXT, (2,), None, graphs=recorded
    )
    return model, None


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3 if ordered else float("nan")


def closed_loop(
    model: GenerationModel, jobs: list[Job], c: int, max_running: int
) -> dict[str, float]:
    """The engine's step loop over ``jobs`` with ``c`` in flight; figures in ms and tok/s."""
    queue = list(reversed(jobs))
    ttft: list[float] = []
    gaps: list[float] = []
    tokens = [0]
    done = threading.Event()
    lock = threading.Lock()
    finished = [0]

    class Sink(DeltaSink):
        def __init__(self) -> None:
            self.started = time.perf_counter()
            self.last: float | None = None

        def deliver(self, delta: GenerationDelta) -> None:
            now = time.perf_counter()
            if delta.token_ids:
                (
                    ttft.append(now - self.started)
                    if self.last is None
                    else gaps.append(now - self.last)
                )
                self.last = now
            if delta.finished:
                tokens[0] += delta.completion_tokens
                finished[0] += 1
                submit()

    def publish(deltas: list[tuple[DeltaSink, GenerationDelta]]) -> None:
        for sink, delta in deltas:
            sink.deliver(delta)

    engine = GenerationEngine(model, max_running, 2048, True, publish)

    def submit() -> None:
        with lock:
            if not queue:
                if finished[0] == len(jobs):
                    done.set()
                return
            job = queue.pop()
        params = SamplingParams(max_tokens=job.max_tokens, temperature=0.0, ignore_eos=True)
        engine.submit(GenerationRequest("bench", job.prompt, params), Sink())

    thread = threading.Thread(target=engine.run, daemon=True)
    started = time.perf_counter()
    for _ in range(min(c, len(jobs))):
        submit()
    thread.start()
    done.wait()
    wall = time.perf_counter() - started
    engine.stop()
    thread.join(30)
    return {
        "c": c,
        "output_tokens_s": round(tokens[0] / wall, 1),
        "ttft_p50_ms": round(pct(ttft, 0.5), 2),
        "ttft_p99_ms": round(pct(ttft, 0.99), 2),
        "itl_p50_ms": round(pct(gaps, 0.5), 3),
        "itl_p99_ms": round(pct(gaps, 0.99), 3),
    }


def decode_step_ms(model: GenerationModel, batch: int, context: int, repeats: int) -> float:
    """Mean time of one decode-only step of ``batch`` sequences at ``context`` tokens."""
    size = model.block_size
    per_seq = -(-(context + 1) // size)
    chunks = [
        ChunkInput([5], context, list(range(i * per_seq, (i + 1) * per_seq)), True)
        for i in range(batch)
    ]
    if batch * per_seq > model.num_blocks:
        return float("nan")
    step = StepBatch.build(chunks, size, model.device)
    for _ in range(3):
        model.forward(step)
    sync = torch.cuda.synchronize if model.device.startswith("cuda") else (lambda: None)
    sync()
    started = time.perf_counter()
    for _ in range(repeats):
        model.forward(step)
    sync()
    return round((time.perf_counter() - started) / repeats * 1e3, 3)


def vllm_peer(folder: Path, jobs: list[Job], dtype: str) -> dict[str, object]:
    try:
        from vllm import LLM  # type: ignore[import-not-found]
        from vllm import SamplingParams as VllmParams
        from vllm.inputs import TokensPrompt  # type: ignore[import-not-found]
    except ImportError as err:
        return {"skipped": f"vllm not importable ({err})"}
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype=dtype, max_model_len=CONTEXT)
    prompts = [TokensPrompt(prompt_token_ids=job.prompt) for job in jobs]
    params = [
        VllmParams(max_tokens=job.max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        for job in jobs
    ]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - started
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"output_tokens_s": round(generated / wall, 1), "requests": len(jobs)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--levels", default="1,8,32,64")
    parser.add_argument("--max-running", type=int, default=64)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.precision]
    levels = [int(x) for x in args.levels.split(",")]
    if args.quick:
        levels = [lv for lv in levels if lv <= 8] or [1]
    shape = SHAPES[args.shape]
    results: dict[str, object] = {
        "device": args.device,
        "shape": args.shape,
        "precision": args.precision,
    }
    if args.device.startswith("cuda"):
        results["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_llama(Path(tmp) / "model", shape)
        for variant in ("eager", "graphs"):
            if variant == "graphs" and not args.device.startswith("cuda"):
                results[variant] = {"skipped": "CUDA graphs need a CUDA device"}
                continue
            model, why = load_model(
                folder, args.device, dtype, variant == "graphs", args.max_running
            )
            if model is None:
                results[variant] = {"skipped": why}
                continue
            rows = []
            for c in levels:
                jobs = build_jobs(
                    max(8, 2 * c) if not args.quick else max(4, c), shape["vocab"], c, args.quick
                )
                rows.append(closed_loop(model, jobs, c, args.max_running))
                print(variant, rows[-1], flush=True)
            steps = {
                b: decode_step_ms(model, b, 512, 5 if args.quick else 50) for b in (1, 8, 32, 64)
            }
            attention = model.loaded.model.attention_name
            results[variant] = {
                "levels": rows,
                "decode_step_ms_at_512": steps,
                "attention": attention,
            }
            print(variant, "decode step ms", steps, flush=True)
            del model
        if not args.quick:
            jobs = build_jobs(2 * levels[-1], shape["vocab"], levels[-1], False)
            results["vllm"] = vllm_peer(
                folder, jobs, args.precision.replace("bf16", "bfloat16").replace("fp16", "float16")
            )
    stem = args.out_dir / f"generate-gpu-{dt.date.today().isoformat()}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2))
    lines = [
        f"# Generation on {results.get('gpu', args.device)}",
        "",
        "    python " + " ".join(["benchmarks/generate_gpu.py", *(argv or sys.argv[1:])]),
        "",
    ]
    for variant in ("eager", "graphs"):
        data = results[variant]
        if "skipped" in data:  # type: ignore[operator]
            lines.append(f"{variant}: skipped ({data['skipped']})\n")  # type: ignore[index]
            continue
        lines += [
            f"## {variant}",
            "",
            "| c | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |",
            "|---|---|---|---|---|---|",
        ]
        for row in data["levels"]:  # type: ignore[index]
            cells = [row[k] for k in ("c", "output_tokens_s", "ttft_p50_ms", "ttft_p99_ms")]
            cells += [row["itl_p50_ms"], row["itl_p99_ms"]]
            lines.append("| " + " | ".join(str(x) for x in cells) + " |")
        lines += [
            "",
            f"decode step ms at a 512-token context, by batch: {data['decode_step_ms_at_512']}",
            "",
        ]  # type: ignore[index]
    if "vllm" in results:
        lines.append(f"vLLM: {results['vllm']}")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
