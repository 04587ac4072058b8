"""The OpenAI-compatible embeddings API (issue 17) with the official ``openai`` client,
unchanged, against a real server (``base_url=http://127.0.0.1:PORT/v1``).

One server holds the default repository's ``text_embedding`` (copied as it ships), a
Matryoshka variant of it, the huggingface backend on the same MiniLM folder (automatic opt-in),
a small python model that takes text or token ids (to see splitting, ordering and counting),
a slow model with a queue of one (429), a model that fails to load (503) and one that serves
no embeddings (404). Embeddings are compared with sentence-transformers when it is installed,
else with gpuserve's own V2 answer and an in-process ``SentenceEmbedder``.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import shutil
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

from gpuserve.config import default_model_repository
from gpuserve.models.sentence_embedding import SentenceEmbedder
from tests.fixtures.hf_models import minilm_dir
from tests.helpers import InProcessServer, wait_queue, wait_until

openai = pytest.importorskip("openai")

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A GPU inference server batches requests to keep the device busy.",
    "Paris is the capital of France.",
    "Ünïcödé text with émojis 🚀 and 中文字符.",
]
LONG = "tokens " * 600  # past max_seq_len (256): truncated

IDS_MODEL = """
import numpy as np
from gpuserve.backends.python import PythonModel


class Model(PythonModel):
    def load(self, context):
        self.batches = []

    def forward(self, inputs):
        if "IDS" in inputs:
            ids = inputs["IDS"]
            self.batches.append(("IDS", ids.shape[0]))
            rows = [[r.shape[0], r.sum(), r[0], 1.0] for r in ids]
        else:
            texts = [t[0].decode() for t in inputs["TEXT"]]
            self.batches.append(("TEXT", len(texts)))
            rows = [[len(t), t.count(" "), 0.0, 2.0] for t in texts]
        return {"EMBEDDING": np.array(rows, dtype=np.float32)}

    def count_tokens(self, texts):
        return [len(t.split()) for t in texts]
"""
IDS_CONFIG = """
backend: python
max_batch_size: 4
inputs:
  - {name: TEXT, datatype: BYTES, shape: [1], optional: true}
  - {name: IDS, datatype: INT64, shape: [-1], optional: true}
outputs:
  - {name: EMBEDDING, datatype: FP32, shape: [4]}
dynamic_batching: {max_queue_delay_us: 100000, early_dispatch: false}
instance_group: [{kind: cpu}]
embedding: {text_input: TEXT, token_ids_input: IDS, dimensions: [2], normalize_truncated: false}
"""
SLOW_MODEL = """
import time
import numpy as np
from gpuserve.backends.python import PythonModel


class Model(PythonModel):
    def forward(self, inputs):
        time.sleep(0.5)
        return {"EMBEDDING": np.ones((inputs["TEXT"].shape[0], 2), dtype=np.float32)}
"""
SLOW_CONFIG = """
backend: python
max_batch_size: 1
inputs: [{name: TEXT, datatype: BYTES, shape: [1]}]
outputs: [{name: EMBEDDING, datatype: FP32, shape: [2]}]
dynamic_batching: {max_queue_size: 1}
instance_group: [{kind: cpu}]
embedding: {token_counts: none}
"""
BROKEN_MODEL = """
from gpuserve.backends.python import PythonModel


class Model(PythonModel):
    def load(self, context):
        raise RuntimeError("this model never loads")
"""
PLAIN_MODEL = """
from gpuserve.backends.python import PythonModel


class Model(PythonModel):
    def forward(self, inputs):
        return {"Y": inputs["X"]}
