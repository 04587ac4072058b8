"""Voice activity client: send WAV files (or a synthesised demo clip) to the ``vad`` model.

    python examples/vad/client.py [--url localhost:8000] [FILE.wav ...]

WAV files must be 16-bit PCM; stereo is averaged to mono and other sample rates are
resampled (linear interpolation) to the model's 16 kHz. The demo clip is 1 s of near
silence, 1.5 s of synthetic voiced speech, 1 s of near silence, 1 s of speech and 0.5 s of
near silence. Prints each speech segment in seconds. Needs ``tritonclient[http]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import wave
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16_000
#: (start_s, end_s) of the speech in :func:`demo_clip`.
DEMO_SPEECH = ((1.0, 2.5), (3.5, 4.5))


def synthetic_speech(seconds: float, f0: float = 120.0) -> np.ndarray:
    """Voiced speech-like sound: a glottal pulse train through vowel formant resonators.

    The pitch wavers around ``f0`` Hz and the vowel changes every 0.2 s (/a/, /i/, /o/),
    with a 4 Hz syllable rhythm: enough for a voice activity detector to call it speech,
    while a steady tone is not.
    """
    n = int(seconds * SAMPLE_RATE)
    t = np.arange(n) / SAMPLE_RATE
    pitch = f0 * (1 + 0.1 * np.sin(2 * np.pi * 1.5 * t))
    phase = np.cumsum(pitch) / SAMPLE_RATE
    source = (np.diff(np.floor(phase), prepend=0) > 0).astype(np.float64)
    source = _filter(source, [1.0], [1.0, -0.95])  # spectral tilt of the glottal source
    vowels = ((730, 1090, 2440), (270, 2290, 3010), (570, 840, 2410))
    out = np.zeros(n)
    step = int(0.2 * SAMPLE_RATE)
    for k, begin in enumerate(range(0, n, step)):
        sound = source[begin : begin + step]
        for centre, bandwidth in zip(vowels[k % len(vowels)], (90, 110, 170), strict=True):
            r = np.exp(-np.pi * bandwidth / SAMPLE_RATE)
            theta = 2 * np.pi * centre / SAMPLE_RATE
            sound = _filter(sound, [1 - r], [1, -2 * r * np.cos(theta), r * r])
        out[begin : begin + step] = sound
    out *= 0.6 + 0.4 * 0.5 * (1 - np.cos(2 * np.pi * 4 * t))
    return (0.5 * out / np.abs(out).max()).astype(np.float32)


def _filter(x: np.ndarray, b: list[float], a: list[float], taps: int = 2048) -> np.ndarray:
    """IIR filter ``b/a`` (a[0] == 1) as a convolution with its impulse response (no scipy).

    The response is cut after ``taps`` samples, where these stable filters have decayed.
    """
    response = np.zeros(taps)
    for i in range(taps):
        acc = b[i] if i < len(b) else 0.0
        acc -= sum(a[j] * response[i - j] for j in range(1, len(a)) if i >= j)
        response[i] = acc
    return np.convolve(x, response)[: len(x)]


def demo_clip(seed: int = 0) -> np.ndarray:
    """The demo clip (see the module docstring): float32 mono at 16 kHz."""
    rng = np.random.default_rng(seed)

    def quiet(seconds: float) -> np.ndarray:
        return (0.001 * rng.standard_normal(int(seconds * SAMPLE_RATE))).astype(np.float32)

    return np.concatenate(
        [quiet(1.0), synthetic_speech(1.5), quiet(1.0), synthetic_speech(1.0), quiet(0.5)]
    )


def read_wav(path: Path) -> np.ndarray:
    """A 16-bit PCM WAV file as float32 mono at 16 kHz."""
    with wave.open(str(path), "rb") as wav:
        if wav.getsampwidth() != 2:
            raise ValueError(f"{path}: only 16-bit PCM WAV is supported")
        frames = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
        audio = frames.reshape(-1, wav.getnchannels()).mean(axis=1) / 32768.0
        rate = wav.getframerate()
    if rate != SAMPLE_RATE:
        times = np.arange(int(len(audio) * SAMPLE_RATE / rate)) / SAMPLE_RATE
        audio = np.interp(times, np.arange(len(audio)) / rate, audio)
    return audio.astype(np.float32)


def detect(url: str, audio: np.ndarray, model: str = "vad") -> list[dict[str, float]]:
    """Speech segments of one clip: ``[{"start_s": float, "end_s": float}, ...]``."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url)
    data = audio.reshape(1, -1).astype(np.float32)
    tensor = httpclient.InferInput("AUDIO", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data, binary_data=True)
    segments = httpclient.InferRequestedOutput("SEGMENTS", binary_data=True)
    result = client.infer(model, [tensor], outputs=[segments])
    return json.loads(result.as_numpy("SEGMENTS")[0, 0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path, help="16-bit PCM WAV files (default: demo)")
    parser.add_argument("--url", default="localhost:8000", help="server host:port (HTTP)")
    args = parser.parse_args(argv)
    clips = [(str(path), read_wav(path)) for path in args.files] or [("demo", demo_clip())]
    for name, audio in clips:
        segments = detect(args.url, audio)
        print(f"== {name}: {len(audio) / SAMPLE_RATE:.2f} s, {len(segments)} speech segment(s)")
        for segment in segments:
            print(f"speech {segment['start_s']:.3f} s - {segment['end_s']:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
