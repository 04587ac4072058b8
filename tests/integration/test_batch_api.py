"""OpenAI's Files and Batch API against the real server, with the ``openai`` client unchanged:
upload, create, poll, download, cancel and list, for embeddings (the default repository's
``text_embedding``), chat completions and completions (the tiny chat model) and rerank (a
python reranker), each line equal to the live call's answer; malformed lines, limits, ids
that try to leave the state directory, the API token, expiry of the completion window and of
stored files; a graceful stop that resumes; and a crash test: a job killed with SIGKILL three
times at random points and restarted holds every ``custom_id`` exactly once, with the values of
a clean run.

Every wait polls with a deadline.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from gpuserve.config import default_model_repository
from tests.fixtures.chat_models import write_tiny_chat
from tests.helpers import InProcessServer, SubprocessServer

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")  # the tiny chat model's tokenizer

FINAL = ("completed", "failed", "expired", "cancelled")
TOKEN = "batch-secret"

#: An embedding model whose vectors depend on the text alone (deterministic), taking
#: ``DELAY_S`` per batch of at most ``max_batch_size`` rows.
HASH_MODEL = """
import time, zlib
import numpy as np
from gpuserve.backends.python import PythonModel

DELAY_S = {delay}


class Model(PythonModel):
    def forward(self, inputs):
        time.sleep(DELAY_S)
        rows = [
            np.random.default_rng(zlib.crc32(t[0])).standard_normal(16) for t in inputs["TEXT"]
        ]
        return {{"EMBEDDING": np.array(rows, dtype=np.float32)}}
"""
HASH_CONFIG = """
backend: python
max_batch_size: {batch}
inputs: [{{name: TEXT, datatype: BYTES, shape: [1]}}]
outputs: [{{name: EMBEDDING, datatype: FP32, shape: [16]}}]
dynamic_batching: {{priority_levels: 2}}
instance_group: [{{kind: cpu}}]
embedding: {{token_counts: none}}
"""


#: A reranker whose score is the number of words a passage shares with the query.
OVERLAP_MODEL = """
import numpy as np
from gpuserve.backends.python import PythonModel


class Model(PythonModel):
    def forward(self, inputs):
        pairs = zip(inputs["TEXT"][:, 0], inputs["TEXT_PAIR"][:, 0], strict=True)
        scores = [len(set(q.split()) & set(p.split())) for q, p in pairs]
        return {"LOGITS": np.array(scores, dtype=np.float32).reshape(-1, 1)}
"""
OVERLAP_CONFIG = """
backend: python
max_batch_size: 8
inputs:
  - {name: TEXT, datatype: BYTES, shape: [1]}
  - {name: TEXT_PAIR, datatype: BYTES, shape: [1]}
