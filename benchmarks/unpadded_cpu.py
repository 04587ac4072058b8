#!/usr/bin/env python3
"""Padded vs unpadded (packed) execution of the built-in BERT encoder on one CPU core, on the
mixed-length corpus (benchmarks/corpus.py): texts/s for one batch of each kind, the best of
several alternated runs (so a loaded machine still gives usable ratios).

    taskset -c 1 .venv/bin/python benchmarks/unpadded_cpu.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corpus
import torch

from gpuserve.models.sentence_embedding import SentenceEmbedder


def best_s(embedder: SentenceEmbedder, texts: list[str], unpadded: bool, reps: int = 7) -> float:
    """Fastest of ``reps`` runs of tokenise + embed, seconds."""
    embedder.unpadded = unpadded
    embedder.embed(embedder.tokenize(texts))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        embedder.embed(embedder.tokenize(texts))
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    torch.set_num_threads(1)
    embedder = SentenceEmbedder.load()
    for mix in ("short", "chunks"):
        texts = list(corpus.build(mix, 300).texts)
        lengths = embedder.count_tokens(texts)
        order = sorted(range(len(texts)), key=lambda i: lengths[i])
        middle = len(order) // 2
        batches = {
            "sorted8": order[middle : middle + 8],
            "sorted32": order[middle : middle + 32],
            "random8": list(range(8)),
            "random32": list(range(32)),
            "one": [order[middle]],
        }
        for label, index in batches.items():
            batch = [texts[i] for i in index]
            padded = min(best_s(embedder, batch, False), best_s(embedder, batch, False))
            packed = min(best_s(embedder, batch, True), best_s(embedder, batch, True))
            span = f"{min(lengths[i] for i in index)}-{max(lengths[i] for i in index)}"
            print(
                f"{mix:6s} {label:9s} tokens {span:8s} padded {len(batch) / padded:6.1f}/s "
                f"packed {len(batch) / packed:6.1f}/s  packed/padded {padded / packed:.2f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
