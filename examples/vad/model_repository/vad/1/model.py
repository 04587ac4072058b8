"""Voice activity detection with Silero VAD: AUDIO FP32 [B, N] (16 kHz mono) ->
SPEECH_PROBABILITY FP32 [B, ceil(N / 512)] and SEGMENTS BYTES [B, 1] (JSON).

The weights are ``silero_vad/data/silero_vad.onnx`` from the PyPI package ``silero-vad``,
found without importing the package (importing it calls ``torch.set_num_threads(1)``, which
would slow every other torch model of the server). Nothing is downloaded.

The model is recurrent: it reads 512-sample frames (32 ms), each prefixed with the last 64
samples of the frame before, and carries a state [2, B, 128] from frame to frame. The rows
of a batch (clips of equal length) are stepped together, so batching shares every call.
Segments come from the per-frame probabilities with Silero's rules (start at ``threshold``,
end after ``min_silence_duration_ms`` below ``threshold - 0.15``, drop segments shorter than
``min_speech_duration_ms``, pad by ``speech_pad_ms``).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np

from gpuserve import LoadContext, PythonModel
from gpuserve.backends.onnx_backend import choose_providers, import_ort, session_options
from gpuserve.errors import ConfigError

SAMPLE_RATE = 16_000
FRAME = 512
CONTEXT = 64


def packaged_model() -> Path:
    """``silero_vad/data/silero_vad.onnx`` inside the installed wheel."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the vad example needs the PyPI package silero-vad")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "silero_vad.onnx"
    if not path.is_file():
        raise ConfigError(f"{path}: the Silero VAD ONNX file is missing")
    return path


class Model(PythonModel):
    def load(self, context: LoadContext) -> None:
        ort = import_ort()
        config = context.config
        params = {**config.parameters, **context.parameters}
        self.threshold = float(params.get("threshold", 0.5))
        self.min_speech_ms = float(params.get("min_speech_duration_ms", 250))
        self.min_silence_ms = float(params.get("min_silence_duration_ms", 100))
        self.pad_ms = float(params.get("speech_pad_ms", 30))
        providers = choose_providers(
            list(config.onnx.execution_providers), ort.get_available_providers(), context.device
        )
        self.session = ort.InferenceSession(
            str(packaged_model()), session_options(config.onnx, ort), providers=providers
        )
        self.sample_rate = np.array(SAMPLE_RATE, dtype=np.int64)

    def warmup(self) -> None:
        self.forward(self.preprocess({"AUDIO": np.zeros((1, 4 * FRAME), dtype=np.float32)}))

    def preprocess(self, inputs: dict[str, np.ndarray]) -> tuple[np.ndarray, int]:
        """AUDIO [B, N] -> frames float32 [F, B, 64 + 512] (context + frame), and N."""
        audio = np.ascontiguousarray(inputs["AUDIO"], dtype=np.float32)
        rows, samples = audio.shape
        count = max(1, -(-samples // FRAME))
        padded = np.zeros((rows, count * FRAME + CONTEXT), dtype=np.float32)
        padded[:, CONTEXT : CONTEXT + samples] = audio
        # Frame f covers padded[f*512 : f*512 + 576]: the previous frame's last 64 samples
        # (zeros before the first frame), then its own 512.
        starts = np.arange(count) * FRAME
        frames = padded[:, starts[:, None] + np.arange(CONTEXT + FRAME)]
        return np.ascontiguousarray(frames.transpose(1, 0, 2)), samples

    def forward(self, batch: tuple[np.ndarray, int]) -> tuple[np.ndarray, int]:
        """Step the recurrent model over the frames: probabilities float32 [B, F]."""
        frames, samples = batch
        state = np.zeros((2, frames.shape[1], 128), dtype=np.float32)
        probs = np.empty((frames.shape[1], frames.shape[0]), dtype=np.float32)
        for index, frame in enumerate(frames):
            out, state = self.session.run(
                None, {"input": frame, "state": state, "sr": self.sample_rate}
            )
            probs[:, index] = out[:, 0]
        return probs, samples

    def postprocess(self, outputs: tuple[np.ndarray, int]) -> dict[str, np.ndarray]:
        probs, samples = outputs
        segments = [
            json.dumps(
                speech_segments(
                    row,
                    samples,
                    threshold=self.threshold,
                    min_speech_ms=self.min_speech_ms,
                    min_silence_ms=self.min_silence_ms,
                    pad_ms=self.pad_ms,
                )
            ).encode()
            for row in probs
        ]
        return {
            "SPEECH_PROBABILITY": probs,
            "SEGMENTS": np.array(segments, dtype=object).reshape(-1, 1),
        }


def speech_segments(
    probs: np.ndarray,
    samples: int,
    *,
    threshold: float = 0.5,
    min_speech_ms: float = 250,
    min_silence_ms: float = 100,
    pad_ms: float = 30,
) -> list[dict[str, float]]:
    """Speech segments (seconds) from per-frame probabilities, by Silero's rules.

    A segment starts at the first frame at or above ``threshold`` and ends where the
    probability has stayed below ``threshold - 0.15`` for ``min_silence_ms``; segments shorter
    than ``min_speech_ms`` are dropped; each is padded by ``pad_ms`` (half the gap when two
    segments are closer than twice that).
    """
    low = max(threshold - 0.15, 0.01)
    min_speech = SAMPLE_RATE * min_speech_ms / 1000
    min_silence = SAMPLE_RATE * min_silence_ms / 1000
    pad = int(SAMPLE_RATE * pad_ms / 1000)
    found: list[list[int]] = []
    start: int | None = None
    silence_from = 0
    for index, prob in enumerate(probs):
        position = index * FRAME
        if prob >= threshold:
            silence_from = 0
            if start is None:
                start = position
            continue
        if start is None or prob >= low:
            continue
        silence_from = silence_from or position
        if position - silence_from < min_silence:
            continue
        if silence_from - start > min_speech:
            found.append([start, silence_from])
        start, silence_from = None, 0
    if start is not None and samples - start > min_speech:
        found.append([start, samples])
    for index, segment in enumerate(found):
        if index == 0:
            segment[0] = max(0, segment[0] - pad)
        if index + 1 < len(found):
            following = found[index + 1]
            gap = following[0] - segment[1]
            if gap < 2 * pad:
                segment[1] += gap // 2
                following[0] = max(0, following[0] - gap // 2)
            else:
                segment[1] = min(samples, segment[1] + pad)
                following[0] = max(0, following[0] - pad)
        else:
            segment[1] = min(samples, segment[1] + pad)
    return [
        {"start_s": round(s / SAMPLE_RATE, 3), "end_s": round(e / SAMPLE_RATE, 3)} for s, e in found
    ]
