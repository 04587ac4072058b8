"""Rerank, classification and sparse embeddings on TEI's and Cohere's APIs, against a real
server, checked against the reference libraries on the same (test-built) weights.

One server holds a seeded cross-encoder (``ce``, ``max_length`` 32 so that truncation is
exercised), the same folder without truncation (``ce_strict``), a three-label classifier
(``cls``), a SPLADE masked-LM (``sp``), the MiniLM feature-extraction folder (``minilm``)
and a gated python reranker (``gated``, for the fairness test).
"""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.fixtures import rerank_gate
from tests.fixtures.hf_models import minilm_dir
from tests.fixtures.retrieval_models import (
    write_classifier,
    write_cross_encoder,
    write_onnx_pairs,
    write_splade,
)
from tests.helpers import InProcessServer, wait_queue, wait_until

MAX_LENGTH = 32
QUERY = "how does a gpu batch requests"
PASSAGES = [
    "A GPU inference server batches requests to keep the device busy.",
    "Paris is the capital of France.",
    "Bananas are yellow and rich in potassium.",
    "Dynamic batching groups requests that arrive close together.",
    "Ünïcödé text with émojis 🚀 and 中文字符.",
    "short",
]
LONG = " ".join(f"word{i} batching gpu" for i in range(60))  # past max_length: truncated


def _hf(name: str, task: str, folder: Path, extra: str = "") -> str:
    return (
        f"backend: huggingface\nmax_batch_size: 8\ninstance_group: [{{kind: cpu}}]\n"
        f"huggingface: {{task: {task}, model_dir: '{folder}', max_length: {MAX_LENGTH}{extra}}}\n"
    )


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("retrieval_models")
    return {
        "ce": write_cross_encoder(root / "ce"),
        "cls": write_classifier(root / "cls"),
        "sp": write_splade(root / "sp"),
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory, folders):
    root = tmp_path_factory.mktemp("retrieval_repository")
    configs = {
        "ce": _hf("ce", "sequence-classification", folders["ce"]) + "rerank: {max_documents: 64}\n",
        "ce_strict": _hf(
            "ce_strict", "sequence-classification", folders["ce"], ", truncation: false"
        ),
        "cls": _hf("cls", "sequence-classification", folders["cls"]),
        "sp": _hf("sp", "sparse-embedding", folders["sp"], ", sparse_top_k: 64"),
        "minilm": (
            "backend: huggingface\nmax_batch_size: 8\ninstance_group: [{kind: cpu}]\n"
            f"huggingface: {{task: feature-extraction, model_dir: '{minilm_dir()}'}}\n"
        ),
        "gated": rerank_gate.CONFIG,
        "ce_onnx": ONNX_CONFIG,
    }
    for name, config in configs.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.yaml").write_text(config)
        (root / name / "1" / "README.txt").write_text("weights: huggingface.model_dir\n")
    (root / "gated" / "1" / "model.py").write_text(rerank_gate.MODEL)
    write_onnx_pairs(folders["ce"], root / "ce_onnx" / "1")
    running = InProcessServer(root)
    yield running
    running.stop()


ONNX_CONFIG = f"""
backend: python
max_batch_size: 8
inputs:
  - {{name: TEXT, datatype: BYTES, shape: [1]}}
  - {{name: TEXT_PAIR, datatype: BYTES, shape: [1], optional: true}}
outputs:
  - {{name: LOGITS, datatype: FP32, shape: [1]}}
instance_group: [{{kind: cpu}}]
parameters: {{max_seq_len: {MAX_LENGTH}}}
rerank: {{}}
"""


def post(server, path: str, body: dict, status: int = 200) -> object:
    response = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert response.status_code == status, response.text
    return response.json()


