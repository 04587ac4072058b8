"""Business-logic scripting into a generative model: a Python model calls a generative model of
the repository in-process with the tensors of Triton's vLLM backend (``text_input``,
``sampling_parameters`` as a JSON string, ``exclude_input_in_output``) and returns its
``text_output``; greedy, the text equals what ``/v1/completions`` answers for the same prompt
and ``max_tokens``. Both BLS forms call it: Triton's ``pb_utils.InferenceRequest(...).exec()``
and gpuserve's ``context.infer``. Streamed (``exec(decoupled=True)`` with ``stream`` true), the
call yields a response per step whose texts join into the unary answer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.chat_models import write_tiny_chat
from tests.fixtures.ensemble_models import write_model
from tests.helpers import InProcessServer

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

MAX_TOKENS = 8
SAMPLING = json.dumps({"temperature": 0, "max_tokens": MAX_TOKENS})

#: Triton's Python backend API: one unary ``exec()`` per request.
BLS_TRITON = f"""
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            prompt = pb_utils.get_input_tensor_by_name(request, "PROMPT").as_numpy()
            call = pb_utils.InferenceRequest(
                model_name="chat",
                requested_output_names=["text_output"],
                inputs=[
                    pb_utils.Tensor("text_input", prompt.reshape(1)),
                    pb_utils.Tensor("sampling_parameters", np.array([{SAMPLING!r}], np.object_)),
                    pb_utils.Tensor("exclude_input_in_output", np.array([True])),
                ],
            )
            answer = call.exec()
            if answer.has_error():
                responses.append(pb_utils.InferenceResponse(error=answer.error()))
                continue
            text = pb_utils.get_output_tensor_by_name(answer, "text_output").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("TEXT", text)]))
        return responses
"""

#: Triton's Python backend API, streamed: ``exec(decoupled=True)`` with ``stream`` true gives
#: one response per engine step; their texts join into the unary answer.
BLS_TRITON_STREAM = f"""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            prompt = pb_utils.get_input_tensor_by_name(request, "PROMPT").as_numpy()
            call = pb_utils.InferenceRequest(
                model_name="chat",
                requested_output_names=["text_output"],
                inputs=[
                    pb_utils.Tensor("text_input", prompt.reshape(1)),
                    pb_utils.Tensor("sampling_parameters", np.array([{SAMPLING!r}], np.object_)),
                    pb_utils.Tensor("exclude_input_in_output", np.array([True])),
                    pb_utils.Tensor("stream", np.array([True])),
                ],
            )
            pieces = []
            for response in call.exec(decoupled=True):
                if response.has_error():
                    raise pb_utils.TritonModelException(response.error().message())
                text = pb_utils.get_output_tensor_by_name(response, "text_output")
                if text is not None:
                    pieces.append(text.as_numpy().reshape(-1)[0].decode())
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("TEXT", np.array(["".join(pieces).encode()], np.object_)),
                        pb_utils.Tensor("PIECES", np.array([len(pieces)], np.int32)),
                    ]
                )
            )
        return responses
"""

STREAM_CALLER_CONFIG = """
backend: python
max_batch_size: 0
inputs: [{name: PROMPT, datatype: BYTES, shape: [1]}]
outputs: [{name: TEXT, datatype: BYTES, shape: [1]}, {name: PIECES, datatype: INT32, shape: [1]}]
instance_group: [{count: 1, kind: cpu}]
"""

#: gpuserve's API: the same call through ``context.infer``.
BLS_GPUSERVE = f"""
import numpy as np

from gpuserve.backends.python import PythonModel


class Model(PythonModel):
    def forward(self, inputs):
        out = self.context.infer(
            "chat",
            {{
                "text_input": inputs["PROMPT"].reshape(1),
                "sampling_parameters": np.array([{SAMPLING!r}], np.object_),
                "exclude_input_in_output": np.array([True]),
            }},
            outputs=["text_output"],
        )
        return {{"TEXT": out["text_output"]}}
"""

CALLER_CONFIG = """
backend: python
max_batch_size: 0
inputs: [{name: PROMPT, datatype: BYTES, shape: [1]}]
outputs: [{name: TEXT, datatype: BYTES, shape: [1]}]
instance_group: [{count: 1, kind: cpu}]
"""

PROMPTS = ["The quick brown fox", "Paris is the capital of"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    repository: Path = tmp_path_factory.mktemp("generate_bls")
    write_tiny_chat(repository / "chat" / "1")
    (repository / "chat" / "config.yaml").write_text(
        "backend: huggingface\n"
        "instance_group: [{kind: cpu}]\n"
        "huggingface: {task: text-generation}\n"
        "generate: {block_size: 8, max_running: 8}\n"
    )
    write_model(repository, "pb_generate", CALLER_CONFIG, BLS_TRITON)
    write_model(repository, "bls_generate", CALLER_CONFIG, BLS_GPUSERVE)
    write_model(repository, "pb_generate_stream", STREAM_CALLER_CONFIG, BLS_TRITON_STREAM)
    running = InProcessServer(repository)
    yield running
    running.stop()


def completion(server: Any, prompt: str) -> str:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    answer = client.completions.create(
        model="chat", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
    )
    return str(answer.choices[0].text)


@pytest.mark.parametrize("caller", ["pb_generate", "bls_generate"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_a_bls_call_generates_the_text_of_v1_completions(server: Any, caller: str, prompt: str):
    body = {"inputs": [{"name": "PROMPT", "datatype": "BYTES", "shape": [1], "data": [prompt]}]}
    answer = httpx.post(f"{server.url}/v2/models/{caller}/infer", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    (text,) = answer.json()["outputs"][0]["data"]
    expected = completion(server, prompt)
    assert expected, "greedy decoding of the tiny model gives some text for this prompt"
    assert text == expected


@pytest.mark.parametrize("prompt", PROMPTS)
def test_a_streamed_bls_call_yields_the_steps_that_join_into_the_unary_answer(
    server: Any, prompt: str
):
    body = {"inputs": [{"name": "PROMPT", "datatype": "BYTES", "shape": [1], "data": [prompt]}]}
    streamed = httpx.post(f"{server.url}/v2/models/pb_generate_stream/infer", json=body, timeout=60)
    assert streamed.status_code == 200, streamed.text
    out = {o["name"]: o["data"] for o in streamed.json()["outputs"]}
    unary = httpx.post(f"{server.url}/v2/models/pb_generate/infer", json=body, timeout=60)
    assert unary.status_code == 200, unary.text
    assert out["TEXT"] == unary.json()["outputs"][0]["data"]
    assert out["PIECES"][0] > 1, out  # one response per step, not one at the end