outputs: [{name: LOGITS, datatype: FP32, shape: [1]}]
instance_group: [{kind: cpu}]
rerank: {}
"""


def write_hash_model(root: Path, name: str, delay_s: float, batch: int) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.yaml").write_text(HASH_CONFIG.format(batch=batch))
    (root / name / "1" / "model.py").write_text(HASH_MODEL.format(delay=delay_s))


def jsonl(lines: list[Any]) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def line(custom_id: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def embedding_lines(model: str, count: int, prefix: str = "r") -> list[dict[str, Any]]:
    return [
        line(f"{prefix}{i}", "/v1/embeddings", {"model": model, "input": f"sentence number {i}"})
        for i in range(count)
    ]


def wait_batch(client: Any, batch_id: str, until=None, deadline_s: float = 30.0) -> Any:
    """Poll until the batch is final (or ``until(batch)``); the batch seen last."""
    end = time.monotonic() + deadline_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if (until(batch) if until else batch.status in FINAL) or time.monotonic() > end:
            assert until or batch.status in FINAL, f"batch not final after {deadline_s} s: {batch}"
            return batch
        time.sleep(0.02)


def read_lines(client: Any, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def by_custom_id(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for item in lines:
        assert item["custom_id"] not in found, f"{item['custom_id']} twice"
        found[item["custom_id"]] = item
    return found


def vector(item: dict[str, Any]) -> np.ndarray:
    return np.array(item["response"]["body"]["data"][0]["embedding"], dtype=np.float32)


# -- one server: text_embedding, the tiny chat model, a slow model -------------------------


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("batch_repository")
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(
        default_model_repository() / "text_embedding", root / "text_embedding", ignore=ignore
    )
    write_tiny_chat(root / "chat" / "1")
    (root / "chat" / "config.yaml").write_text(
        "backend: huggingface\n"
        "instance_group: [{kind: cpu}]\n"
        "huggingface: {task: text-generation}\n"
        "generate: {block_size: 8, max_running: 8, max_tokens_per_step: 64,\n"
        "           sampling: {max_tokens: 8, temperature: 0.0}}\n"
    )
    write_hash_model(root, "slow", 0.05, 1)
    (root / "overlap" / "1").mkdir(parents=True)
    (root / "overlap" / "config.yaml").write_text(OVERLAP_CONFIG)
    (root / "overlap" / "1" / "model.py").write_text(OVERLAP_MODEL)
    return root


@pytest.fixture(scope="module")
def server(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    running = InProcessServer(
        repository,
        state_dir=tmp_path_factory.mktemp("batch_state"),
        batch_max_file_bytes=200_000,
        batch_max_lines=300,
    )
    yield running
    running.stop()


@pytest.fixture()
def client(server: Any) -> Iterator[Any]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_embeddings_batch_matches_live_calls(client: Any) -> None:
    texts = ["The quick brown fox.", "Paris is the capital of France.", "Ünïcödé 🚀 中文"]
    lines = [
        line(f"e{i}", "/v1/embeddings", {"model": "text_embedding", "input": text})
        for i, text in enumerate(texts)
    ]
    lines.append(line("pair", "/v1/embeddings", {"model": "text_embedding", "input": texts[:2]}))
    lines.insert(2, "{not json")  # line 3
    lines.append(line("wrong-url", "/v1/chat/completions", {"model": "text_embedding"}))
    lines.append(line("no-model", "/v1/embeddings", {"model": "nowhere", "input": "x"}))
    lines.append("")  # blank: skipped, not counted
    upload = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    assert upload.purpose == "batch" and upload.bytes == len(jsonl(lines))
    assert client.files.retrieve(upload.id).filename == "in.jsonl"

    batch = client.batches.create(
        input_file_id=upload.id,
        endpoint="/v1/embeddings",
        completion_window="24h",
        metadata={"job": "test"},
    )
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "test"}
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.total == 7
    assert (batch.request_counts.completed, batch.request_counts.failed) == (4, 3)
    assert batch.model == "text_embedding" and batch.completed_at is not None

    outputs = by_custom_id(read_lines(client, batch.output_file_id))
    assert set(outputs) == {"e0", "e1", "e2", "pair"}
    live = client.embeddings.create(model="text_embedding", input=texts)
    for i in range(3):
        item = outputs[f"e{i}"]
        assert item["response"]["status_code"] == 200 and item["error"] is None
        assert item["id"].startswith("batch_req_") and item["response"]["request_id"]
        np.testing.assert_allclose(vector(item), live.data[i].embedding, atol=1e-5)
    assert len(outputs["pair"]["response"]["body"]["data"]) == 2

    errors = by_custom_id(read_lines(client, batch.error_file_id))
    assert set(errors) == {None, "wrong-url", "no-model"}
    assert errors[None]["error"]["line"] == 3 and "line 3" in errors[None]["error"]["message"]
    assert errors["wrong-url"]["error"]["line"] == 6
    assert errors["wrong-url"]["response"] is None
    assert errors["no-model"]["response"]["status_code"] == 404
    assert errors["no-model"]["response"]["body"]["error"]["code"] == "model_not_found"


def test_chat_and_completions_batches_match_live_calls(client: Any) -> None:
    questions = ["The quick brown fox?", "Where is Paris?", "Say something."]
    body = {"model": "chat", "max_tokens": 6, "temperature": 0}
    lines = [
        line(
            f"q{i}", "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": q}]}
        )
        for i, q in enumerate(questions)
    ]
    upload = client.files.create(file=("chat.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="1h"
    )
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 3, batch
    answers = by_custom_id(read_lines(client, batch.output_file_id))
    for i, question in enumerate(questions):
        live = client.chat.completions.create(
            messages=[{"role": "user", "content": question}], **body
        )
        answer = answers[f"q{i}"]["response"]["body"]
        assert answer["object"] == "chat.completion"
        assert answer["choices"][0]["message"]["content"] == live.choices[0].message.content

    prompts = [line("c0", "/v1/completions", {**body, "prompt": "Paris is"})]
    prompts.append(line("streamed", "/v1/completions", {**body, "prompt": "x", "stream": True}))
    upload = client.files.create(file=("completions.jsonl", jsonl(prompts)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    batch = wait_batch(client, batch.id)
    live = client.completions.create(prompt="Paris is", **body)
    (done,) = read_lines(client, batch.output_file_id)
    assert done["response"]["body"]["choices"][0]["text"] == live.choices[0].text
    (refused,) = read_lines(client, batch.error_file_id)
    assert refused["response"]["status_code"] == 400
    assert "stream" in refused["response"]["body"]["error"]["message"]


def test_rerank_batch_matches_live_calls(client: Any, server: Any) -> None:
    docs = ["the fox is quick", "a slow dog", "quick brown fox jumps"]
    bodies = [
        {"model": "overlap", "query": "quick brown fox", "documents": docs},
        {"model": "overlap", "query": "slow dog", "documents": docs, "top_n": 1},
    ]
    lines = [line(f"q{i}", "/v1/rerank", body) for i, body in enumerate(bodies)]
    upload = client.files.create(file=("rerank.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/rerank", completion_window="24h"
    )
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 2, batch
    answers = by_custom_id(read_lines(client, batch.output_file_id))
    for i, body in enumerate(bodies):
        live = httpx.post(f"{server.url}/v1/rerank", json=body, timeout=30).json()
        got = answers[f"q{i}"]["response"]["body"]["results"]
        assert got == live["results"] and got[0]["index"] == (2 if i == 0 else 1)


def test_cancel_stops_sending_lines(client: Any) -> None:
    upload = client.files.create(
        file=("slow.jsonl", jsonl(embedding_lines("slow", 200))), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    wait_batch(client, batch.id, lambda b: b.request_counts.completed >= 2)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    batch = wait_batch(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at, batch
    done = by_custom_id(read_lines(client, batch.output_file_id))
    assert len(done) == batch.request_counts.completed < 200
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: as it is


def test_completion_window_expires_the_rest(client: Any) -> None:
    upload = client.files.create(
        file=("late.jsonl", jsonl(embedding_lines("slow", 150))), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="1s"
    )
    assert batch.expires_at == batch.created_at + 1
    batch = wait_batch(client, batch.id)
    assert batch.status == "expired" and batch.expired_at, batch
    done = by_custom_id(read_lines(client, batch.output_file_id))
    expired = by_custom_id(read_lines(client, batch.error_file_id))
    assert set(done) | set(expired) == {f"r{i}" for i in range(150)}
    assert not set(done) & set(expired) and expired
    assert all(item["error"]["code"] == "batch_expired" for item in expired.values())
    counts = batch.request_counts
    assert (counts.completed, counts.failed) == (len(done), len(expired))


def test_lists_page_and_report_storage(client: Any) -> None:
    uploads = [
        client.files.create(
            file=(f"p{i}.jsonl", jsonl(embedding_lines("slow", 1))), purpose="batch"
        )
        for i in range(2)
    ]
    batches = [
        client.batches.create(
            input_file_id=u.id, endpoint="/v1/embeddings", completion_window="24h"
        )
        for u in uploads
    ]
    first = client.batches.list(limit=1)
    assert [b.id for b in first.data] == [batches[1].id] and first.has_more
    second = client.batches.list(limit=1, after=batches[1].id)
    assert [b.id for b in second.data] == [batches[0].id]
    assert {b.id for b in client.batches.list(limit=2).data} == {b.id for b in batches}
    for batch in batches:
        assert wait_batch(client, batch.id).status == "completed"
    with pytest.raises(openai.BadRequestError, match="completed"):
        client.batches.cancel(batches[0].id)

    files = client.files.list(purpose="batch", order="asc")
    ids = [f.id for f in files.data]
    assert ids.index(uploads[0].id) < ids.index(uploads[1].id)
    total = files.model_extra["total_bytes"]
    assert total >= sum(f.bytes for f in client.files.list().data)
    deleted = client.files.delete(uploads[0].id)
    assert deleted.deleted and deleted.id == uploads[0].id
    after = client.files.list().model_extra["total_bytes"]
    assert after == total - uploads[0].bytes
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploads[0].id)


def test_limits_and_ids(client: Any, server: Any) -> None:
    with pytest.raises(openai.APIStatusError, match="batch_max_file_bytes") as big:
        client.files.create(file=("big.jsonl", b"x" * 200_001), purpose="batch")
    assert big.value.status_code == 413
    with pytest.raises(openai.APIStatusError, match="batch_max_lines") as many:
        client.files.create(
            file=("many.jsonl", jsonl(embedding_lines("slow", 301))), purpose="batch"
        )
    assert many.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(
            input_file_id="file-x", endpoint="/v1/embeddings", completion_window="tomorrow"
        )
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(
            input_file_id="file-x", endpoint="/v1/moderations", completion_window="24h"
        )
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file-" + "0" * 24, endpoint="/v1/embeddings", completion_window="24h"
        )
    # ids that would name a path: not found, whatever they hold
    for bad in ("..%2F..%2Fjobs.sqlite3", "file-..", "%2E%2E", "file-" + "a" * 23 + "/"):
        response = httpx.get(f"{server.url}/v1/files/{bad}/content", timeout=10)
        assert response.status_code == 404, (bad, response.text)
    response = httpx.get(f"{server.url}/v1/batches/..%2Fbatches", timeout=10)
    assert response.status_code == 404

    repeated = [*embedding_lines("slow", 2), line("r0", "/v1/embeddings", {"model": "slow"})]
    upload = client.files.create(file=("dup.jsonl", jsonl(repeated)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    batch = wait_batch(client, batch.id)
    assert batch.status == "failed" and batch.failed_at
    assert batch.errors.data[0].code == "duplicate_custom_id" and batch.errors.data[0].line == 3
    with pytest.raises(openai.BadRequestError, match="cancel"):
        running = client.batches.create(
            input_file_id=client.files.create(
                file=("s.jsonl", jsonl(embedding_lines("slow", 100))), purpose="batch"
            ).id,
            endpoint="/v1/embeddings",
            completion_window="24h",
        )
        client.files.delete(running.input_file_id)
    client.batches.cancel(running.id)
    wait_batch(client, running.id)


# -- a graceful stop resumes; the API token; stored files expire -----------------------------


def test_stop_resumes_and_the_api_needs_the_token(tmp_path: Path) -> None:
    repository = tmp_path / "models"
    write_hash_model(repository, "slow", 0.05, 1)
    state = tmp_path / "state"
    settings = {"state_dir": state, "api_token": TOKEN, "batch_concurrent_lines": 2}
    running = InProcessServer(repository, **settings)
    try:
        refused = httpx.get(f"{running.url}/v1/files", timeout=10)
        assert refused.status_code == 401
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key=TOKEN, max_retries=0)
        upload = client.files.create(
            file=("in.jsonl", jsonl(embedding_lines("slow", 40))), purpose="batch"
        )
        batch = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h"
        )
        wait_batch(client, batch.id, lambda b: b.request_counts.completed >= 3)
    finally:
        running.stop()  # as SIGTERM: lines in flight finish, the batch stays in progress
    running = InProcessServer(repository, **settings)
    try:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key=TOKEN, max_retries=0)
        stopped = client.batches.retrieve(batch.id)
        assert stopped.status == "in_progress" and stopped.request_counts.completed < 40
        batch = wait_batch(client, batch.id)
        assert batch.status == "completed" and batch.request_counts.completed == 40
        done = by_custom_id(read_lines(client, batch.output_file_id))
        assert set(done) == {f"r{i}" for i in range(40)}
    finally:
        running.stop()


def test_stored_files_expire(tmp_path: Path) -> None:
    repository = tmp_path / "models"
    write_hash_model(repository, "fast", 0.0, 8)
    running = InProcessServer(repository, state_dir=tmp_path / "state", batch_file_ttl_s=1.0)
    try:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="x", max_retries=0)
        upload = client.files.create(
            file=("in.jsonl", jsonl(embedding_lines("fast", 3))), purpose="batch"
        )
        assert upload.expires_at == upload.created_at + 1
        end = time.monotonic() + 10
        while client.files.list().data:
            assert time.monotonic() < end, "the file did not expire"
            time.sleep(0.05)
        assert client.files.list().model_extra["total_bytes"] == 0
        assert not list((tmp_path / "state" / "files").iterdir())
        metrics = httpx.get(f"{running.url}/metrics", timeout=10).text
        assert "gpuserve_batch_storage_bytes 0.0" in metrics
    finally:
        running.stop()


# -- crash test ------------------------------------------------------------------------------


def test_sigkill_three_times_every_custom_id_once_with_clean_values(tmp_path: Path) -> None:
    repository = tmp_path / "models"
    write_hash_model(repository, "emb", 0.01, 4)
    lines = embedding_lines("emb", 300)
    for i, item in enumerate(lines[::3]):  # every third line embeds two texts
        item["body"]["input"] = [f"first {i}", f"second {i}"]
    args = (
        "--model-repository",
        str(repository),
        "--state-dir",
        str(tmp_path / "state"),
        "--grpc-port",
        "-1",
    )
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    kills = sorted(rng.sample(range(0, 280), 3))  # lines completed when each SIGKILL comes
    server = SubprocessServer(*args)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    upload = client.files.create(file=("crash.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    try:
        for kill in kills:
            wait_batch(
                client,
                batch.id,
                lambda b, k=kill: b.request_counts.completed >= k or b.status in FINAL,
            )
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait(10)
            server = SubprocessServer(*args)
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        crashed = wait_batch(client, batch.id)
        assert crashed.status == "completed", (seed, kills, crashed)
        assert crashed.request_counts.completed == 300 and crashed.request_counts.failed == 0
        clean = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h"
        )
        clean = wait_batch(client, clean.id)
        got = by_custom_id(read_lines(client, crashed.output_file_id))  # asserts once each
        want = by_custom_id(read_lines(client, clean.output_file_id))
        assert set(got) == set(want) == {f"r{i}" for i in range(300)}, (seed, kills)
        for custom_id, item in want.items():
            for a, b in zip(
                got[custom_id]["response"]["body"]["data"],
                item["response"]["body"]["data"],
                strict=True,
            ):
                np.testing.assert_allclose(a["embedding"], b["embedding"], atol=1e-5)
    except BaseException:
        print(f"seed {seed}, kills at {kills}\n{server.output()}")
        raise
    finally:
        server.stop()
