"""The retrieval APIs' pure pieces: body parsing (TEI's predict input shapes, Cohere's
documents), ranking and compact sparse answers, chunking, pair token counts and SPLADE."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from gpuserve.backends.hf_text import pair_lengths, splade
from gpuserve.protocol import retrieval_codec as codec
from gpuserve.service.apis.retrieval import chunk_rows


@pytest.mark.parametrize(
    ("inputs", "texts", "pairs", "batched"),
    [
        ("one", ["one"], None, False),
        (["a", "b"], ["a"], ["b"], False),  # TEI: two strings are a pair
        (["a", "b", "c"], ["a", "b", "c"], None, True),
        ([["a", "b"], ["c", "d"]], ["a", "c"], ["b", "d"], True),
        (["a"], ["a"], None, True),
    ],
)
def test_predict_inputs_follow_tei(inputs, texts, pairs, batched):
    call = codec.parse_predict({"inputs": inputs})
    assert (call.texts, call.pairs, call.batched) == (texts, pairs, batched)


@pytest.mark.parametrize(
    ("body", "empty", "param"),
    [
        ({"inputs": []}, True, "inputs"),
        ({"inputs": ["a", ["b", "c"], "d"]}, False, "inputs"),  # mixed singles and pairs
        ({"inputs": [["a"]]}, False, "inputs"),
        ({}, False, "inputs"),
        ({"inputs": "a", "raw_scores": "yes"}, False, "raw_scores"),
    ],
)
def test_predict_refusals_name_the_field(body, empty, param):
    with pytest.raises(codec.RetrievalInputError) as caught:
        codec.parse_predict(body)
    assert (caught.value.empty, caught.value.param) == (empty, param)


def test_parameters_fill_in_what_the_body_leaves_out():
    document = codec.load(b'{"inputs": "x", "parameters": {"normalize": false, "truncate": null}}')
    call = codec.parse_texts(document)
    assert (call.normalize, call.truncate) == (False, None)


def test_cohere_documents_as_strings_or_objects():
    call = codec.parse_cohere_rerank(
        {"model": "m", "query": "q", "documents": ["a", {"text": "b", "id": 7}], "top_n": 1}
    )
    assert call.documents == ["a", "b"] and call.top_n == 1
    body = orjson.loads(
        codec.encode_cohere_rerank(
            codec.RerankCall(**{**_fields(call), "return_text": True}),
            np.array([0.1, 0.9], dtype=np.float32),
            "id",
            5,
        )
    )
    assert body["results"] == [
        {"index": 1, "relevance_score": pytest.approx(0.9), "document": {"text": "b", "id": 7}}
    ]
    assert body["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    with pytest.raises(codec.RetrievalInputError, match="documents\\[0\\]"):
        codec.parse_cohere_rerank({"model": "m", "query": "q", "documents": [3]})


def _fields(call):
    return {name: getattr(call, name) for name in codec.RerankCall.__dataclass_fields__}


def test_ranking_is_best_first_ties_by_index_and_cut_after_scoring():
    scores = np.array([0.5, 0.9, 0.5, 0.1], dtype=np.float32)
    assert codec.ranked(scores, None) == [1, 0, 2, 3]
    assert codec.ranked(scores, 2) == [1, 0]


def test_sparse_answers_keep_non_zero_terms_by_id():
    body = orjson.loads(
        codec.encode_sparse(np.array([[9, 3, 5]]), np.array([[0.5, 0.25, 0.0]], dtype=np.float32))
    )
    assert body == [[{"index": 3, "value": 0.25}, {"index": 9, "value": 0.5}]]


def test_chunks_are_by_length_near_equal_and_cover_every_row():
    lengths = [50, 1, 30, 2, 40, 3, 20]
    chunks = chunk_rows(lengths, 3)
    assert [len(c) for c in chunks] == [3, 2, 2]
    assert sorted(i for c in chunks for i in c) == list(range(7))
    assert chunks[0] == [1, 3, 5]  # the shortest together
    assert chunk_rows([5], 8) == [[0]]


def test_pair_lengths_count_pair_specials_and_cap_at_max_length():
    # BERT: 2 specials for one text, 3 for a pair
    assert pair_lengths([5, 30], [7, 30], 2, 3, 32) == [3 + 5 + 3, 32]


def test_splade_is_max_of_log1p_relu_over_real_tokens():
    import torch

    logits = torch.tensor([[[1.0, -2.0, 0.0], [3.0, 0.5, -1.0], [9.0, 9.0, 9.0]]])
    mask = torch.tensor([[1, 1, 0]])  # the third token is padding
    indices, values = splade(logits, mask, 3)
    assert indices.tolist() == [[0, 1, 2]]
    np.testing.assert_allclose(values.numpy(), [[np.log1p(3.0), np.log1p(0.5), 0.0]], rtol=1e-6)