"""
PLAIN_CONFIG = """
backend: python
inputs: [{name: X, datatype: FP32, shape: [2]}]
outputs: [{name: Y, datatype: FP32, shape: [2]}]
instance_group: [{kind: cpu}]
"""


def write_model(root: Path, name: str, config: str, model: str) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.yaml").write_text(config)
    (root / name / "1" / "model.py").write_text(model)


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("openai_repository")
    source = default_model_repository() / "text_embedding"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(source, root / "text_embedding", ignore=ignore)
    shutil.copytree(source, root / "matryoshka", ignore=ignore)
    config = (root / "matryoshka" / "config.yaml").read_text()
    (root / "matryoshka" / "config.yaml").write_text(
        config.replace("embedding:\n", "embedding:\n  dimensions: [128, 64]\n")
    )
    write_model(root, "ids_model", IDS_CONFIG, IDS_MODEL)
    # A 1 s batching window: a V2 and an OpenAI request sent one after the other meet in it.
    write_model(root, "mixer", IDS_CONFIG.replace("100000", "1000000"), IDS_MODEL)
    write_model(root, "slow", SLOW_CONFIG, SLOW_MODEL)
    write_model(root, "broken", SLOW_CONFIG, BROKEN_MODEL)
    write_model(root, "plain", PLAIN_CONFIG, PLAIN_MODEL)
    (root / "hf_minilm" / "1").mkdir(parents=True)
    (root / "hf_minilm" / "1" / "README.txt").write_text("weights: huggingface.model_dir\n")
    (root / "hf_minilm" / "config.yaml").write_text(
        "backend: huggingface\nmax_batch_size: 16\ninstance_group: [{kind: cpu}]\n"
        f"huggingface: {{task: feature-extraction, model_dir: '{minilm_dir()}'}}\n"
    )
    return root


@pytest.fixture(scope="module")
def server(repository):
    running = InProcessServer(repository)
    yield running
    running.stop()


@pytest.fixture()
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def embedder() -> SentenceEmbedder:
    return SentenceEmbedder.load()


@pytest.fixture(scope="module")
def reference(embedder) -> np.ndarray:
    """sentence-transformers' embeddings of SENTENCES when installed, else gpuserve's own
    in-process SentenceEmbedder (itself checked against sentence-transformers elsewhere)."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return embedder.encode(SENTENCES)
    model = SentenceTransformer(str(minilm_dir()), device="cpu")
    return model.encode(SENTENCES, convert_to_numpy=True, normalize_embeddings=True)


def vectors(response) -> np.ndarray:
    assert [item.index for item in response.data] == list(range(len(response.data)))
    return np.array([item.embedding for item in response.data], dtype=np.float32)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def v2_embeddings(server, model: str, texts: list[str]) -> np.ndarray:
    body = {
        "inputs": [{"name": "TEXT", "shape": [len(texts), 1], "datatype": "BYTES", "data": texts}]
    }
    response = httpx.post(f"{server.url}/v2/models/{model}/infer", json=body, timeout=60)
    assert response.status_code == 200, response.text
    out = response.json()["outputs"][0]
    return np.array(out["data"], dtype=np.float32).reshape(out["shape"])


def loaded_model(server, model: str):
    """The ``Model`` object of a python fixture model, through the backend's wrappers."""
    backend = server.manager.runner(model, None).instances[0].backend
    for _ in range(3):
        if hasattr(backend, "batches"):
            return backend
        backend = getattr(backend, "impl", None) or getattr(backend, "model", None)
    raise AssertionError(f"no Model object found for {model}")


def stats(server, model: str) -> dict:
    body = httpx.get(f"{server.url}/v2/models/{model}/stats", timeout=10).json()
    return body["model_stats"][0]


# -- embeddings ----------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["text_embedding", "hf_minilm"])
def test_embeddings_match_the_reference_and_v2(client, server, reference, model):
    listed = client.embeddings.create(model=model, input=SENTENCES, encoding_format="float")
    assert listed.object == "list" and listed.model == model
    got = vectors(listed)
    assert got.shape == (len(SENTENCES), 384)
    assert cosine(got, reference).min() >= 0.9999
    np.testing.assert_allclose(got, v2_embeddings(server, model, SENTENCES), atol=1e-6)
    single = client.embeddings.create(model=model, input=SENTENCES[1], encoding_format="float")
    assert len(single.data) == 1
    assert cosine(vectors(single), reference[1:2]).min() >= 0.9999