def hf_logits(folder: Path, firsts, seconds=None, truncation="longest_first") -> np.ndarray:
    """transformers' own forward: float32 logits [N, labels]."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(folder), local_files_only=True
    ).eval()
    batch = tokenizer(
        firsts,
        seconds,
        padding=True,
        truncation=truncation,
        max_length=MAX_LENGTH,
        return_tensors="pt",
    )
    with torch.inference_mode():
        return model(**batch).logits.float().numpy()


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def by_index(items: list[dict], key: str) -> np.ndarray:
    return np.array([item[key] for item in sorted(items, key=lambda i: i["index"])])


# -- correctness ---------------------------------------------------------------------------


def test_rerank_equals_cross_encoder_single_batched_and_truncated(server, folders):
    from sentence_transformers import CrossEncoder

    passages = [*PASSAGES, LONG, LONG + " tail"] * 5  # 40 pairs: 5 chunks of 8
    encoder = CrossEncoder(str(folders["ce"]), max_length=MAX_LENGTH, device="cpu")
    expected = encoder.predict([(QUERY, p) for p in passages], batch_size=7)  # sigmoid
    answer = post(server, "/rerank", {"query": QUERY, "texts": passages})
    ranked = [item["score"] for item in answer]
    assert ranked == sorted(ranked, reverse=True) and len(ranked) == len(passages)  # best first
    np.testing.assert_allclose(by_index(answer, "score"), expected, atol=1e-4)
    # one pair alone gives the same score as in a batch
    single = post(server, "/rerank", {"query": QUERY, "texts": [LONG]})
    assert abs(single[0]["score"] - expected[PASSAGES.__len__()]) < 1e-4
    raw = post(server, "/rerank", {"query": QUERY, "texts": passages, "raw_scores": True})
    logits = hf_logits(folders["ce"], [QUERY] * len(passages), passages)[:, 0]
    np.testing.assert_allclose(by_index(raw, "score"), logits, atol=1e-4)
    # the same weights exported to ONNX, served by the onnx backend behind a tokenising model
    onnx = post(server, "/rerank", {"query": QUERY, "texts": passages, "model": "ce_onnx"})
    np.testing.assert_allclose(by_index(onnx, "score"), expected, atol=1e-4)


def test_the_query_is_kept_whole_where_it_fits(server, folders):
    query = " ".join(["gpu batching query"] * 4)  # 20 of 32 tokens: more than half
    answer = post(server, "/rerank", {"query": query, "texts": [LONG], "raw_scores": True})
    kept = hf_logits(folders["ce"], [query], [LONG], truncation="only_second")[0, 0]
    halved = hf_logits(folders["ce"], [query], [LONG], truncation="longest_first")[0, 0]
    assert abs(answer[0]["score"] - kept) < 1e-4
    assert abs(kept - halved) > 1e-3  # the two truncations differ for this pair
    body = {"query": query, "texts": [LONG], "raw_scores": True, "model": "ce_onnx"}
    assert abs(post(server, "/rerank", body)[0]["score"] - kept) < 1e-4
    # a query longer than the limit: cut longest-first, as CrossEncoder does
    long_query = LONG + " " + LONG
    answer = post(server, "/rerank", {"query": long_query, "texts": ["x"], "raw_scores": True})
    expected = hf_logits(folders["ce"], [long_query], ["x"], truncation="longest_first")[0, 0]
    assert abs(answer[0]["score"] - expected) < 1e-4


def test_predict_equals_the_transformers_pipeline(server, folders):
    import transformers

    classify = transformers.pipeline(
        "text-classification", model=str(folders["cls"]), top_k=None, device="cpu"
    )
    texts = [*PASSAGES, LONG]
    expected = classify(texts, truncation=True, max_length=MAX_LENGTH)
    batch = post(server, "/predict", {"inputs": texts, "model": "cls"})
    assert len(batch) == len(texts)
    for got, want in zip(batch, expected, strict=True):
        assert [g["label"] for g in got] == [w["label"] for w in want]  # best first
        np.testing.assert_allclose([g["score"] for g in got], [w["score"] for w in want], atol=1e-4)
    single = post(server, "/predict", {"inputs": PASSAGES[0], "model": "cls"})
    assert isinstance(single, list) and {"label", "score"} <= set(single[0])
    np.testing.assert_allclose(
        [s["score"] for s in single], [w["score"] for w in expected[0]], atol=1e-4
    )
    pair = post(server, "/predict", {"inputs": [QUERY, PASSAGES[0]], "model": "cls"})
    want = classify({"text": QUERY, "text_pair": PASSAGES[0]}, truncation=True)
    want = want if isinstance(want[0], dict) else want[0]
    assert [p["label"] for p in pair] == [w["label"] for w in want]
    np.testing.assert_allclose([p["score"] for p in pair], [w["score"] for w in want], atol=1e-4)
    raw = post(server, "/predict", {"inputs": [PASSAGES[1]], "raw_scores": True, "model": "cls"})
    logits = hf_logits(folders["cls"], [PASSAGES[1]])[0]
    labels = ["negative", "neutral", "positive"]
    np.testing.assert_allclose(
        [s["score"] for s in sorted(raw[0], key=lambda s: labels.index(s["label"]))],
        logits,
        atol=1e-4,
    )


def splade_reference(folder: Path, texts: list[str]) -> np.ndarray:
    """Direct SPLADE: max over tokens of log(1 + relu(MLM logits)), padding masked; [N, V]."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = transformers.AutoModelForMaskedLM.from_pretrained(
        str(folder), local_files_only=True
    ).eval()
    batch = tokenizer(
        texts, padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt"
    )
    with torch.inference_mode():
        logits = model(**batch).logits
    weights = torch.log1p(torch.relu(logits)) * batch["attention_mask"].unsqueeze(-1)
    return weights.max(dim=1).values.numpy()


