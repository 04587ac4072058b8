"""A generative model behind the real server, with the clients people install: the ``openai``
client on ``/v1/completions`` and ``/v1/chat/completions`` (whole and streamed), Triton's
generate extension over httpx, and ``tritonclient.grpc``'s stream with the tensors of Triton's
vLLM backend. Greedy output is checked against transformers' own generation of the same
prompt tokens; errors against the field they name; a client that goes away frees its blocks.
"""

from __future__ import annotations

import json
import queue
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from tests.fixtures.chat_models import write_tiny_chat
from tests.helpers import InProcessServer, wait_until

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "The quick brown fox?"},
]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repository = tmp_path_factory.mktemp("generate_repository")
    write_tiny_chat(repository / "chat" / "1")
    (repository / "chat" / "config.yaml").write_text(
        "backend: huggingface\n"
        "instance_group: [{kind: cpu}]\n"
        "huggingface: {task: text-generation}\n"
        "generate: {block_size: 8, max_running: 8, max_tokens_per_step: 64,\n"
        "           sampling: {max_tokens: 16, temperature: 0.0}}\n"
    )
    (repository / "simple" / "1").mkdir(parents=True)
    (repository / "simple" / "1" / "model.py").write_text(
        "from gpuserve import PythonModel\n"
        "class Model(PythonModel):\n"
        "    def forward(self, batch):\n"
        "        return {'OUT': batch['IN']}\n"
    )
    (repository / "simple" / "config.yaml").write_text(
        "backend: python\nmax_batch_size: 4\n"
        "inputs: [{name: IN, datatype: FP32, shape: [2]}]\n"
        "outputs: [{name: OUT, datatype: FP32, shape: [2]}]\n"
    )
    return repository


@pytest.fixture(scope="module")
def server(repository: Path) -> Any:
    running = InProcessServer(repository, trace_dir=repository.parent / "traces")
    running.trace_dir = repository.parent / "traces"
    yield running
    running.stop()


@pytest.fixture(scope="module")
def reference(repository: Path) -> Any:
    folder = repository / "chat" / "1"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return model.eval(), tokenizer


def greedy(reference: Any, ids: list[int], n: int) -> tuple[list[int], str]:
    """transformers' greedy continuation, stopped at EOS as the server stops."""
    model, tokenizer = reference
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    new = [int(t) for t in out[0, len(ids) :]]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if eos in new:
        new = new[: new.index(eos) + 1]
    text = tokenizer.decode([t for t in new if t != eos], skip_special_tokens=True)
    return new, text


def chat_ids(reference: Any, messages: list[dict[str, str]]) -> list[int]:
    tokenizer = reference[1]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def client(server: Any) -> Any:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_chat_completion_is_transformers_greedy_output(client: Any, reference: Any) -> None:
    answer = client.chat.completions.create(
        model="chat", messages=MESSAGES, max_tokens=12, temperature=0
    )
    ids = chat_ids(reference, MESSAGES)
    tokens, text = greedy(reference, ids, 12)
    choice = answer.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == text
    assert choice.finish_reason == ("stop" if len(tokens) < 12 else "length")
    assert answer.usage.prompt_tokens == len(ids)
    assert answer.usage.completion_tokens == len(tokens)
    assert answer.usage.total_tokens == len(ids) + len(tokens)
    assert answer.object == "chat.completion" and answer.model == "chat"