def test_base64_decodes_to_the_float_answer(client):
    floats = vectors(
        client.embeddings.create(model="text_embedding", input=SENTENCES, encoding_format="float")
    )
    # The client asks for base64 when no format is given, and decodes it itself.
    implicit = vectors(client.embeddings.create(model="text_embedding", input=SENTENCES))
    np.testing.assert_array_equal(implicit, floats)
    raw = client.embeddings.with_raw_response.create(
        model="text_embedding", input=SENTENCES, encoding_format="base64"
    )
    for item, expected in zip(raw.http_response.json()["data"], floats, strict=True):
        assert isinstance(item["embedding"], str)  # little-endian float32 bytes, base64
        decoded = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, expected)


@pytest.mark.parametrize("model", ["text_embedding", "hf_minilm"])
def test_usage_counts_the_tokens_the_model_embedded(client, embedder, model):
    texts = [*SENTENCES, LONG]
    response = client.embeddings.create(model=model, input=texts, encoding_format="float")
    per_text = embedder.tokenize(texts).attention_mask.sum(dim=1).tolist()
    assert per_text[-1] == 256  # truncated to max_seq_len, as embedded
    assert response.usage.prompt_tokens == sum(per_text)
    assert response.usage.total_tokens == sum(per_text)


def test_a_long_call_is_split_at_max_batch_size_and_answers_in_input_order(client, server):
    texts = [" ".join(["w"] * (i % 5 + 1)) + "x" * i for i in range(10)]  # max_batch_size 4
    before = stats(server, "ids_model")
    response = client.embeddings.create(model="ids_model", input=texts, encoding_format="float")
    got = vectors(response)
    np.testing.assert_array_equal(got[:, 0], [len(t) for t in texts])  # each row its own
    after = stats(server, "ids_model")
    assert after["inference_count"] - before["inference_count"] == 10  # rows
    assert max(rows for _, rows in loaded_model(server, "ids_model").batches) <= 4
    assert response.usage.prompt_tokens == sum(len(t.split()) for t in texts)  # count_tokens


def test_token_id_inputs_where_the_model_takes_them(client):
    rows = [[5, 6, 7], [1], [2, 3, 4], [9, 9]]
    response = client.embeddings.create(model="ids_model", input=rows, encoding_format="float")
    got = vectors(response)
    np.testing.assert_array_equal(got[:, :3], [[len(r), sum(r), r[0]] for r in rows])
    assert response.usage.prompt_tokens == sum(map(len, rows))
    one = client.embeddings.create(model="ids_model", input=[4, 5], encoding_format="float")
    np.testing.assert_array_equal(vectors(one)[0, :3], [2, 9, 4])
    with pytest.raises(openai.BadRequestError, match="takes text, not token ids"):
        client.embeddings.create(model="text_embedding", input=[[1, 2]])


def test_dimensions_cut_and_renormalise_where_the_model_allows_it(client):
    full = vectors(
        client.embeddings.create(model="matryoshka", input=SENTENCES, encoding_format="float")
    )
    cut = vectors(
        client.embeddings.create(
            model="matryoshka", input=SENTENCES, dimensions=64, encoding_format="float"
        )
    )
    assert cut.shape == (len(SENTENCES), 64)
    np.testing.assert_allclose(np.linalg.norm(cut, axis=1), 1.0, rtol=1e-5)
    expected = full[:, :64] / np.linalg.norm(full[:, :64], axis=1, keepdims=True)
    np.testing.assert_allclose(cut, expected, atol=1e-6)
    as_is = client.embeddings.create(
        model="ids_model", input=["a b"], dimensions=2, encoding_format="float"
    )
    assert vectors(as_is).tolist() == [[3.0, 1.0]]  # normalize_truncated: false
    with pytest.raises(openai.BadRequestError, match="supports dimensions"):
        client.embeddings.create(model="matryoshka", input="x", dimensions=100)
    with pytest.raises(openai.BadRequestError, match="'text_embedding' does not support"):
        client.embeddings.create(model="text_embedding", input="x", dimensions=64)


# -- batching, metrics, access log ---------------------------------------------------------


def test_64_concurrent_calls_are_batched(server):
    before = stats(server, "text_embedding")

    async def main() -> list:
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0
        ) as aclient:
            calls = [
                aclient.embeddings.create(model="text_embedding", input=f"sentence {i} " * 8)
                for i in range(64)
            ]
            return await asyncio.gather(*calls)

    answers = asyncio.run(main())
    assert all(len(answer.data) == 1 for answer in answers)
    after = stats(server, "text_embedding")
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == 64
    assert executions < inferences


