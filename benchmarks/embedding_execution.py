#!/usr/bin/env python3
"""text_embedding on torch against ONNX Runtime, in-process, same inputs, alternating rounds.

Loads the default model (all-MiniLM-L6-v2) twice with :class:`SentenceEmbedder`: one on
torch (packed batches, as served), one moved to ONNX Runtime (as ``execution: auto`` does on
a CPU), then times ``encode`` on the same texts, real prose from ``benchmarks/corpus.py``
(docstrings of the standard library): batches of 1, 8 and 32 sentences of 4-40 words, and of
1 and 4 chunks of 60-200 words. Rounds alternate the two
executions so drift in the machine's load hits both alike; the median per round is kept.

    python benchmarks/embedding_execution.py [--rounds 5] [--threads 1]

Prints one table (ms per call, median over rounds, and the torch / ONNX Runtime ratio).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from corpus import build

from gpuserve.models.sentence_embedding import SentenceEmbedder


def take(texts: tuple[str, ...], size: int, calls: int) -> list[list[str]]:
    return [list(texts[i * size : (i + 1) * size]) for i in range(calls)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch and ONNX Runtime threads")
    ap.add_argument("--calls", type=int, default=10, help="calls per case per round")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    short, chunks = build("short").texts, build("chunks").texts
    cases = {
        "1 sentence": take(short, 1, args.calls),
        "8 sentences": take(short, 8, args.calls),
        "32 sentences": take(short, 32, args.calls),
        "1 chunk": take(chunks, 1, args.calls),
        "4 chunks": take(chunks, 4, args.calls),
    }
    on_torch = SentenceEmbedder.load()
    on_ort = SentenceEmbedder.load()
    on_ort.use_onnxruntime(args.threads, None)
    on_ort.release_torch_weights()
    runs: dict[str, dict[str, list[float]]] = {c: {"torch": [], "onnxruntime": []} for c in cases}
    for round_ in range(args.rounds):
        order = [("torch", on_torch), ("onnxruntime", on_ort)]
        if round_ % 2:
            order.reverse()
        for case, batches in cases.items():
            for name, embedder in order:
                embedder.encode(batches[0])  # warm
                start = time.perf_counter()
                for batch in batches:
                    embedder.encode(batch)
                runs[case][name].append((time.perf_counter() - start) / len(batches) * 1e3)
    print(f"threads {args.threads}, rounds {args.rounds}, {args.calls} calls per case per round")
    print(f"{'case':<14}{'torch ms':>10}{'ORT ms':>10}{'ratio':>8}")
    for case, by in runs.items():
        t, o = statistics.median(by["torch"]), statistics.median(by["onnxruntime"])
        print(f"{case:<14}{t:>10.2f}{o:>10.2f}{t / o:>8.2f}")


if __name__ == "__main__":
    main()
