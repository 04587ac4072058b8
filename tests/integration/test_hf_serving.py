"""The ``huggingface`` backend behind the real server: a sentence-transformers folder for
feature extraction and a tiny classifier for sequence classification, with inputs/outputs
left to auto-completion and shown at ``/v2/models/{m}/config``."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.fixtures.hf_models import LABELS, minilm_dir, reference_logits, write_tiny_classifier
from tests.helpers import InProcessServer

pytest.importorskip("transformers")

SENTENCES = ["The quick brown fox", "A fast auburn fox jumps over the lazy dog", "hello"]


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    repository = tmp_path_factory.mktemp("hf_repository")
    (repository / "minilm" / "1").mkdir(parents=True)
    # The weights live elsewhere (model_dir); an empty version folder would not be loaded.
    (repository / "minilm" / "1" / "README.txt").write_text("weights: huggingface.model_dir\n")
    (repository / "minilm" / "config.yaml").write_text(
        "backend: huggingface\n"
        "max_batch_size: 16\n"
        "instance_group: [{kind: cpu}]\n"
        f"huggingface: {{task: feature-extraction, model_dir: '{minilm_dir()}'}}\n"
    )
    write_tiny_classifier(repository / "classifier" / "1")
    (repository / "classifier" / "config.yaml").write_text(
        "backend: huggingface\n"
        "max_batch_size: 8\n"
        "instance_group: [{kind: cpu}]\n"
        "huggingface: {task: sequence-classification, max_length: 64}\n"
    )
    return repository


@pytest.fixture(scope="module")
def server(repository):
    running = InProcessServer(repository)
    yield running
    running.stop()


def infer(server, model: str, texts: list[str]) -> dict[str, dict]:
    body = {
        "inputs": [{"name": "TEXT", "shape": [len(texts), 1], "datatype": "BYTES", "data": texts}]
    }
    response = httpx.post(f"{server.url}/v2/models/{model}/infer", json=body, timeout=60.0)
    assert response.status_code == 200, response.text
    return {out["name"]: out for out in response.json()["outputs"]}


def test_config_is_completed_from_the_folder(server):
    config = httpx.get(f"{server.url}/v2/models/classifier/config/gpuserve").json()
    assert [(t["name"], t["datatype"], t["shape"], t["optional"]) for t in config["inputs"]] == [
        ("TEXT", "BYTES", [1], False),
        ("TEXT_PAIR", "BYTES", [1], True),  # pairs: a cross-encoder's query and passage
    ]
    assert [(t["name"], t["datatype"], t["shape"]) for t in config["outputs"]] == [
        ("LOGITS", "FP32", [3]),
        ("LABEL", "BYTES", [1]),
    ]
    # the classification section, filled in from config.json (id2label); no rerank: 3 labels
    assert config["classification"]["labels"] == ["negative", "neutral", "positive"]
    assert config["rerank"] is None
    meta = httpx.get(f"{server.url}/v2/models/minilm").json()
    assert meta["outputs"] == [{"name": "EMBEDDING", "datatype": "FP32", "shape": [-1, 384]}]


def test_triton_config_view_shows_the_backend_settings_in_parameters(server):
    """``/v2/models/{m}/config`` and gRPC ``ModelConfig`` carry the huggingface section's
    settings in Triton's ``parameters`` map (``{"key": {"string_value": "..."}}``)."""
    body = httpx.get(f"{server.url}/v2/models/minilm/config").json()
    assert body["parameters"] == {
        "task": {"string_value": "feature-extraction"},
        "model_dir": {"string_value": str(minilm_dir())},
    }
    body = httpx.get(f"{server.url}/v2/models/classifier/config").json()
    assert body["parameters"] == {
        "task": {"string_value": "sequence-classification"},
        "max_length": {"string_value": "64"},
    }
    grpcclient = pytest.importorskip("tritonclient.grpc")
    client = grpcclient.InferenceServerClient(server.grpc_url)
    parameters = client.get_model_config("classifier").config.parameters
    assert {key: value.string_value for key, value in parameters.items()} == {
        "task": "sequence-classification",
        "max_length": "64",
    }


def test_feature_extraction_over_http_matches_sentence_transformers(server):
    out = infer(server, "minilm", SENTENCES)["EMBEDDING"]
    got = np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])
    assert got.shape == (3, 384)
    try:
        from sentence_transformers import SentenceTransformer

        expected = SentenceTransformer(str(minilm_dir()), device="cpu").encode(SENTENCES)
    except ImportError:
        from gpuserve.models.sentence_embedding import SentenceEmbedder

        expected = SentenceEmbedder.load(minilm_dir()).encode(SENTENCES)
    cos = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cos.min() > 0.9999


def test_classification_over_http_equals_transformers(server, repository):
    outputs = infer(server, "classifier", SENTENCES)
    logits = np.asarray(outputs["LOGITS"]["data"], dtype=np.float32).reshape(3, 3)
    expected = reference_logits(repository / "classifier" / "1", SENTENCES)
    np.testing.assert_allclose(logits, expected, atol=1e-5, rtol=1e-5)
    assert outputs["LABEL"]["shape"] == [3, 1]
    assert outputs["LABEL"]["data"] == [LABELS[i] for i in expected.argmax(axis=1)]