def test_embed_sparse_equals_a_direct_splade_computation(server, folders):
    texts = [*PASSAGES, LONG]
    answer = post(server, "/embed_sparse", {"inputs": texts})
    dense = splade_reference(folders["sp"], texts)
    assert len(answer) == len(texts)
    for row, terms in zip(dense, answer, strict=True):
        ids = [t["index"] for t in terms]
        assert ids == sorted(ids) and 0 < len(ids) <= 64  # compact: the top-k non-zero terms
        np.testing.assert_allclose([t["value"] for t in terms], row[ids], atol=1e-4)
        top = np.sort(row)[::-1][: len(ids)]
        kept = sorted((t["value"] for t in terms), reverse=True)
        np.testing.assert_allclose(kept, top, atol=1e-4)
    single = post(server, "/embed_sparse", {"inputs": texts[0]})
    assert [t["index"] for t in single[0]] == [t["index"] for t in answer[0]]  # alone = batched
    np.testing.assert_allclose(
        [t["value"] for t in single[0]], [t["value"] for t in answer[0]], atol=1e-5
    )


def test_v2_keeps_working_for_every_kind(server, folders):
    body = {
        "inputs": [
            {"name": "TEXT", "shape": [2, 1], "datatype": "BYTES", "data": [QUERY, QUERY]},
            {"name": "TEXT_PAIR", "shape": [2, 1], "datatype": "BYTES", "data": PASSAGES[:2]},
        ]
    }
    out = post(server, "/v2/models/ce/infer", body)
    logits = {o["name"]: o for o in out["outputs"]}["LOGITS"]["data"]
    raw = post(server, "/rerank", {"query": QUERY, "texts": PASSAGES[:2], "raw_scores": True})
    np.testing.assert_allclose(logits, by_index(raw, "score"), atol=1e-5)
    single = {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["hi"]}]}
    post(server, "/v2/models/cls/infer", single)
    default = post(server, "/predict", {"inputs": "hi"})  # the classifier, not the reranker
    assert {item["label"] for item in default} == {"negative", "neutral", "positive"}
    outs = post(server, "/v2/models/sp/infer", single)["outputs"]
    assert {o["name"]: o["shape"] for o in outs} == {
        "SPARSE_INDICES": [1, 64],
        "SPARSE_VALUES": [1, 64],
    }


def test_v1_models_lists_every_kind(server):
    ids = [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]
    assert {"ce", "ce_strict", "ce_onnx", "cls", "sp", "minilm", "gated"} <= set(ids)


def test_embed_similarity_and_tokenize(server):
    vectors = post(server, "/embed", {"inputs": PASSAGES[:2], "model": "minilm"})
    assert np.asarray(vectors).shape == (2, 384)
    v2 = {"inputs": [{"name": "TEXT", "shape": [2, 1], "datatype": "BYTES", "data": PASSAGES[:2]}]}
    out = post(server, "/v2/models/minilm/infer", v2)["outputs"][0]
    np.testing.assert_allclose(np.asarray(out["data"]).reshape(2, -1), vectors, atol=1e-5)
    cosines = post(
        server,
        "/similarity",
        {"inputs": {"source_sentence": PASSAGES[0], "sentences": PASSAGES[:2]}, "model": "minilm"},
    )
    assert cosines[0] == pytest.approx(1.0, abs=1e-5) and cosines[1] < 0.9
    tokens = post(server, "/tokenize", {"inputs": "hello world", "model": "ce"})
    assert [(t["text"], t["special"]) for t in tokens[0]] == [
        ("[CLS]", True),
        ("hello", False),
        ("world", False),
        ("[SEP]", True),
    ]
    assert (tokens[0][1]["start"], tokens[0][1]["stop"]) == (0, 5)