def test_streamed_chat_adds_up_to_the_whole_answer_and_reports_usage(client: Any) -> None:
    whole = client.chat.completions.create(
        model="chat", messages=MESSAGES, max_tokens=14, temperature=0
    )
    events = list(
        client.chat.completions.create(
            model="chat",
            messages=MESSAGES,
            max_tokens=14,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert events[0].choices[0].delta.role == "assistant"
    text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    assert text == whole.choices[0].message.content
    reasons = [e.choices[0].finish_reason for e in events if e.choices]
    assert reasons[-1] == whole.choices[0].finish_reason and not any(reasons[:-1])
    assert not events[-1].choices
    assert events[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(e.usage is None for e in events[:-1])


def test_completions_with_prompts_n_seed_echo_and_logprobs(client: Any, reference: Any) -> None:
    prompts = ["The quick brown fox", "Paris is the capital of"]
    answer = client.completions.create(
        model="chat",
        prompt=prompts,
        n=2,
        max_tokens=6,
        temperature=1.0,
        seed=11,
        logprobs=2,
        echo=True,
    )
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    for choice in answer.choices:
        assert choice.text.startswith(prompts[choice.index // 2])
        assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs)
        assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
        assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    again = client.completions.create(
        model="chat", prompt=prompts, n=2, max_tokens=6, temperature=1.0, seed=11
    )
    assert [c.text for c in again.choices] == [
        c.text[len(prompts[c.index // 2]) :] for c in answer.choices
    ]
    tokenizer = reference[1]
    prompt_tokens = sum(len(tokenizer.encode(p)) for p in prompts)
    assert answer.usage.prompt_tokens == prompt_tokens


def test_token_id_prompt_and_stop_token(client: Any, reference: Any) -> None:
    ids = [5, 6, 7, 8, 9]
    tokens, _ = greedy(reference, ids, 10)
    stop_at = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    answer = client.completions.create(
        model="chat",
        prompt=ids,
        max_tokens=10,
        temperature=0,
        extra_body={"stop_token_ids": [tokens[stop_at]]},
    )
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens == stop_at + 1


@pytest.mark.parametrize(
    ("kwargs", "status", "needle", "param"),
    [
        ({"model": "chat", "messages": []}, 400, "messages", "messages"),
        ({"model": "chat", "messages": "hi"}, 400, "'messages' must be", "messages"),
        ({"model": 123, "messages": MESSAGES}, 400, "'model' must be", "model"),
        (
            {"model": "chat", "messages": MESSAGES, "temperature": 5},
            400,
            "temperature",
            "temperature",
        ),
        ({"model": "chat", "messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
        (
            {"model": "chat", "messages": MESSAGES, "max_tokens": 100000},
            400,
            "context length",
            None,
        ),
        ({"model": "chat", "messages": MESSAGES, "n": 1000}, 400, "'n'", "n"),
        (
            {"model": "chat", "messages": [{"role": "wizard", "content": "x"}]},
            400,
            "messages[0].role",
            "messages",
        ),
        (
            {"model": "chat", "messages": MESSAGES, "tools": [{"type": "function"}]},
            400,
            "tools",
            "tools",
        ),
        ({"model": "simple", "messages": MESSAGES}, 400, "does not generate text", None),
        ({"model": "nope", "messages": MESSAGES}, 404, "nope", None),
    ],
)
def test_bad_calls_get_the_status_and_name_the_field(
    server: Any, kwargs: dict[str, Any], status: int, needle: str, param: str | None
) -> None:
    response = httpx.post(f"{server.url}/v1/chat/completions", json=kwargs, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle in error["message"]
    if param is not None:
        assert error["param"] == param  # OpenAI's field for the request field at fault


def test_models_lists_the_generative_model(client: Any) -> None:
    assert "chat" in [m.id for m in client.models.list()]


def test_triton_generate_and_generate_stream(server: Any, client: Any) -> None:
    whole = client.completions.create(model="chat", prompt="The quick", max_tokens=8, temperature=0)
    body = {
        "text_input": "The quick",
        "parameters": {"max_tokens": 8, "temperature": 0, "exclude_input_in_output": True},
    }
    answer = httpx.post(f"{server.url}/v2/models/chat/generate", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["text_output"] == whole.choices[0].text
    body["stream"] = True
    texts = []
    with httpx.stream(
        "POST", f"{server.url}/v2/models/chat/generate_stream", json=body, timeout=30
    ) as events:
        for line in events.iter_lines():
            if line.startswith("data: "):
                texts.append(json.loads(line[6:])["text_output"])
    assert len(texts) > 1 and "".join(texts) == whole.choices[0].text


def test_grpc_stream_with_the_vllm_backend_tensors(server: Any, client: Any) -> None:
    grpcclient = pytest.importorskip("tritonclient.grpc")
    whole = client.completions.create(model="chat", prompt="Paris is", max_tokens=8, temperature=0)
    received: queue.Queue[Any] = queue.Queue()
    triton = grpcclient.InferenceServerClient(server.grpc_url)
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"Paris is"], dtype=object))
    stream = grpcclient.InferInput("stream", [1], "BOOL")
    stream.set_data_from_numpy(np.array([True]))
    params = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    params.set_data_from_numpy(np.array([b'{"max_tokens": 8, "temperature": 0}'], dtype=object))
    exclude = grpcclient.InferInput("exclude_input_in_output", [1], "BOOL")
    exclude.set_data_from_numpy(np.array([True]))
    triton.start_stream(callback=lambda result, error: received.put((result, error)))
    try:
        triton.async_stream_infer(
            "chat", [text, stream, params, exclude], enable_empty_final_response=True
        )
        pieces = []
        while True:
            result, error = received.get(timeout=30)
            assert error is None, error
            response = result.get_response()
            final = response.parameters["triton_final_response"].bool_param
            output = result.as_numpy("text_output")
            if output is not None:
                pieces.append(output[0].decode())
            if final:
                break
    finally:
        triton.stop_stream()
        triton.close()
    assert "".join(pieces) == whole.choices[0].text


def _cancelled(server: Any) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for line in text.splitlines():
        series = line.startswith("gpuserve_requests_total{") and 'model="chat"' in line
        if series and 'reason="cancelled"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_client_that_goes_away_frees_its_sequence(server: Any) -> None:
    runner = server.manager.models["chat"].route.default.runner
    before = _cancelled(server)
    body = {
        "model": "chat",
        "prompt": "The quick brown fox",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as events:
        for line in events.iter_lines():
            if line.startswith("data: "):
                break  # one event, then the client goes away
    wait_until(lambda: runner.in_flight_requests == 0, 20, "the sequence to be cancelled")
    engine = runner._engines[0]
    wait_until(lambda: engine.blocks.num_free == engine.blocks.num_blocks, 20, "blocks freed")
    assert engine.stats.finished.get("abort", 0) >= 1
    wait_until(lambda: _cancelled(server) == before + 1, 10, "the request counted cancelled")
    usage = [
        line
        for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines()
        if line.startswith("gpuserve_generation_kv_cache_usage{") and 'model="chat"' in line
    ]
    assert usage and float(usage[0].rsplit(" ", 1)[1]) == 0.0  # back to idle


def test_tritonclient_http_infer_gets_the_whole_text(server: Any, client: Any) -> None:
    httpclient = pytest.importorskip("tritonclient.http")
    whole = client.completions.create(model="chat", prompt="Berlin is", max_tokens=7, temperature=0)
    triton = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    text = httpclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"Berlin is"], dtype=object))
    params = httpclient.InferInput("sampling_parameters", [1], "BYTES")
    params.set_data_from_numpy(np.array([b'{"max_tokens": "7", "temperature": "0"}'], dtype=object))
    result = triton.infer("chat", [text, params])
    assert result.as_numpy("text_output")[0].decode() == "Berlin is" + whole.choices[0].text


def test_one_trace_per_sequence_with_its_prefill_and_decode(server: Any, client: Any) -> None:
    setting = f"{server.url}/v2/trace/setting"
    trace_file = server.trace_dir / "generate.jsonl"
    settings = {"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_file": trace_file.name}
    assert httpx.post(setting, json=settings, timeout=10).status_code == 200
    try:
        client.completions.create(model="chat", prompt="The quick", max_tokens=6, temperature=0)
        client.completions.create(model="chat", prompt="Paris", max_tokens=4, n=2, temperature=0)
    finally:
        off = {"trace_level": None, "trace_rate": None, "trace_file": None}
        httpx.post(setting, json=off, timeout=10)  # back to OFF: the file is closed
    lines = [json.loads(line) for line in trace_file.read_text().splitlines()]
    assert len(lines) == 3  # one per sequence: n=2 is two
    for line in lines:
        assert line["model_name"] == "chat" and line["request_id"].startswith("cmpl-")
        stamps = {s["name"]: s["ns"] for s in line["timestamps"]}
        assert (
            stamps["QUEUE_START"]
            <= stamps["COMPUTE_START"]  # the first token: waiting and prefill before it
            <= stamps["COMPUTE_END"]  # the last token: the decode before it
            <= stamps["REQUEST_END"]
        )


def test_gpuserve_bench_generate_measures_each_level(server: Any, tmp_path: Path) -> None:
    from gpuserve.cli.main import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick brown fox\nParis is the capital of\n")
    code = main(
        [
            "bench",
            "--generate",
            "--url",
            server.url,
            "-m",
            "chat",
            "--concurrency",
            "1,2",
            "--max-tokens",
            "4",
            "--input-lines",
            str(prompts),
            "--output-dir",
            str(tmp_path / "out"),
            "--quiet",
        ]
    )
    assert code == 0
    levels = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert [level["load"] for level in levels] == ["c=1", "c=2"]
    for level in levels:
        assert level["finished"] == level["requests"] >= 8
        assert level["output_tokens_s"] > 0 and level["ttft_p50_ms"] > 0
