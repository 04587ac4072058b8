#!/usr/bin/env python3
"""One stream's decode step, gpuserve's model against llama.cpp, forward passes only.

Each round, on one core (``--core``) and one thread: llama.cpp (llama-cpp-python from the
peers' venv, ``benchmarks/peers/setup_generate.sh``) evaluates a 256-token prompt, then 64
tokens one at a time; then gpuserve's model does the same at each ``--formats`` entry
(``precision`` or ``precision:weight_format``) through ``CausalLM.forward`` on the paged
cache. Reported per engine and round: the prefill time and the median and smallest time of
one decode step (one token, its logits included, no sampling, no HTTP). Rounds interleave
the engines, so a busy machine slows them alike; compare within a round.

    python benchmarks/generate_decode_step.py --rounds 3 --formats fp32,bf16,bf16:int8,bf16:int4

Writes ``results/generate-decode-step-<date>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPT, STEPS = 256, 64

_LLAMA = """
import statistics, sys, time
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_threads=1, n_threads_batch=1, n_ctx=1024, verbose=False)
ids = list(range(1000, 1000 + {prompt}))
s = time.perf_counter(); llm.eval(ids); pre = time.perf_counter() - s
times = []
for i in range({steps}):
    s = time.perf_counter(); llm.eval([42]); times.append(time.perf_counter() - s)
print(f"llamacpp {{pre*1e3:.1f}} {{statistics.median(times)*1e3:.2f}} {{min(times)*1e3:.2f}}")
"""

_OURS = """
import statistics, sys, time, torch
from pathlib import Path
from gpuserve.backends.causal_lm import load_causal_lm
from gpuserve.backends.causal_lm.step import ChunkInput, StepBatch
torch.set_num_threads(1)
dtypes = {{"fp32": torch.float32, "bf16": torch.bfloat16}}
for spec in sys.argv[2].split(","):
    p, _, fmt = spec.partition(":")
    model = load_causal_lm(Path(sys.argv[1]), dtypes[p], load_tokenizer=False,
                           weight_format=fmt or None).model
    model.allocate_cache(32, 16)
    table, ids = list(range(32)), list(range(1000, 1000 + {prompt}))
    s = time.perf_counter()
    model.forward(StepBatch.build([ChunkInput(ids, 0, table, True)], 16))
    pre = time.perf_counter() - s
    times = []
    for i in range({steps}):
        s = time.perf_counter()
        model.forward(StepBatch.build([ChunkInput([42], {prompt} + i, table, True)], 16))
        times.append(time.perf_counter() - s)
    print(f"{{spec}} {{pre*1e3:.1f}} {{statistics.median(times)*1e3:.2f}} {{min(times)*1e3:.2f}}")
"""


def run(command: list[str], core: str) -> list[list[str]]:
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        ["taskset", "-c", core, *command], capture_output=True, text=True, env=env, check=True
    ).stdout
    pattern = re.compile(r"^\S+ [\d.]+ [\d.]+ [\d.]+$")
    return [line.split() for line in out.splitlines() if pattern.match(line)]


def main() -> int:
    sys.path.insert(0, str(HERE))
    from generate import cpu_line, default_model
    from generate_peers import peers_root

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="fp32,bf16,bf16:int8,bf16:int4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--core", default="0")
    args = parser.parse_args()
    model = str(default_model())
    llama_python = peers_root() / "llamacpp" / "bin" / "python"
    rows: list[dict[str, object]] = []
    for round_ in range(1, args.rounds + 1):
        found = []
        if llama_python.exists():
            code = _LLAMA.format(prompt=PROMPT, steps=STEPS)
            found += run([str(llama_python), "-c", code, model], args.core)
        code = _OURS.format(prompt=PROMPT, steps=STEPS)
        found += run([sys.executable, "-c", code, model, args.formats], args.core)
        for name, pre, median, best in found:
            row = {"round": round_, "engine": name, "prefill_ms": float(pre)}
            row |= {"decode_median_ms": float(median), "decode_min_ms": float(best)}
            rows.append(row)
            print(row, flush=True)
    command = "python benchmarks/generate_decode_step.py " + " ".join(sys.argv[1:])
    payload = {"command": command, "cpu": cpu_line(), "rows": rows}
    stem = HERE / "results" / f"generate-decode-step-{datetime.date.today().isoformat()}"
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=2))
    lines = [
        "# One stream's decode step: gpuserve's model and llama.cpp",
        "",
        f"`{command}`",
        "",
        f"CPU: {payload['cpu']}; one thread on core {args.core}; prompt {PROMPT} tokens, "
        f"then {STEPS} decode steps (forward only, logits included).",
        "",
        "| round | engine | prefill 256 ms | decode median ms | decode min ms | "
        "decode tok/s (median) | vs llama.cpp (same round) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        base = next(
            (r for r in rows if r["round"] == row["round"] and r["engine"] == "llamacpp"), None
        )
        ratio = ""
        if base is not None:
            theirs, ours = base["decode_median_ms"], row["decode_median_ms"]
            speedup = float(theirs) / float(ours)  # type: ignore[arg-type]
            ratio = f"{speedup:.2f}x"
        lines.append(
            f"| {row['round']} | {row['engine']} | {row['prefill_ms']:.0f} | "
            f"{row['decode_median_ms']:.1f} | {row['decode_min_ms']:.1f} | "
            f"{1000 / row['decode_median_ms']:.1f} | {ratio} |"  # type: ignore[operator]
        )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(stem.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
