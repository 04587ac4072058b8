"""Token ids carried from a text model's admission step to its CPU stage
(gpuserve.text.encoded): bounded, taken once, and the same batch as tokenising again."""

from __future__ import annotations

import numpy as np
import torch

from gpuserve.text.encoded import EncodedTexts


def test_put_then_take_removes_and_misses_are_none() -> None:
    encoded = EncodedTexts(capacity=3)
    encoded.put("a", [1, 2])
    encoded.put("b", [1, 3, 2])
    assert encoded.take(["b", "x", "a", "b"]) == [[1, 3, 2], None, [1, 2], [1, 3, 2]]
    assert len(encoded) == 0
    assert encoded.take(["a"]) == [None]


def test_the_oldest_texts_go_first_past_capacity() -> None:
    encoded = EncodedTexts(capacity=2)
    for k, text in enumerate(["a", "b", "c"]):
        encoded.put(text, [k])
    encoded.put("b", [9])  # put again: newest
    encoded.put("d", [3])
    assert encoded.take(["a", "b", "c", "d"]) == [None, [9], None, [3]]


def test_admitted_texts_skip_the_second_tokenisation_with_the_same_batch() -> None:
    from gpuserve.models.sentence_embedding import SentenceEmbedder

    embedder = SentenceEmbedder.load(max_seq_len=16)
    texts = [
        "Hello world.",
        "A longer sentence than the first, which the model cuts to sixteen tokens of its start.",
        "GPU",
    ]
    fresh = embedder.tokenize(texts)  # nothing admitted: tokenised here
    truncator = embedder.truncator()
    assert truncator.encoded is not None
    lengths = [row.tokens for row in truncator.measure(texts)]
    # the text over max_seq_len tokens (truncated) is not carried over; the others are
    assert len(truncator.encoded) == 2 and lengths[1] == 16
    calls: list[list[str]] = []
    embedder.tokenizer = _Spy(embedder.tokenizer, calls)
    again = embedder.tokenize(texts)
    assert calls == [[texts[1]]]  # only the one the admission step did not keep
    assert len(truncator.encoded) == 0
    for field in ("input_ids", "attention_mask"):
        assert torch.equal(getattr(again, field), getattr(fresh, field)), field
    assert again.padded == fresh.padded and again.lengths == fresh.lengths
    assert (again.packed_ids is None) == (fresh.packed_ids is None)
    if fresh.packed_ids is not None:
        assert torch.equal(again.packed_ids, fresh.packed_ids)
    np.testing.assert_allclose(
        embedder.embed(again).numpy(), embedder.embed(fresh).numpy(), atol=1e-6
    )


class _Spy:
    """The tokenizer, recording the texts of each ``encode_batch_fast`` call."""

    def __init__(self, tokenizer, calls: list) -> None:
        self._tokenizer, self._calls = tokenizer, calls

    def encode_batch_fast(self, texts):
        self._calls.append(list(texts))
        return self._tokenizer.encode_batch_fast(texts)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)