def test_openai_and_v2_requests_share_a_batch(client, server):
    before = stats(server, "mixer")
    v2 = {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["v two"]}]}
    answers: dict[str, object] = {}
    thread = threading.Thread(
        target=lambda: answers.update(
            v2=httpx.post(f"{server.url}/v2/models/mixer/infer", json=v2, timeout=30)
        )
    )
    thread.start()
    wait_queue(server.url, "mixer", queued=1)  # the V2 request waits out its 1 s window
    one = client.embeddings.create(model="mixer", input="open ai", encoding_format="float")
    thread.join(30)
    assert answers["v2"].status_code == 200
    assert vectors(one).tolist() == [[7.0, 1.0, 0.0, 2.0]]
    after = stats(server, "mixer")
    assert after["inference_count"] - before["inference_count"] == 2
    assert after["execution_count"] - before["execution_count"] == 1


def test_metrics_count_each_chunk_with_its_rows(client, server):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        found = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = sample.labels
                if labels.get("model") == "ids_model" and labels.get("outcome", "success") in (
                    "success"
                ):
                    found[sample.name] = found.get(sample.name, 0.0) + sample.value
        return found

    before = scrape()
    client.embeddings.create(model="ids_model", input=["a"] * 10, encoding_format="float")
    after = scrape()
    assert after["gpuserve_requests_total"] - before["gpuserve_requests_total"] == 3  # 4+3+3
    rows = after["gpuserve_inference_rows_total"] - before["gpuserve_inference_rows_total"]
    assert rows == 10


def test_access_log_line_shows_the_openai_path(client, server, caplog):
    api = server.server.app.openai
    api.access_log = True
    try:
        with caplog.at_level(logging.INFO, logger="gpuserve.access"):
            client.embeddings.create(model="ids_model", input=["a", "b c"])
            with pytest.raises(openai.NotFoundError):
                client.embeddings.create(model="nope", input="x")
            client.models.list()

            def access_records() -> list:
                return [r for r in caplog.records if r.name == "gpuserve.access"]

            # each line is written just after its answer is sent: wait for the last one
            wait_until(lambda: len(access_records()) >= 3, 10, "three access lines")
    finally:
        api.access_log = False
    records = access_records()
    ok, missing, listing = records[-3:]
    assert (ok.method, ok.path, ok.status, ok.model, ok.version, ok.rows) == (
        "POST",
        "/v1/embeddings",
        200,
        "ids_model",
        "1",
        2,
    )
    assert ok.shapes == {"TEXT": [2]}
    assert (missing.path, missing.status, missing.model) == ("/v1/embeddings", 404, "nope")
    assert (listing.method, listing.path, listing.status) == ("GET", "/v1/models", 200)


# -- models --------------------------------------------------------------------------------


def test_models_lists_the_models_serving_embeddings(client):
    listed = {model.id: model for model in client.models.list()}
    serving = {"text_embedding", "matryoshka", "hf_minilm", "ids_model", "mixer", "slow"}
    assert set(listed) == serving  # not 'plain' (no embeddings), not 'broken' (not ready)
    assert all(m.object == "model" and m.owned_by == "gpuserve" for m in listed.values())
    assert all(m.created > 1_600_000_000 for m in listed.values())
    one = client.models.retrieve("text_embedding")
    assert (one.id, one.object) == ("text_embedding", "model")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("plain")  # serves no embeddings
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


# -- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "param", "match"),
    [
        ({"input": []}, "input", "'input' is empty"),
        ({"input": ""}, "input", "empty string"),
        ({"input": ["fine", 3]}, "input", r"input\[1\] must be a string"),
        ({"input": [["x"]]}, "input", "integer token ids"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format", "'float' or 'base64'"),
        ({"input": "x", "dimensions": 0}, "dimensions", "positive integer"),
    ],
)
def test_invalid_input_is_a_bad_request_in_openais_schema(client, kwargs, param, match):
    with pytest.raises(openai.BadRequestError, match=match) as caught:
        client.embeddings.create(model="text_embedding", **kwargs)
    error = caught.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert caught.value.status_code == 400