# -- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "status", "kind"),
    [
        ("/rerank", {"query": "q", "texts": []}, 400, "Empty"),
        ("/rerank", {"query": "q"}, 413, "Validation"),
        ("/rerank", {"query": "q", "texts": ["a"] * 65}, 413, "Validation"),  # max_documents
        ("/rerank", {"query": "q", "texts": ["a"], "model": "nope"}, 404, "Validation"),
        ("/rerank", {"query": "q", "texts": [LONG], "model": "ce_strict"}, 413, "Validation"),
        ("/predict", {"inputs": []}, 400, "Empty"),
        ("/predict", {"inputs": ["a", ["b", "c"], "d"]}, 413, "Validation"),
        ("/predict", {"inputs": 3}, 413, "Validation"),
        ("/embed_sparse", {"inputs": []}, 400, "Empty"),
        ("/embed", {"inputs": "x", "model": "cls"}, 404, "Validation"),
    ],
)
def test_tei_errors(server, path, body, status, kind):
    answer = post(server, path, body, status)
    assert answer["error_type"] == kind and answer["error"]


@pytest.mark.parametrize(
    ("body", "status", "word"),
    [
        ({"model": "ce", "query": "q", "documents": []}, 400, "empty"),
        ({"model": "ce", "query": "q", "documents": ["a"] * 65}, 413, "more than the 64"),
        ({"model": "nope", "query": "q", "documents": ["a"]}, 404, "does not exist"),
        ({"model": "cls", "query": "q", "documents": ["a"]}, 404, "does not serve"),
        ({"model": "ce_strict", "query": "q", "documents": [LONG]}, 400, "max_length"),
        ({"model": "ce", "query": "q", "documents": ["a"], "top_n": 0}, 400, "top_n"),
        ({"query": "q", "documents": ["a"]}, 400, "model"),
    ],
)
def test_cohere_errors(server, body, status, word):
    answer = post(server, "/v1/rerank", body, status)
    assert word in answer["message"]


# -- the clients, unchanged ----------------------------------------------------------------


def test_cohere_sdk_rerank(server):
    cohere = pytest.importorskip("cohere")
    passages = [*PASSAGES, LONG]
    raw = post(server, "/rerank", {"query": QUERY, "texts": passages, "model": "ce"})
    client = cohere.Client(base_url=server.url, api_key="unused")
    response = client.rerank(
        model="ce", query=QUERY, documents=passages, top_n=3, return_documents=True
    )
    assert [r.index for r in response.results] == [item["index"] for item in raw[:3]]
    for result, item in zip(response.results, raw, strict=False):
        assert result.relevance_score == pytest.approx(item["score"], abs=1e-6)
        assert result.document.text == passages[result.index]
    v2 = cohere.ClientV2(base_url=server.url, api_key="unused")
    response = v2.rerank(model="ce", query=QUERY, documents=passages, top_n=2)
    assert [r.index for r in response.results] == [item["index"] for item in raw[:2]]
    with pytest.raises(cohere.errors.NotFoundError):
        client.rerank(model="nope", query=QUERY, documents=passages)


@pytest.fixture()
def hub(monkeypatch):
    """``huggingface_hub`` with its offline switch off (the tests set ``HF_HUB_OFFLINE``
    against downloads; these clients talk only to the local server)."""
    hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", False)
    return hub


def test_huggingface_hub_inference_client(server, hub):
    embed = hub.InferenceClient(model=f"{server.url}/models/minilm")
    vector = np.asarray(embed.feature_extraction(PASSAGES[0]))
    expected = post(server, "/embed", {"inputs": [PASSAGES[0]], "model": "minilm"})
    np.testing.assert_allclose(vector.reshape(1, -1), expected, atol=1e-6)
    similar = embed.sentence_similarity(PASSAGES[0], other_sentences=PASSAGES[:3])
    assert similar[0] == pytest.approx(1.0, abs=1e-5) and len(similar) == 3
    labels = hub.InferenceClient(model=f"{server.url}/models/cls").text_classification(QUERY)
    expected = post(server, "/predict", {"inputs": QUERY, "model": "cls"})
    assert [(e.label, round(e.score, 6)) for e in labels] == [
        (e["label"], round(e["score"], 6)) for e in expected
    ]


