#!/usr/bin/env python3
"""Accuracy of the chat model's serving formats against float32, on the benchmark corpus.

For each ``--formats`` entry (``precision`` or ``precision:weight_format``, e.g. ``bf16``,
``bf16:int8``, ``bf16:int4``): teacher-forced token agreement and perplexity on passages of
the corpus (``benchmarks/corpus.py``, the standard library's docstrings: a set the load-time
gate never reads), by :mod:`gpuserve.backends.causal_lm.accuracy`; then free-running greedy
decoding of ``--generate`` tokens from the first ``--prompts`` passages' openings, against
fp32's and bf16's continuations: the share of generated tokens equal position by position,
and how many tokens matched before the first difference (mean).

    python benchmarks/generate_accuracy.py --formats bf16,bf16:int8,bf16:int4

Writes ``results/generate-accuracy-<date>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

import corpus  # noqa: E402
from generate import cpu_line, default_model  # noqa: E402

from gpuserve.backends.causal_lm import load_causal_lm  # noqa: E402
from gpuserve.backends.causal_lm.accuracy import measure, passages, score  # noqa: E402
from gpuserve.backends.causal_lm.model import CausalLM  # noqa: E402
from gpuserve.backends.causal_lm.step import ChunkInput, StepBatch  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def load(model: Path, spec: str) -> CausalLM:
    precision, _, fmt = spec.partition(":")
    dtype, weight_format = DTYPES[precision], fmt or None
    loaded = load_causal_lm(model, dtype, load_tokenizer=False, weight_format=weight_format)
    return loaded.model


@torch.inference_mode()
def greedy(model: CausalLM, prompt: list[int], count: int) -> list[int]:
    """``count`` greedy tokens after ``prompt``, one decode step each."""
    blocks = -(-(len(prompt) + count) // 16)
    model.allocate_cache(blocks, 16)
    table = list(range(blocks))
    logits = model.forward(StepBatch.build([ChunkInput(prompt, 0, table, True)], 16))
    out = [int(logits[0].argmax())]
    while len(out) < count:
        step = ChunkInput([out[-1]], len(prompt) + len(out) - 1, table, True)
        out.append(int(model.forward(StepBatch.build([step], 16))[0].argmax()))
    return out


def agreement(mine: list[list[int]], theirs: list[list[int]]) -> dict[str, float]:
    same = sum(a == b for x, y in zip(mine, theirs) for a, b in zip(x, y))
    total = sum(len(x) for x in mine)
    prefix = []
    for x, y in zip(mine, theirs):
        n = 0
        while n < len(x) and x[n] == y[n]:
            n += 1
        prefix.append(n)
    return {"same_position": same / total, "matched_prefix_mean": sum(prefix) / len(prefix)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="bf16,bf16:int8,bf16:int4")
    parser.add_argument("--texts", type=int, default=16, help="passages scored")
    parser.add_argument("--length", type=int, default=256, help="tokens per passage")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--generate", type=int, default=64)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_path = args.model_dir or default_model()
    started = time.monotonic()
    loaded = load_causal_lm(model_path, torch.float32, load_tokenizer=True)
    tokenizer, reference = loaded.tokenizer, loaded.model
    texts = corpus.build("chunks").texts
    token_lists = [tokenizer.encode(text + " ", add_special_tokens=False) for text in texts[:400]]
    sequences = passages(token_lists, args.length, args.texts)
    prompts = [seq[: args.prompt_tokens] for seq in sequences[: args.prompts]]
    ref_scores = [score(reference, seq) for seq in sequences]
    outputs = {"fp32": [greedy(reference, p, args.generate) for p in prompts]}
    del reference, loaded
    results: dict[str, object] = {}
    for spec in args.formats.split(","):
        model = load(model_path, spec)
        report = measure(spec.replace(":", "+"), [score(model, s) for s in sequences], ref_scores)
        outputs[spec] = [greedy(model, p, args.generate) for p in prompts]
        row: dict[str, object] = {**report.as_dict(), "weight_mb": model.weight_bytes / 1e6}
        row["greedy_vs_fp32"] = agreement(outputs[spec], outputs["fp32"])
        if "bf16" in outputs and spec != "bf16":
            row["greedy_vs_bf16"] = agreement(outputs[spec], outputs["bf16"])
        results[spec] = row
        print(report.line(), json.dumps(row.get("greedy_vs_fp32")), flush=True)
        del model
    command = "python benchmarks/generate_accuracy.py " + " ".join(sys.argv[1:])
    payload = {
        "command": command,
        "cpu": cpu_line(),
        "model": str(model_path.name),
        "corpus": f"{len(sequences)} passages of {args.length} tokens "
        "(benchmarks/corpus.py chunks)",
        "greedy": f"{len(prompts)} prompts of {args.prompt_tokens} tokens, {args.generate} tokens",
        "seconds": round(time.monotonic() - started, 1),
        "results": results,
    }
    stem = HERE / "results" / f"generate-accuracy-{datetime.date.today().isoformat()}"
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=2))
    lines = [
        "# Generation accuracy against fp32",
        "",
        f"`{command}`",
        "",
        f"CPU: {payload['cpu']}",
        "",
        f"Teacher-forced on {payload['corpus']}; free-running greedy: {payload['greedy']}.",
        "",
        "| format | weights MB | token agreement | perplexity | fp32 perplexity | ratio | "
        "greedy same-position vs fp32 | matched prefix vs fp32 | same-position vs bf16 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for spec, row in results.items():
        assert isinstance(row, dict)
        vs32, vs16 = row["greedy_vs_fp32"], row.get("greedy_vs_bf16")
        lines.append(
            f"| {spec} | {row['weight_mb']:.0f} | {row['token_agreement']:.4f} | "
            f"{row['perplexity']:.3f} | {row['reference_perplexity']:.3f} | "
            f"{row['perplexity_ratio']:.4f} | {vs32['same_position']:.3f} | "
            f"{vs32['matched_prefix_mean']:.1f} | "
            f"{'' if vs16 is None else format(vs16['same_position'], '.3f')} |"
        )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(stem.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
