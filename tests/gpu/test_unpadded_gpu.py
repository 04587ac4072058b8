"""Unpadded (packed, varlen attention) execution of the built-in BERT encoder on CUDA equals
the padded one (cosine >= 0.9999), in fp32 and half precision; skipped without CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from gpuserve.models.bert import Packing, mean_pool_packed
from gpuserve.models.sentence_embedding import SentenceEmbedder
from tests.gpu.model_dir import MODEL_DIR

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

WORDS = ["padding", "wastes", "the", "device", "so", "packed", "rows", "attend", "alone"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_packed_equals_padded_on_cuda(dtype):
    embedder = SentenceEmbedder.load(MODEL_DIR, device="cuda:0", dtype=dtype)
    rng = random.Random(11)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 200))) for _ in range(48)]
    batch = embedder.tokenize(texts)
    padded = embedder.embed(batch)
    lengths = batch.attention_mask.sum(dim=1).tolist()
    ids = batch.input_ids[batch.attention_mask.bool()].to("cuda:0")
    with torch.inference_mode():
        packing = Packing.of(lengths, "cuda:0")
        packed = mean_pool_packed(embedder.encoder.forward_packed(ids, packing), packing)
    cosine = (packed * padded).sum(dim=1)
    assert float(cosine.min()) >= 0.9999
