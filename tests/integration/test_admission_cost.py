"""Cost-aware admission behind the real server (BC-28, issue 20 item 1), with real clients.

* ``text_embedding`` (the default repository's model): a 2 MB text gets 200 and the embedding
  of its truncation, while neither the admission step nor the instance's CPU stage ever
  tokenises more than the documented prefix (instrumented tokenizers, no timing asserts); a
  short request sent meanwhile answers normally; ``/v1/embeddings`` takes its usage from the
  admission cost (``count_tokens`` is not called).
* ``hf_trunc`` / ``hf_strict`` (the huggingface backend, ``max_length: 64``): truncation is the
  same alone and in a list; without truncation exactly 64 tokens pass, 65 fail naming both
  numbers, only the too-long requests of a batch fail, and a 2 MB text is refused at once.
* ``admit_fail``: a python model whose ``admit`` raises for marked rows: only those requests
  fail (400 / 500, over HTTP and gRPC); the others are batched and served together.
* ``no_step``: a model without a step behaves as before.
"""

from __future__ import annotations

import textwrap
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from gpuserve.config.server import default_model_repository
from gpuserve.text.truncation import CAP_CHARS_PER_TOKEN
from tests.fixtures.hf_models import minilm_dir
from tests.helpers import InProcessServer, wait_until

ADMIT_FAIL = """
import numpy as np

from gpuserve.backends.base import Admitted
from gpuserve.backends.python import PythonModel
from gpuserve.errors import InvalidInputError


class Model(PythonModel):
    def admit(self, inputs):
        texts = inputs["TEXT"].reshape(-1)
        if b"bad-admit" in texts:
            raise InvalidInputError("input 'TEXT': the admission step refuses 'bad-admit'")
        if b"crash-admit" in texts:
            raise RuntimeError("the admission step crashed")
        return Admitted(tuple(len(t) for t in texts))

    def forward(self, batch):
        rows = batch["TEXT"].shape[0]
        return {"BATCH": np.full((rows, 1), rows, dtype=np.int32)}
"""

NO_STEP = """
import numpy as np

from gpuserve.backends.python import PythonModel


class Model(PythonModel):
    def forward(self, batch):
        lengths = [len(t) for t in batch["TEXT"].reshape(-1)]
        return {"LEN": np.array(lengths, dtype=np.int32).reshape(-1, 1)}
"""


def python_model(repository: Path, name: str, source: str, output: str, delay_us: int) -> None:
    (repository / name / "1").mkdir(parents=True)
    (repository / name / "1" / "model.py").write_text(source)
    (repository / name / "config.yaml").write_text(
        textwrap.dedent(
            f"""\
            backend: python
            max_batch_size: 8
            inputs: [{{name: TEXT, datatype: BYTES, shape: [1]}}]
            outputs: [{{name: {output}, datatype: INT32, shape: [1]}}]
            dynamic_batching: {{max_queue_delay_us: {delay_us}}}
            instance_group: [{{count: 1, kind: cpu}}]
            """
        )
    )


