"""The choice between ONNX Runtime and torch packed per batch size
(gpuserve.models.execution_choice): the decision from measured times, the measurement's
rounds, and the default text_embedding running both executions with the same embeddings."""

from __future__ import annotations

import numpy as np
import pytest

from gpuserve.models.execution_choice import (
    SAMPLE_TEXTS,
    ExecutionTimes,
    measure_executions,
    torch_from_rows,
)


def times(ort: list[float], torch: list[float]) -> ExecutionTimes:
    return ExecutionTimes((2, 4, 8, 16), tuple(ort), tuple(torch))


def test_torch_from_the_smallest_size_it_wins_there_and_above() -> None:
    # AMX-like: ONNX Runtime ahead at 2 rows, torch packed from 8
    assert torch_from_rows(times([16.2, 23.1, 41.2, 71.3], [16.7, 23.0, 34.5, 59.0])) == 8
    # torch ahead everywhere by more than the margin
    assert torch_from_rows(times([20, 30, 50, 90], [10, 15, 25, 45])) == 2
    # a win at a small size below a loss at a larger one does not count
    assert torch_from_rows(times([20, 30, 50, 90], [10, 30, 25, 45])) == 8
    # AVX2-like: ONNX Runtime ahead at every size
    assert torch_from_rows(times([10, 15, 25, 45], [12, 18, 30, 50])) is None
    # faster, but within the margin: ONNX Runtime stays
    assert torch_from_rows(times([10, 15, 25, 45], [9.5, 14, 24, 42])) is None
    assert torch_from_rows(times([10, 15, 25, 45], [9.5, 14, 24, 42]), margin=0.95) == 16


def test_measure_keeps_the_fastest_round_of_each_size_and_execution() -> None:
    now = [0.0]
    calls: list[tuple[str, int]] = []
    # per call: (execution, rows) -> seconds, slower on the first measured round
    cost = {"ort": 1.0, "torch": 0.5}

    def runner(name: str):
        def run(texts):
            calls.append((name, len(texts)))
            slow = 3.0 if sum(1 for c in calls if c == (name, len(texts))) == 2 else 1.0
            now[0] += cost[name] * len(texts) * slow

        return run

    measured = measure_executions(
        runner("ort"), runner("torch"), sizes=(2, 5), rounds=3, clock=lambda: now[0]
    )
    assert measured.sizes == (2, 5)
    assert measured.onnxruntime_s == (2.0, 5.0) and measured.torch_s == (1.0, 2.5)
    # a warm-up pass of each execution, then rounds interleaving the executions per size
    assert calls[:4] == [("ort", 2), ("ort", 5), ("torch", 2), ("torch", 5)]
    assert calls[4:8] == [("ort", 2), ("torch", 2), ("ort", 5), ("torch", 5)]
    assert len(calls) == 4 + 3 * 4


def test_sample_batches_mix_lengths() -> None:
    words = sorted(len(t.split()) for t in SAMPLE_TEXTS)
    assert words[0] <= 2 and words[-1] >= 30


@pytest.fixture(scope="module")
def embedder_pair():
    pytest.importorskip("onnxruntime")
    from gpuserve.models.bert_onnx import cache_root
    from gpuserve.models.sentence_embedding import SentenceEmbedder

    reference = SentenceEmbedder.load()
    both = SentenceEmbedder.load()
    both.use_onnxruntime(1, cache_root())
    return reference, both


def test_an_embedder_on_both_executions_splits_by_rows(embedder_pair) -> None:
    reference, both = embedder_pair
    texts = [SAMPLE_TEXTS[k % len(SAMPLE_TEXTS)] for k in range(9)]
    both.torch_from_rows = 8
    few, many = both.tokenize(texts[:7]), both.tokenize(texts)
    assert not few.on_torch and few.packed_ids is None  # ONNX Runtime: padded sub-batches
    assert many.on_torch and many.packed_ids is not None  # torch: packed
    expected = reference.encode(texts)
    np.testing.assert_allclose(both.embed(many).numpy(), expected, atol=1e-5)
    np.testing.assert_allclose(both.embed(few).numpy(), expected[:7], atol=1e-5)
    both.torch_from_rows = None
    assert not both.tokenize(texts).on_torch
    np.testing.assert_allclose(both.encode(texts), expected, atol=1e-5)
