"""Lower precisions of the built-in text embedding model through the real server: int8 (ONNX
Runtime) loads past the default precision_check and serves embeddings close to fp32's; int8
past tight bounds fails to load with the measured error and the bound in its reason; bf16 on
a CPU the probe says lacks AVX-512 BF16 / AMX is refused naming the instruction set."""

from __future__ import annotations

import json
import re
import shutil

import httpx
import numpy as np
import pytest
import yaml

from gpuserve.backends import cpu_features
from gpuserve.config import default_model_repository
from tests.helpers import InProcessServer

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Sentence embeddings map text to vectors that capture meaning.",
    "A much longer sentence, so that the batch has padding in it and the attention mask "
    "matters for the shorter rows of the batch.",
]


def variant(repo, name: str, **changes) -> None:
    source = default_model_repository() / "text_embedding"
    shutil.copytree(source, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    config = yaml.safe_load((source / "config.yaml").read_text())
    config.update(changes)
    config.pop("embedding", None)  # one OpenAI embedding model per server is plenty
    (repo / name / "config.yaml").write_text(yaml.safe_dump(config))


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    repo = tmp_path_factory.mktemp("precision")
    variant(repo, "fp32")
    variant(repo, "int8", precision="int8")
    variant(repo, "int8_tight", precision="int8", precision_check={"min_cosine": 0.999999})
    variant(repo, "bf16_no_isa", precision="bf16")
    patch = pytest.MonkeyPatch()
    # the CPU-feature probe injected: this "CPU" has AVX-512 and VNNI but no bf16 products
    patch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_vnni"}))
    server = InProcessServer(repo)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            yield http
    finally:
        server.stop()
        patch.undo()


def embed(client: httpx.Client, model: str) -> np.ndarray:
    body = {
        "inputs": [
            {"name": "TEXT", "shape": [len(SENTENCES), 1], "datatype": "BYTES", "data": SENTENCES}
        ]
    }
    response = client.post(f"/v2/models/{model}/infer", json=body)
    assert response.status_code == 200, response.text
    (out,) = response.json()["outputs"]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def reason(client: httpx.Client, model: str) -> str:
    response = client.get(f"/v2/models/{model}/ready")
    assert response.status_code == 503, response.text
    return response.json()["reason"]


def test_int8_within_the_default_bounds_serves_close_to_fp32(client):
    fp32, int8 = embed(client, "fp32"), embed(client, "int8")
    cosine = np.sum(fp32 * int8, axis=1)
    assert cosine.min() > 0.99
    assert not np.array_equal(fp32, int8)  # it really runs another precision


def test_int8_past_its_bound_fails_to_load_naming_error_and_bound(client):
    text = reason(client, "int8_tight")
    assert "precision int8 fails precision_check against fp32" in text
    found = re.search(r"min cosine (0\.\d{6}) < min_cosine 0\.999999", text)
    assert found is not None, text
    assert 0.99 < float(found.group(1)) < 0.999999
    assert "built-in reference sentences" in text


def test_bf16_refused_where_the_cpu_lacks_the_instruction_set(client):
    text = reason(client, "bf16_no_isa")
    assert "AVX-512 BF16 or AMX-BF16" in text and "avx512_bf16" in text


def test_models_accuracy_reports_against_fp32_on_heldout_sentences(capsys):
    from gpuserve.cli.main import main

    assert main(["models", "accuracy", "text_embedding", "--precision", "int8", "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["precision"] == "int8" and report["texts"] == 300 and report["k"] == 10
    assert 0.99 < report["cosine_min"] < 1.0 and report["cosine_min"] <= report["cosine_mean"]
    assert 0.0 < report["max_abs_error"] < 0.05
    assert 0.9 < report["recall_at_k"] <= 1.0
    assert main(["models", "accuracy", "text_embedding", "--precision", "int4"]) == 2
    assert "--precision 'int4'" in capsys.readouterr().err