def hf_model(repository: Path, name: str, truncation: bool) -> None:
    (repository / name / "1").mkdir(parents=True)
    (repository / name / "1" / "README.txt").write_text("weights: huggingface.model_dir\n")
    (repository / name / "config.yaml").write_text(
        "backend: huggingface\n"
        "max_batch_size: 8\n"
        "dynamic_batching: {max_queue_delay_us: 50000}\n"
        "instance_group: [{kind: cpu}]\n"
        f"huggingface: {{task: feature-extraction, max_length: 64, "
        f"truncation: {str(truncation).lower()}, model_dir: '{minilm_dir()}'}}\n"
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("admission_repository")
    source = default_model_repository() / "text_embedding"
    (repository / "text_embedding" / "1").mkdir(parents=True)
    (repository / "text_embedding" / "config.yaml").write_text((source / "config.yaml").read_text())
    (repository / "text_embedding" / "1" / "model.py").write_text(
        (source / "1" / "model.py").read_text()
    )
    python_model(repository, "admit_fail", ADMIT_FAIL, "BATCH", 1_000_000)
    python_model(repository, "no_step", NO_STEP, "LEN", 0)
    has_transformers = True
    try:
        import transformers  # noqa: F401
    except ImportError:
        has_transformers = False
    if has_transformers:
        hf_model(repository, "hf_trunc", truncation=True)
        hf_model(repository, "hf_strict", truncation=False)
    running = InProcessServer(repository)
    running.has_transformers = has_transformers  # type: ignore[attr-defined]
    yield running
    running.stop()


class Recorder:
    """Delegates to a tokenizer and records the characters of each text it tokenises."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.chars: list[int] = []

    def encode_batch(self, texts, *args, **kwargs):
        self.chars.extend(map(len, texts))
        return self.inner.encode_batch(texts, *args, **kwargs)

    def encode_batch_fast(self, texts, *args, **kwargs):
        self.chars.extend(map(len, texts))
        return self.inner.encode_batch_fast(texts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def backend_of(server, model: str):
    scheduler = server.manager.models[model].route.default.runner
    return scheduler.instances[0].backend


def infer(url: str, model: str, texts: list[str], timeout: float = 60.0) -> httpx.Response:
    body = {
        "inputs": [{"name": "TEXT", "shape": [len(texts), 1], "datatype": "BYTES", "data": texts}]
    }
    return httpx.post(f"{url}/v2/models/{model}/infer", json=body, timeout=timeout)


def output(response: httpx.Response, name: str) -> np.ndarray:
    assert response.status_code == 200, response.text
    out = next(o for o in response.json()["outputs"] if o["name"] == name)
    return np.asarray(out["data"]).reshape(out["shape"])


def huge_text(size: int = 2_100_000) -> str:
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "the",
        "lazy",
        "dog",
        "while",
        "gpuserve",
        "serves",
        "it",
    ]
    return " ".join(words[i % len(words)] for i in range(size // 4))[:size]


def test_bc28_a_2mb_text_is_cut_before_tokenisation_and_a_short_one_is_not_held_up(server):
    embedder = backend_of(server, "text_embedding").model.embedder
    stage = Recorder(embedder.tokenizer)
    truncator = embedder.truncator()
    admission = Recorder(truncator.tokenizer)
    embedder.tokenizer, truncator.tokenizer = stage, admission
    try:
        text = huge_text()
        solo_started = time.monotonic()
        assert infer(server.url, "text_embedding", ["a short one"]).status_code == 200
        solo_s = time.monotonic() - solo_started
        result: dict[str, object] = {}

        def send_huge() -> None:
            started = time.monotonic()
            result["response"] = infer(server.url, "text_embedding", [text])
            result["seconds"] = time.monotonic() - started

        admitted_before = len(admission.chars)
        sender = threading.Thread(target=send_huge)
        sender.start()
        # the short one goes once the 2 MB request is in the server (at its admission step)
        wait_until(
            lambda: len(admission.chars) > admitted_before or not sender.is_alive(),
            deadline_s=30,
            what="the 2 MB request reached the admission step",
        )
        short_started = time.monotonic()
        short = infer(server.url, "text_embedding", ["a short one"])
        short_s = time.monotonic() - short_started
        sender.join(60)
    finally:
        embedder.tokenizer, truncator.tokenizer = stage.inner, admission.inner
    huge = result["response"]
    assert isinstance(huge, httpx.Response)
    got = output(huge, "EMBEDDING")
    assert output(short, "EMBEDDING").shape == (1, 384)
    cap = embedder.max_seq_len * CAP_CHARS_PER_TOKEN
    assert max(admission.chars) <= cap  # the admission step read a bounded prefix
    assert max(stage.chars) <= cap  # and the CPU stage tokenised only the cut text
    # The embedding is that of the truncated text: a prefix with the same 256 tokens.
    prefix = text[:4000].rsplit(" ", 1)[0]
    same = output(infer(server.url, "text_embedding", [prefix]), "EMBEDDING")
    np.testing.assert_allclose(got, same, atol=1e-5)
    print(
        f"BC-28 text_embedding: solo {solo_s * 1e3:.0f} ms, short beside 2 MB "
        f"{short_s * 1e3:.0f} ms, 2 MB request {float(result['seconds']) * 1e3:.0f} ms"
    )


def test_embeddings_usage_comes_from_the_admission_cost(server):
    model = backend_of(server, "text_embedding").model
    called: list[int] = []

    def spy(texts):
        called.append(len(texts))
        return [0] * len(texts)

    model.count_tokens = spy
    try:
        response = httpx.post(
            f"{server.url}/v1/embeddings",
            json={"model": "text_embedding", "input": [huge_text(), "hello world"]},
            timeout=60.0,
        )
    finally:
        del model.count_tokens
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 256 + 4
    assert called == []


def test_a_failing_step_fails_only_its_request_and_the_others_batch_together(server):
    texts = ["good one", "bad-admit", "good two", "crash-admit"]
    responses: dict[str, httpx.Response] = {}
    start = threading.Barrier(len(texts))

    def send(text: str) -> None:
        start.wait(10)
        responses[text] = infer(server.url, "admit_fail", [text])

    threads = [threading.Thread(target=send, args=(t,)) for t in texts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert responses["bad-admit"].status_code == 400
    assert "refuses 'bad-admit'" in responses["bad-admit"].json()["error"]
    assert responses["crash-admit"].status_code == 500
    assert "admission step failed" in responses["crash-admit"].json()["error"]
    batch = [int(output(responses[t], "BATCH")[0, 0]) for t in ("good one", "good two")]
    assert batch == [2, 2]  # served in one batch (1 s window)
    assert int(output(infer(server.url, "admit_fail", ["after"]), "BATCH")[0, 0]) == 1


def test_a_failing_step_over_grpc_is_invalid_argument(server):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(server.grpc_url)
    tensor = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[b"bad-admit"]], dtype=object))
    with pytest.raises(InferenceServerException) as raised:
        client.infer("admit_fail", [tensor])
    assert "INVALID_ARGUMENT" in str(raised.value.status())
    assert "refuses 'bad-admit'" in raised.value.message()
    tensor.set_data_from_numpy(np.array([[huge_text().encode()]], dtype=object))
    result = client.infer("text_embedding", [tensor])
    assert result.as_numpy("EMBEDDING").shape == (1, 384)
    client.close()


def test_a_model_without_a_step_is_served_as_before(server):
    assert output(infer(server.url, "no_step", ["abc", "hello"]), "LEN").tolist() == [[3], [5]]


def needs_transformers(server) -> None:
    if not server.has_transformers:
        pytest.skip("transformers is not installed (pip install 'gpuserve[huggingface]')")


def words(count: int) -> str:
    """A text of ``count`` tokens for the MiniLM tokenizer (one per word)."""
    return " ".join(["word"] * count)


def test_bc28_hf_truncation_is_the_same_alone_and_in_a_list(server):
    needs_transformers(server)
    long_a = words(62) + " apple" * 700  # 806+ tokens
    long_b = words(62) + " banana" * 5
    alone = output(infer(server.url, "hf_trunc", [long_a]), "EMBEDDING")
    np.testing.assert_allclose(
        alone, output(infer(server.url, "hf_trunc", [long_b]), "EMBEDDING"), atol=1e-5
    )
    short = "a short sentence"
    mixed = output(infer(server.url, "hf_trunc", [short, long_a, short]), "EMBEDDING")
    solo_short = output(infer(server.url, "hf_trunc", [short]), "EMBEDDING")
    np.testing.assert_allclose(mixed[1:2], alone, atol=1e-5)
    np.testing.assert_allclose(mixed[0:1], solo_short, atol=1e-5)
    np.testing.assert_allclose(mixed[2:3], solo_short, atol=1e-5)
    started = time.monotonic()
    huge = output(infer(server.url, "hf_trunc", [huge_text()]), "EMBEDDING")
    print(f"BC-28 hf_trunc: 2 MB text answered in {(time.monotonic() - started) * 1e3:.0f} ms")
    assert huge.shape == (1, 384)


def test_bc28_hf_strict_refuses_only_the_long_rows_with_their_numbers(server):
    needs_transformers(server)
    assert infer(server.url, "hf_strict", [words(62)]).status_code == 200  # 64 with CLS/SEP
    over = infer(server.url, "hf_strict", [words(63)])
    assert over.status_code == 400
    assert "65 tokens, more than max_length 64" in over.json()["error"]
    texts = [words(10), words(80), words(20), words(63), words(5), words(30)]
    responses: dict[int, httpx.Response] = {}

    def send(index: int) -> None:
        responses[index] = infer(server.url, "hf_strict", [texts[index]])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(texts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert {i: r.status_code for i, r in responses.items()} == {
        0: 200,
        1: 400,
        2: 200,
        3: 400,
        4: 200,
        5: 200,
    }
    huge = infer(server.url, "hf_strict", [huge_text()])
    assert huge.status_code == 400
    assert "more than max_length 64 tokens" in huge.json()["error"]


def test_text_that_is_not_utf8_is_refused_naming_the_row_and_byte(server):
    """Binary BYTES (tritonclient over HTTP and gRPC) carry any bytes: a text model refuses
    a row that is not UTF-8 with 400 / INVALID_ARGUMENT instead of embedding what is left of
    it; only that request fails."""
    httpclient = pytest.importorskip("tritonclient.http")
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    rows = np.array([[b"fine text"], [b"broken \xff\xfe text"]], dtype=object)
    models = ["text_embedding"] + (["hf_trunc"] if server.has_transformers else [])
    http = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    for model in models:
        for client, module in ((http, httpclient), (grpc, grpcclient)):
            tensor = module.InferInput("TEXT", [2, 1], "BYTES")
            if module is httpclient:
                tensor.set_data_from_numpy(rows, binary_data=True)
            else:
                tensor.set_data_from_numpy(rows)
            with pytest.raises(InferenceServerException) as raised:
                client.infer(model, [tensor])
            message = raised.value.message()
            assert "input 'TEXT' row 1 is not valid UTF-8 (byte 0xff at offset 7" in message
            assert str(raised.value.status()) in ("400", "StatusCode.INVALID_ARGUMENT")
            tensor = module.InferInput("TEXT", [1, 1], "BYTES")
            tensor.set_data_from_numpy(rows[:1])
            answer = client.infer(model, [tensor]).get_response()
            outputs = answer["outputs"] if isinstance(answer, dict) else answer.outputs
            assert len(outputs) >= 1
    http.close()
    grpc.close()