def test_unknown_or_non_embedding_model_is_not_found(client):
    for model in ("nope", "plain"):
        with pytest.raises(openai.NotFoundError) as caught:
            client.embeddings.create(model=model, input="x")
        assert caught.value.code == "model_not_found"
        assert "text_embedding" in caught.value.message  # names the models that serve


def test_too_many_inputs_is_413(client):
    with pytest.raises(openai.APIStatusError) as caught:
        client.embeddings.create(model="ids_model", input=["x"] * 2049)
    assert caught.value.status_code == 413
    assert caught.value.code == "request_too_large"


def test_a_full_queue_is_429_with_retry_after(server, client):
    results: list = []

    def call(text: str) -> None:
        results.append(client.embeddings.create(model="slow", input=text))

    first = threading.Thread(target=call, args=("one",))
    first.start()
    wait_queue(server.url, "slow", executing=1)
    second = threading.Thread(target=call, args=("two",))
    second.start()
    wait_queue(server.url, "slow", queued=1)
    with pytest.raises(openai.RateLimitError) as caught:
        client.embeddings.create(model="slow", input="three")
    assert int(caught.value.response.headers["retry-after"]) >= 1
    assert caught.value.code == "rate_limit_exceeded"
    first.join(30)
    second.join(30)
    assert len(results) == 2
    assert all(r.usage.prompt_tokens == 0 for r in results)  # token_counts: none


def test_a_model_that_is_not_ready_is_503(client):
    with pytest.raises(openai.InternalServerError) as caught:
        client.embeddings.create(model="broken", input="x")
    assert caught.value.status_code == 503
    assert caught.value.response.json()["error"]["type"] == "server_error"


def test_unknown_paths_and_methods(server):
    missing = httpx.get(f"{server.url}/v1/audio/speech", timeout=10)
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "Invalid URL (GET /v1/audio/speech)"
    for path in ("/v1/embeddings", "/v1/completions", "/v1/chat/completions"):
        wrong = httpx.get(f"{server.url}{path}", timeout=10)
        assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
    bad_json = httpx.post(f"{server.url}/v1/embeddings", content=b"{", timeout=10)
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    for method in ("POST", "PUT", "DELETE", "PATCH"):  # an unknown path is 404 whatever the method
        other = httpx.request(method, f"{server.url}/v1/audio/speech", timeout=10)
        assert other.status_code == 404, method
        assert other.json() == {
            "error": {
                "message": f"Invalid URL ({method} /v1/audio/speech)",
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            }
        }


def test_chat_completions_of_an_embedding_model_is_a_bad_request(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="ids_model", messages=[{"role": "user", "content": "hello"}]
        )
    assert caught.value.status_code == 400
    assert "model 'ids_model' does not generate text" in caught.value.message


@pytest.fixture(scope="module")
def token_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("openai_token_repository")
    write_model(root, "ids_model", IDS_CONFIG, IDS_MODEL)
    running = InProcessServer(root, api_token="s3cret")
    yield running
    running.stop()


def test_the_api_token_guards_every_v1_endpoint(token_server):
    url = f"{token_server.url}/v1"
    with openai.OpenAI(base_url=url, api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError) as caught:
            wrong.embeddings.create(model="ids_model", input="a b")
        assert caught.value.code == "invalid_api_key"
        assert caught.value.response.headers["www-authenticate"] == "Bearer"
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
    with openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0) as right:
        assert right.embeddings.create(model="ids_model", input="a b").usage.prompt_tokens == 2
        assert [m.id for m in right.models.list()] == ["ids_model"]


def test_transport_refusals_on_openai_paths_use_openai_error_shape(server):
    """A body over max_request_body_bytes is refused by the HTTP transport before any
    handler runs; on /v1/ paths the answer still has OpenAI's error fields."""
    import socket

    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 999999999999\r\n\r\n"
        )
        raw = b""
        while b"\r\n\r\n" not in raw or not raw.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    error = __import__("json").loads(body)["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert "max_request_body_bytes" in error["message"]
