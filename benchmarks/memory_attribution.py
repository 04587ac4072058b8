#!/usr/bin/env python3
"""Which glibc malloc setting keeps memory flat (issue 20), in-process, without the server.

Runs the server's three stage threads (tokenise -> encode -> postprocess + JSON encode) on
``--batches`` random batches (1-4 requests of 1-4 rows, each row 1-200 words from the model's
vocabulary, seeded), with the ``text_embedding`` BERT cut to ``--layers`` layers (the same
shapes and allocations per layer, a fraction of the compute), and prints resident memory after
``--baseline`` batches, at the end, and after one ``malloc_trim(0)``. The malloc settings come
from the environment, applied with ``mallopt`` before torch is imported::

    python benchmarks/memory_attribution.py                          # glibc defaults
    MMAP_THRESHOLD=1048576 python benchmarks/memory_attribution.py   # M_MMAP_THRESHOLD
    ARENA_MAX=2 python benchmarks/memory_attribution.py              # M_ARENA_MAX
    TRIM_EVERY_S=10 python benchmarks/memory_attribution.py          # malloc_trim every 10 s

Glibc on Linux only.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import queue
import random
import threading
import time
from pathlib import Path

LIBC = ctypes.CDLL("libc.so.6")
if os.environ.get("MMAP_THRESHOLD"):
    LIBC.mallopt(-3, int(os.environ["MMAP_THRESHOLD"]))
if os.environ.get("ARENA_MAX"):
    LIBC.mallopt(-8, int(os.environ["ARENA_MAX"]))

import orjson  # noqa: E402 - after mallopt, as the server does

from gpuserve.models.sentence_embedding import SentenceEmbedder  # noqa: E402


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=700)
    parser.add_argument("--baseline", type=int, default=150)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    embedder = SentenceEmbedder.load()
    embedder.encoder.layers = embedder.encoder.layers[: args.layers]
    vocab = embedder.tokenizer.get_vocab()
    words = sorted(w for w in vocab if w.isascii() and w.isalpha() and len(w) >= 3)
    rng = random.Random(args.seed)

    def texts() -> list[str]:
        rows = sum(rng.randint(1, 4) for _ in range(rng.randint(1, 4)))
        return [
            " ".join(rng.choice(words) for _ in range(rng.randint(1, 200))) for _ in range(rows)
        ]

    tokenized: queue.Queue = queue.Queue(2)
    encoded: queue.Queue = queue.Queue(2)

    def preprocess() -> None:
        for _ in range(args.batches):
            tokenized.put(embedder.tokenize(texts()))
        tokenized.put(None)

    def forward() -> None:
        while (batch := tokenized.get()) is not None:
            encoded.put(embedder.embed(batch))
        encoded.put(None)

    stop = threading.Event()

    def trimmer() -> None:
        while not stop.wait(float(os.environ["TRIM_EVERY_S"])):
            LIBC.malloc_trim(0)

    threads = [threading.Thread(target=preprocess), threading.Thread(target=forward)]
    if os.environ.get("TRIM_EVERY_S"):
        threads.append(threading.Thread(target=trimmer, daemon=True))
    for thread in threads:
        thread.start()
    done, base, start = 0, 0.0, time.monotonic()
    while (out := encoded.get()) is not None:
        orjson.dumps({"data": out.cpu().numpy().ravel().tolist()})
        done += 1
        if done == args.baseline:
            base = rss_mib()
    stop.set()
    end = rss_mib()
    LIBC.malloc_trim(0)
    names = ("ARENA_MAX", "MMAP_THRESHOLD", "TRIM_EVERY_S")
    tag = " ".join(f"{k}={os.environ[k]}" for k in names if os.environ.get(k)) or "glibc defaults"
    print(
        f"{tag}: RSS after {args.baseline} batches {base:.0f} MiB, after {args.batches} "
        f"{end:.0f} MiB (growth {end - base:+.0f}), after malloc_trim {rss_mib():.0f} MiB "
        f"({time.monotonic() - start:.0f} s)"
    )


if __name__ == "__main__":
    main()
