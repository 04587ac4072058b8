#!/usr/bin/env python3
"""Accuracy and speed of text_embedding at each precision, against fp32, in-process.

For a fixed set of sentences, embeds them at fp32, fp16, bf16 and int8 (dynamic quantisation)
through the text_embedding model's own hooks, and reports the per-sentence cosine similarity to
fp32 (min and mean) and sentences/s at batch 32. Run on the device you serve on:
``python benchmarks/precision_accuracy.py [--device cuda:0]`` (int8 is CPU-only).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A GPU inference server batches requests to keep the device busy.",
    "Paris is the capital of France.",
    "Stock markets fell sharply after the announcement.",
    "She plays the violin in a small orchestra on weekends.",
    "Sentence embeddings map text to vectors that capture meaning.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "Quantum computers use qubits instead of classical bits.",
] * 4


def load(precision: str, device: str):
    from gpuserve.backends.base import LoadContext
    from gpuserve.backends.python import PythonBackend
    from gpuserve.config import default_model_repository, load_model_config

    folder = default_model_repository() / "text_embedding"
    config = load_model_config(folder / "config.yaml").model_copy(update={"precision": precision})
    backend = PythonBackend()
    backend.load(
        LoadContext(
            config=config,
            version_path=folder / "1",
            version=1,
            device=device,
            parameters=dict(config.parameters),
        )
    )
    return backend


def embed(backend, sentences: list[str]) -> np.ndarray:
    text = np.array([[s.encode()] for s in sentences], dtype=object)
    return backend.postprocess(backend.forward(backend.preprocess({"TEXT": text})))["EMBEDDING"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    precisions = ["fp32", "fp16", "bf16"] + (["int8"] if args.device == "cpu" else [])
    reference = None
    print("| precision | min cosine vs fp32 | mean cosine | sentences/s (batch 32) |")
    print("|---|---|---|---|")
    for precision in precisions:
        backend = load(precision, args.device)
        out = embed(backend, SENTENCES)
        if reference is None:
            reference = out
        cos = (out * reference).sum(1) / (
            np.linalg.norm(out, axis=1) * np.linalg.norm(reference, axis=1)
        )
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            embed(backend, SENTENCES)
            n += len(SENTENCES)
        rate = n / (time.perf_counter() - t0)
        print(f"| {precision} | {cos.min():.6f} | {cos.mean():.6f} | {rate:.1f} |")


if __name__ == "__main__":
    main()
