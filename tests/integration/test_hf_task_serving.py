"""Hugging Face folders served with ``backend: huggingface`` and no ``task``, behind the real
server: the task comes from the folder's ``config.json`` (``architectures``, as TEI reads it).
A ``BertForSequenceClassification`` folder serves classification (its head kept, LOGITS as
transformers computes them), a ``LlamaForCausalLM`` folder serves text generation, and a
``rerank`` section on a model without the tensors it names is refused at load, naming both,
instead of loading READY and failing every call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.fixtures.chat_models import write_tiny_chat
from tests.fixtures.hf_models import LABELS, reference_logits, write_tiny_classifier
from tests.helpers import InProcessServer

pytest.importorskip("transformers")

TEXTS = ["The quick brown fox jumps over the lazy dog.", "gpuserve batches requests."]
CPU = "instance_group: [{kind: cpu}]\n"


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf_task_repository")
    classifier = write_tiny_classifier(root / "classifier" / "1")
    (root / "classifier" / "config.yaml").write_text(
        "backend: huggingface\nmax_batch_size: 8\n" + CPU + "huggingface: {max_length: 64}\n"
    )
    (root / "embedded" / "1").mkdir(parents=True)
    (root / "embedded" / "1" / "README.txt").write_text("weights: huggingface.model_dir\n")
    (root / "embedded" / "config.yaml").write_text(
        "backend: huggingface\nmax_batch_size: 8\n"
        + CPU
        + f"huggingface: {{task: feature-extraction, model_dir: '{classifier}'}}\n"
        + "rerank: {}\n"
    )
    write_tiny_chat(root / "chat" / "1")
    (root / "chat" / "config.yaml").write_text("backend: huggingface\n" + CPU)
    return root


@pytest.fixture(scope="module")
def server(repository: Path) -> Any:
    running = InProcessServer(repository)
    yield running
    running.stop()


def test_a_classifier_folder_with_no_task_serves_classification(server, repository):
    meta = httpx.get(f"{server.url}/v2/models/classifier").json()
    assert [o["name"] for o in meta["outputs"]] == ["LOGITS", "LABEL"]
    body = {
        "inputs": [
            {
                "name": "TEXT",
                "datatype": "BYTES",
                "shape": [len(TEXTS), 1],
                "data": TEXTS,
            }
        ]
    }
    reply = httpx.post(f"{server.url}/v2/models/classifier/infer", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    outputs = {o["name"]: o for o in reply.json()["outputs"]}
    got = np.asarray(outputs["LOGITS"]["data"], dtype=np.float32).reshape(len(TEXTS), -1)
    want = reference_logits(repository / "classifier" / "1", TEXTS, max_length=64)
    np.testing.assert_allclose(got, want, atol=1e-4)  # the head is the folder's, not dropped
    predicted = httpx.post(
        f"{server.url}/predict", json={"inputs": TEXTS[0], "model": "classifier"}, timeout=60
    )
    assert predicted.status_code == 200, predicted.text
    assert {row["label"] for row in predicted.json()} == set(LABELS.values())


def test_a_rerank_section_naming_a_missing_output_is_refused_at_load(server):
    index = httpx.post(f"{server.url}/v2/repository/index", json={}).json()
    row = next(r for r in index if r["name"] == "embedded")
    assert row["state"] == "UNAVAILABLE"
    assert (
        "rerank.output 'LOGITS' is not an output of model 'embedded' (outputs: EMBEDDING)"
        in row["reason"]
    )
    reply = httpx.post(
        f"{server.url}/rerank",
        json={"query": "q", "texts": ["a", "b"], "model": "embedded"},
        timeout=60,
    )
    assert reply.status_code not in (200, 424, 500), reply.text


def test_a_causal_lm_folder_with_no_task_serves_text_generation(server):
    config = httpx.get(f"{server.url}/v2/models/chat/config").json()
    assert config["parameters"]["task"] == {"string_value": "text-generation"}
    reply = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": "chat", "prompt": "The quick brown", "max_tokens": 4, "temperature": 0},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] >= 1
