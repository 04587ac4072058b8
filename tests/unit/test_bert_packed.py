"""Unpadded (packed) BERT execution equals the padded one (CPU path; CUDA in tests/gpu)."""

from __future__ import annotations

import random

import pytest
import torch

from gpuserve.models.bert import Packing, mean_pool_packed
from gpuserve.models.sentence_embedding import SentenceEmbedder

WORDS = [
    "the",
    "server",
    "groups",
    "requests",
    "of",
    "similar",
    "length",
    "so",
    "padding",
    "does",
    "not",
    "waste",
    "the",
    "machine",
    "and",
    "long",
    "documents",
    "finish",
]


@pytest.fixture(scope="module")
def embedder() -> SentenceEmbedder:
    return SentenceEmbedder.load()


def test_packing_offsets_and_positions():
    packing = Packing.of([2, 3, 1], "cpu")
    assert packing.offsets.tolist() == [0, 2, 5, 6]
    assert packing.positions.tolist() == [0, 1, 0, 1, 2, 0]


def test_packed_embeddings_equal_padded(embedder):
    rng = random.Random(5)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 150))) for _ in range(12)]
    batch = embedder.tokenize(texts)
    assert batch.padded
    padded = embedder.embed(batch)
    lengths = batch.attention_mask.sum(dim=1).tolist()
    ids = batch.input_ids[batch.attention_mask.bool()]
    with torch.inference_mode():
        packing = Packing.of(lengths, "cpu")
        packed = mean_pool_packed(embedder.encoder.forward_packed(ids, packing), packing)
    cosine = (packed * padded).sum(dim=1)
    assert float(cosine.min()) >= 0.9999


def test_packed_refuses_sequences_past_the_position_table(embedder):
    limit = embedder.encoder.config.max_position_embeddings
    packing = Packing.of([limit + 1], "cpu")
    with pytest.raises(ValueError, match="packed sequence lengths"):
        embedder.encoder.forward_packed(torch.ones(limit + 1, dtype=torch.int64), packing)


def test_the_embedder_runs_packed_when_asked_and_matches_padded(embedder):
    texts = ["short", "a somewhat longer sentence about batching of varied lengths " * 3]
    padded = embedder.encode(texts)
    embedder.unpadded = True
    try:
        batch = embedder.tokenize(texts)
        assert batch.packed_ids is not None and len(batch.lengths) == 2
        assert int(batch.packed_ids.shape[0]) == sum(batch.lengths)
        packed = embedder.embed(batch).numpy()
    finally:
        embedder.unpadded = False
    assert float((packed * padded).sum(axis=1).min()) >= 0.9999