def test_huggingface_hub_health_check_and_endpoint_info(server, hub):
    # huggingface_hub asks a URL's /health and /info only with the provider named
    def client(url: str):
        return hub.InferenceClient(model=url, provider="hf-inference")

    root = client(server.url)  # GET /health, GET /info
    assert root.health_check()
    info = root.get_endpoint_info()  # the model POST / answers with: the first embedder
    assert info["model_id"] == "minilm"
    assert info["model_type"] == {"embedding": {"pooling": "auto"}}
    assert (info["model_dtype"], info["max_batch_requests"]) == ("float32", 8)
    assert info["max_client_batch_size"] == 2048  # the server's max_inputs_per_call
    assert info["max_concurrent_requests"] == 1024 and info["tokenization_workers"] >= 1
    assert isinstance(info["version"], str) and info["auto_truncate"] is True
    ce = client(f"{server.url}/models/ce")  # GET /models/ce/health, /models/ce/info
    assert ce.health_check()
    info = ce.get_endpoint_info()
    assert info["model_id"] == "ce" and set(info["model_type"]) == {"reranker"}
    assert info["max_client_batch_size"] == 64  # its rerank.max_documents, below the server's
    assert info["max_input_length"] == MAX_LENGTH
    info = client(f"{server.url}/models/cls").get_endpoint_info()
    (labels,) = info["model_type"].values()
    assert len(labels["id2label"]) == 3
    assert not client(f"{server.url}/models/nope").health_check()
    vector = client(f"{server.url}/models/minilm").feature_extraction(PASSAGES[0])
    assert np.asarray(vector).size == 384  # the same client serves the model


def test_langchain_huggingface_endpoint_embeddings(server, hub):
    lc = pytest.importorskip("langchain_huggingface")
    embeddings = lc.HuggingFaceEndpointEmbeddings(model=f"{server.url}/models/minilm")
    vectors = embeddings.embed_documents(PASSAGES[:3])
    expected = post(server, "/embed", {"inputs": PASSAGES[:3], "model": "minilm"})
    np.testing.assert_allclose(vectors, expected, atol=1e-6)
    query = embeddings.embed_query(PASSAGES[0])
    np.testing.assert_allclose(query, expected[0], atol=1e-6)


# -- fairness ------------------------------------------------------------------------------


def test_a_long_rerank_holds_a_single_pair_for_at_most_one_batch(server):
    gate = rerank_gate.GATE
    gate.reset()
    documents = [f"passage {i} " + "x" * (i % 7) for i in range(1000)]
    answers: dict[str, object] = {}

    def call(name: str, body: dict) -> None:
        answers[name] = httpx.post(f"{server.url}/rerank", json=body, timeout=60)

    long_call = threading.Thread(
        target=call, args=("long", {"query": "A", "texts": documents, "model": "gated"})
    )
    long_call.start()
    try:
        wait_until(lambda: gate.ran() >= 1, what="the long call's first batch runs")
        wait_queue(server.url, "gated", queued=1)  # its next chunk waits behind it
        short_call = threading.Thread(
            target=call, args=("short", {"query": "B", "texts": ["one"], "model": "gated"})
        )
        short_call.start()
        wait_queue(server.url, "gated", queued=2)  # the single pair is queued too
        for released in range(1, 4):
            gate.release()
            wait_until(lambda n=released: gate.ran() >= n + 1, what=f"batch {released + 1}")
            if any("B" in batch for batch in gate.batches):
                break
        ran_before = next(i for i, batch in enumerate(gate.batches) if "B" in batch)
        # batch 0 ran when B came, batch 1 was already queued: B is the next one
        assert ran_before <= 2, [batch[:1] for batch in gate.batches[:4]]
    finally:
        gate.open()
        long_call.join(60)
    short_call.join(60)
    assert answers["short"].status_code == 200  # type: ignore[attr-defined]
    result = answers["long"].json()  # type: ignore[attr-defined]
    assert len(result) == 1000
    scores = by_index(result, "score")
    expected = sigmoid(np.array([len(d) for d in documents], dtype=np.float64))
    np.testing.assert_allclose(scores, expected, atol=1e-6)  # input order kept
    assert max(len(batch) for batch in gate.batches) <= 4
