#!/usr/bin/env python3
"""(a) of the mixed-length benchmark: the in-process limit of the served model on the same
texts (no HTTP, no server). Started by mixed_length.py pinned to the server's CPU with the
server's torch threads; prints one JSON object per mode on stdout.

Modes (texts/s and real tokens/s, tokenisation included, as a server must do it):

* ``batch1``: one text at a time, in corpus order.
* ``sortedB``: the whole corpus sorted by token count, cut into batches of B (so each batch
  holds texts of nearly one length and little padding), the batches run in a seeded random
  order. This is what a length-aware batcher can reach at best.
* ``randomB``: batches of B consecutive texts of the (shuffled) corpus: padding to the longest
  of B random lengths, what arrival-order batching gets.

With ``--execution onnxruntime`` the same modes run on ONNX Runtime (gpuserve.models.bert_onnx:
padded batches), the execution ``text_embedding`` picks on a CPU when onnxruntime is installed.

    python benchmarks/mixed_length_inprocess.py --texts FILE --seconds 5 --modes batch1,sorted8
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

MODES = ("batch1", "sorted8", "sorted32", "random8", "random32")


def batches(mode: str, texts: list[str], lengths: list[int]) -> list[list[int]]:
    """Index batches of one mode (see the module docstring)."""
    if mode == "batch1":
        return [[i] for i in range(len(texts))]
    kind = "sorted" if mode.startswith("sorted") else "random" if mode.startswith("random") else ""
    size_text = mode.removeprefix(kind)
    if not kind or not size_text.isdigit() or int(size_text) < 1:
        raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)} (any batch size)")
    size = int(size_text)
    order = list(range(len(texts)))
    if kind == "sorted":
        order.sort(key=lambda i: lengths[i])
        groups = [order[i : i + size] for i in range(0, len(order), size)]
        random.Random(size).shuffle(groups)
        return groups
    return [order[i : i + size] for i in range(0, len(order), size)]


def measure(
    embedder, texts: list[str], lengths: list[int], mode: str, seconds: float, warmup_s: float = 0.0
) -> dict:
    """Run ``mode``'s batches in a loop for about ``seconds``; texts/s and tokens/s.

    The warm-up runs the plan's first batches (at least two, for ``warmup_s`` seconds) and
    the measurement goes on from there, as a served point's closed loop does (its warm-up
    sends the corpus's first texts, its windows the next ones): batch 1 here and a served
    c=1 point then measure the same texts. (With a two-batch warm-up and the measurement
    starting over at the first text, the chunk mix's batch1 measured 187 tokens per text
    and the served c=1 point, 2 s further on, 197: 5% more work per request, which read as
    server overhead; results/mixed-length-issue20-final-2026-12-01.md.)
    """
    plan = batches(mode, texts, lengths)
    k = 0
    warm_start = time.perf_counter()
    while k < 2 or time.perf_counter() - warm_start < warmup_s:
        # allocator and kernels for these shapes
        embedder.encode([texts[i] for i in plan[k % len(plan)]])
        k += 1
    done_texts = done_tokens = padded = 0
    batch_s: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or not batch_s:
        group = plan[k % len(plan)]
        k += 1
        t0 = time.perf_counter()
        embedder.encode([texts[i] for i in group])
        batch_s.append(time.perf_counter() - t0)
        done_texts += len(group)
        real = [lengths[i] for i in group]
        done_tokens += sum(real)
        padded += max(real) * len(group)
    wall = time.perf_counter() - start
    batch_s.sort()
    return {
        "mode": mode,
        "texts_per_s": done_texts / wall,
        "tokens_per_s": done_tokens / wall,
        "padding_ratio": padded / max(1, done_tokens),
        "batches": len(batch_s),
        "batch_ms_p50": 1e3 * batch_s[len(batch_s) // 2],
        "seconds": wall,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", type=Path, required=True, help="one text per line")
    ap.add_argument("--seconds", type=float, default=5.0, help="per mode")
    ap.add_argument(
        "--warmup", type=float, default=0.0, help="warm-up seconds per mode (its texts go first)"
    )
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument(
        "--execution",
        choices=("torch", "onnxruntime"),
        default="torch",
        help="torch (packed batches) or ONNX Runtime (padded), as text_embedding's 'execution'",
    )
    args = ap.parse_args(argv)
    import torch

    from gpuserve.models.sentence_embedding import SentenceEmbedder

    torch.set_num_threads(args.threads)
    texts = [t for t in args.texts.read_text(encoding="utf-8").splitlines() if t.strip()]
    embedder = SentenceEmbedder.load(max_seq_len=args.max_seq_len)
    if args.execution == "onnxruntime":
        from gpuserve.models.bert_onnx import cache_root

        embedder.use_onnxruntime(args.threads, cache_root())
    lengths = embedder.count_tokens(texts)
    for mode in [m for m in args.modes.split(",") if m]:
        print(
            json.dumps(measure(embedder, texts, lengths, mode, args.seconds, args.warmup)),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
