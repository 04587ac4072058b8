"""Internal callers go through the callee's admission step, as a client's request does.

The default repository's ``text_embedding`` declares an admission step (token counts per row,
a 400 for a row that is not UTF-8, truncation of long texts). An ensemble step
(``runners/ensemble.py`` ``_submit_step`` -> ``runner.submit``) and a BLS call from a Python
model (``engine/calls.py`` ``InProcessCaller._run`` -> ``runner.infer``, behind
``self.context.infer``) enter ``text_embedding``'s runner the same way a client does, so:

* a row of invalid UTF-8 is refused with the step's 400 message directly, through the
  ensemble (the ensemble names its step around the same text) and through the BLS model
  (the caller's request fails with the callee's 400 and message as they are), over HTTP and
  gRPC. Without the
  step the CPU stage would decode with replacement characters and answer 200;
* each request reaches ``text_embedding`` with its cost: ``gpuserve_batch_tokens`` (observed
  only for batches whose requests carry a cost) grows by exactly the step's token count for a
  direct call, an ensemble call and a BLS call, and a text far longer than ``max_seq_len``
  counts ``max_seq_len`` tokens and embeds the same on all three paths. Without the step the
  cost is absent, the batch's tokens are 0 and the series does not move.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import httpx
import numpy as np
import pytest

import gpuserve
from tests.helpers import InProcessServer

MODEL = "text_embedding"
ENSEMBLE = "embed_ensemble"
BLS = "embed_bls"

ENSEMBLE_CONFIG = f"""
backend: ensemble
max_batch_size: 8
inputs: [{{name: TEXT, datatype: BYTES, shape: [1]}}]
outputs: [{{name: EMBEDDING, datatype: FP32, shape: [384]}}]
ensemble:
  steps:
    - {{model_name: {MODEL}, input_map: {{TEXT: TEXT}}, output_map: {{EMBEDDING: EMBEDDING}}}}
"""

BLS_CONFIG = """
backend: python
max_batch_size: 8
inputs: [{name: TEXT, datatype: BYTES, shape: [1]}]
outputs: [{name: EMBEDDING, datatype: FP32, shape: [384]}]
instance_group: [{count: 1, kind: cpu}]
"""

BLS_CODE = f"""
from gpuserve.backends.python import PythonModel


class Model(PythonModel):
    def forward(self, inputs):
        out = self.context.infer("{MODEL}", {{"TEXT": inputs["TEXT"]}}, timeout_s=30)
        return {{"EMBEDDING": out["EMBEDDING"]}}
"""

#: The step's refusal of row 1 of ``[b"fine text", b"caf\\xe9"]``.
UTF8_REFUSAL = "input 'TEXT' row 1 is not valid UTF-8 (byte 0xe9 at offset 3"
ROWS = [b"fine text", b"caf\xe9"]

#: ``hello world`` is 4 tokens for MiniLM (CLS, hello, world, SEP).
HELLO_TOKENS = 4


def write(root: Path, name: str, config: str, code: str | None) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.yaml").write_text(textwrap.dedent(config).lstrip())
    if code is not None:
        (root / name / "1" / "model.py").write_text(textwrap.dedent(code).lstrip())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("internal_callers_admission")
    # the default repository's folder, found from the package (not from a settings module)
    source = Path(gpuserve.__file__).parent / "default_repository" / MODEL
    write(
        repository,
        MODEL,
        (source / "config.yaml").read_text(),
        (source / "1" / "model.py").read_text(),
    )
    write(repository, ENSEMBLE, ENSEMBLE_CONFIG, None)
    write(repository, BLS, BLS_CONFIG, BLS_CODE)
    running = InProcessServer(repository)
    yield running
    running.stop()


def binary_infer(url: str, model: str, rows: list[bytes]) -> httpx.Response:
    """A KServe V2 request whose TEXT rows travel as raw bytes (the binary tensor extension),
    so they need not be UTF-8."""
    raw = b"".join(len(r).to_bytes(4, "little") + r for r in rows)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "TEXT",
                    "shape": [len(rows), 1],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(raw)},
                }
            ],
            "outputs": [{"name": "EMBEDDING", "parameters": {"binary_data": False}}],
        }
    ).encode()
    return httpx.post(
        f"{url}/v2/models/{model}/infer",
        content=header + raw,
        headers={
            "Inference-Header-Content-Length": str(len(header)),
            "Content-Type": "application/octet-stream",
        },
        timeout=60.0,
    )


def json_infer(url: str, model: str, texts: list[str]) -> httpx.Response:
    body = {
        "inputs": [{"name": "TEXT", "shape": [len(texts), 1], "datatype": "BYTES", "data": texts}]
    }
    return httpx.post(f"{url}/v2/models/{model}/infer", json=body, timeout=60.0)


def embedding(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    out = next(o for o in response.json()["outputs"] if o["name"] == "EMBEDDING")
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def batch_tokens(url: str) -> tuple[float, float]:
    """``gpuserve_batch_tokens`` (sum, count) of ``text_embedding``; (0, 0) before any batch
    with a cost was observed."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    values = {}
    for kind in ("sum", "count"):
        pattern = rf'^gpuserve_batch_tokens_{kind}\{{[^}}]*model="{MODEL}"[^}}]*\}} (\S+)$'
        found = [float(v) for v in re.findall(pattern, text, re.MULTILINE)]
        values[kind] = sum(found)
    return values["sum"], values["count"]


