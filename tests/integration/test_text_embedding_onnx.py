"""``gpuserve export text_embedding``: the default embedding model as an ONNX graph
(tokenisation in the CPU stage, the graph on ONNX Runtime through the onnx backend), exported
at test time and served beside the torch model with the same embeddings (cosine > 0.9999)."""

from __future__ import annotations

import shutil

import httpx
import numpy as np
import pytest
import yaml

from gpuserve.cli.main import main
from gpuserve.config import default_model_repository
from tests.helpers import InProcessServer

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A fast auburn fox leaps above a sleepy hound.",
    "gpuserve serves models over the KServe V2 protocol with dynamic batching.",
    "short",
    "Ünïcödé, emoji 🚀, numbers 12345 and punctuation?!",
    "A much longer sentence that goes on and on, so that the batch has padding in it and "
    "the attention mask matters for every other row of the batch.",
]


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    repo = tmp_path_factory.mktemp("text_embedding_onnx")
    shutil.copytree(default_model_repository() / "text_embedding", repo / "text_embedding")
    assert main(["export", "--model-repository", str(repo), "text_embedding"]) == 0
    return repo


@pytest.fixture(scope="module")
def server(repository):
    running = InProcessServer(repository)
    yield running
    running.stop()


def test_export_writes_graph_tokenizer_and_config(repository):
    folder = repository / "text_embedding_onnx"
    assert sorted(p.name for p in (folder / "1").iterdir() if p.name != "__pycache__") == [
        "model.onnx",
        "model.py",
        "tokenizer.json",
    ]
    config = yaml.safe_load((folder / "config.yaml").read_text())
    assert config["backend"] == "python"
    assert config["max_batch_size"] == 64
    assert config["inputs"] == [{"name": "TEXT", "datatype": "BYTES", "shape": [1]}]
    assert config["outputs"] == [{"name": "EMBEDDING", "datatype": "FP32", "shape": [384]}]
    assert config["parameters"] == {"max_seq_len": 256}
    graph = onnx.load(str(folder / "1" / "model.onnx")).graph
    inputs = {i.name: i.type.tensor_type for i in graph.input}
    assert list(inputs) == ["input_ids", "attention_mask"]
    for tensor in inputs.values():
        assert tensor.elem_type == onnx.TensorProto.INT64
        assert [d.dim_param for d in tensor.shape.dim] == ["batch", "sequence"]
    (output,) = graph.output
    assert output.name == "embedding"
    assert output.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert [d.dim_param or d.dim_value for d in output.type.tensor_type.shape.dim] == ["batch", 384]


def embed(client: httpx.Client, model: str, texts: list[str]) -> np.ndarray:
    body = {
        "inputs": [{"name": "TEXT", "shape": [len(texts), 1], "datatype": "BYTES", "data": texts}]
    }
    response = client.post(f"/v2/models/{model}/infer", json=body)
    assert response.status_code == 200, response.text
    (out,) = response.json()["outputs"]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def test_onnx_embeddings_match_the_torch_model_over_http(server):
    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        torch_rows = embed(client, "text_embedding", SENTENCES)
        onnx_rows = embed(client, "text_embedding_onnx", SENTENCES)
        # One row alone (no padding) as well as inside the padded batch.
        onnx_alone = embed(client, "text_embedding_onnx", SENTENCES[3:4])
    assert onnx_rows.shape == torch_rows.shape == (len(SENTENCES), 384)
    cosine = (onnx_rows * torch_rows).sum(axis=1) / (
        np.linalg.norm(onnx_rows, axis=1) * np.linalg.norm(torch_rows, axis=1)
    )
    assert cosine.min() > 0.9999, cosine
    np.testing.assert_allclose(onnx_alone[0], onnx_rows[3], atol=1e-5)


def test_a_second_export_adds_a_version_and_keeps_the_config(repository, capsys):
    config = (repository / "text_embedding_onnx" / "config.yaml").read_text()
    assert main(["export", "--model-repository", str(repository), "text_embedding"]) == 0
    out = capsys.readouterr().out
    assert "text_embedding_onnx/2/model.onnx" in out
    assert "check: max |onnxruntime - torch| =" in out
    assert (repository / "text_embedding_onnx" / "config.yaml").read_text() == config
    shutil.rmtree(repository / "text_embedding_onnx" / "2")
