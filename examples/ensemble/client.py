"""Embed sentences with ``text_embedding_pipeline`` (tokenizer -> encoder -> pooling, an
ensemble run inside the server) and with the one-model ``text_embedding``; print the cosine
similarity of the two embeddings of each sentence.

    gpuserve serve --model-repository examples/ensemble/model_repository &
    python examples/ensemble/client.py --url localhost:8000
"""

from __future__ import annotations

import argparse
import sys

import httpx
import numpy as np

SENTENCES = [
    "gpuserve runs pipelines of models inside the server.",
    "A tokenizer, an encoder and a pooling step, each batched with its own traffic.",
    "Short one.",
]


def embed(url: str, model: str, texts: list[str]) -> np.ndarray:
    """FP32 [len(texts), 384] embeddings of ``texts`` from ``model``."""
    body = {
        "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [len(texts), 1], "data": texts}]
    }
    answer = httpx.post(f"http://{url}/v2/models/{model}/infer", json=body, timeout=60)
    answer.raise_for_status()
    out = answer.json()["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="localhost:8000", help="host:port of the HTTP API")
    parser.add_argument("--min-cosine", type=float, default=0.9999)
    args = parser.parse_args(argv)
    pipeline = embed(args.url, "text_embedding_pipeline", SENTENCES)
    single = embed(args.url, "text_embedding", SENTENCES)
    cosines = (pipeline * single).sum(axis=1) / (
        np.linalg.norm(pipeline, axis=1) * np.linalg.norm(single, axis=1)
    )
    for sentence, cosine in zip(SENTENCES, cosines, strict=True):
        print(f"{cosine:.6f}  {sentence}")
    return 0 if float(cosines.min()) >= args.min_cosine else 1


if __name__ == "__main__":
    sys.exit(main())