def huge_text(size: int = 200_000) -> str:
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "gpuserve"]
    return " ".join(words[i % len(words)] for i in range(size // 4))[:size]


@pytest.mark.parametrize("model", [MODEL, ENSEMBLE, BLS])
def test_invalid_utf8_is_refused_by_the_step_on_every_path_over_http(server, model):
    answer = binary_infer(server.url, model, ROWS)
    error = answer.json().get("error", answer.text)
    assert UTF8_REFUSAL in error, error
    assert answer.status_code == 400, (answer.status_code, error)
    if model == ENSEMBLE:
        assert MODEL in error  # the ensemble names its step
    # through BLS the caller's request fails with the callee's 400 as it is (no prefix)
    # the valid row alone is served on the same path (only the bad request failed)
    ok = binary_infer(server.url, model, ROWS[:1])
    assert embedding(ok).shape == (1, 384)


@pytest.mark.parametrize("model", [MODEL, ENSEMBLE, BLS])
def test_invalid_utf8_is_invalid_argument_on_every_path_over_grpc(server, model):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        tensor = grpcclient.InferInput("TEXT", [2, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[r] for r in ROWS], dtype=object))
        with pytest.raises(InferenceServerException) as raised:
            client.infer(model, [tensor])
        assert UTF8_REFUSAL in raised.value.message()
        assert str(raised.value.status()) == "StatusCode.INVALID_ARGUMENT"
    finally:
        client.close()


@pytest.mark.parametrize("model", [MODEL, ENSEMBLE, BLS])
def test_each_path_reaches_the_model_with_the_steps_token_count(server, model):
    before_sum, before_count = batch_tokens(server.url)
    assert embedding(json_infer(server.url, model, ["hello world"])).shape == (1, 384)
    after_sum, after_count = batch_tokens(server.url)
    # one batch with a cost of exactly the step's count; without the step: no observation
    assert after_count - before_count == 1
    assert after_sum - before_sum == HELLO_TOKENS


def test_a_long_text_is_truncated_by_the_step_the_same_on_every_path(server):
    text = huge_text()
    direct_before, _ = batch_tokens(server.url)
    direct = embedding(json_infer(server.url, MODEL, [text]))
    direct_after, _ = batch_tokens(server.url)
    assert direct_after - direct_before == 256  # max_seq_len: the step counted the cut text
    for model in (ENSEMBLE, BLS):
        before, _ = batch_tokens(server.url)
        got = embedding(json_infer(server.url, model, [text]))
        after, _ = batch_tokens(server.url)
        assert after - before == 256, model
        np.testing.assert_allclose(got, direct, atol=1e-5)
