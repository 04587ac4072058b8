"""A model's accuracy at a precision against fp32, in-process: ``gpuserve models accuracy``
and the accuracy side of ``gpuserve tune --accuracy-budget``.

The model's latest version is loaded twice with its own backend (fp32, then the precision,
its load-time ``precision_check`` off so that a precision the gate would refuse is still
measured) and embeds a held-out set of real sentences (built in: 300 sentences disjoint
from the gate's reference set; or a file, one text a line). The model must take one BYTES
input and give one FP32 output per text (the text embedding models).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpuserve.backends import backend_for
from gpuserve.backends.base import Backend, LoadContext
from gpuserve.backends.precision_gate import (
    HELDOUT_RESOURCE,
    AccuracyReport,
    builtin_texts,
    compare,
)
from gpuserve.config import CONFIG_FILENAME, ModelConfig, load_model_config
from gpuserve.config.precision import PrecisionCheckConfig
from gpuserve.errors import ConfigError

BATCH_ROWS = 32


@dataclass(frozen=True, slots=True)
class TextModel:
    """One version of a text model and its tensors.

    Attributes:
        config: Its config (as in ``config.yaml``).
        version_path: The version folder.
        text_input: Name of its BYTES input.
        output: Name of its FP32 output.
    """

    config: ModelConfig
    version_path: Path
    text_input: str
    output: str


def latest_version(model_dir: Path) -> Path:
    """The highest numbered version folder of ``model_dir``.

    Raises:
        ConfigError: none.
    """
    versions = sorted(
        (int(p.name), p) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()
    )
    if not versions:
        raise ConfigError(f"{model_dir}: no version folder (1/, 2/, ...)")
    return versions[-1][1]


def text_model(model_dir: Path) -> TextModel:
    """Read ``model_dir``'s config and find its text input and embedding output.

    Raises:
        ConfigError: no config, or not one BYTES input and one FP32 output.
    """
    config = load_model_config(model_dir / CONFIG_FILENAME)
    texts = [t.name for t in config.inputs if t.datatype == "BYTES"]
    floats = [t.name for t in config.outputs if t.datatype == "FP32"]
    if len(config.inputs) != 1 or len(texts) != 1 or len(floats) != 1:
        raise ConfigError(
            f"{model_dir.name}: accuracy is measured on text models (one BYTES input, one FP32 "
            f"output); this one has inputs {[t.name for t in config.inputs]} and outputs "
            f"{[t.name for t in config.outputs]}"
        )
    return TextModel(config, latest_version(model_dir), texts[0], floats[0])


def load_at(model: TextModel, precision: str, device: str = "cpu") -> Backend:
    """The model loaded at ``precision`` on ``device``, its precision gate off."""
    config = model.config.model_copy(
        update={"precision": precision, "precision_check": PrecisionCheckConfig(enabled=False)}
    )
    backend = backend_for(config)()
    backend.load(
        LoadContext(
            config=config,
            version_path=model.version_path,
            version=int(model.version_path.name),
            device=device,
            parameters=dict(config.parameters),
        )
    )
    return backend


def embed(backend: Backend, model: TextModel, texts: Sequence[str]) -> np.ndarray:
    """float32 [N, H]: ``texts`` through the backend's three stages, in batches."""
    rows = max(1, min(BATCH_ROWS, model.config.max_batch_size or 1))
    parts = []
    for start in range(0, len(texts), rows):
        chunk = texts[start : start + rows]
        data = np.array([[t.encode("utf-8")] for t in chunk], dtype=object)
        if model.config.max_batch_size == 0:
            data = data[0]
        out = backend.postprocess(backend.forward(backend.preprocess({model.text_input: data})))
        parts.append(np.asarray(out[model.output], dtype=np.float32).reshape(len(chunk), -1))
    return np.concatenate(parts)


def heldout_texts(path: Path | None = None) -> list[str]:
    """The held-out set: ``path`` (one text a line) or the built-in sentences.

    Raises:
        ConfigError: the file cannot be read or has fewer than 2 texts.
    """
    if path is None:
        return builtin_texts(HELDOUT_RESOURCE)
    try:
        texts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    except OSError as err:
        raise ConfigError(f"--texts {path}: {err}") from None
    texts = [t for t in texts if t]
    if len(texts) < 2:
        raise ConfigError(f"--texts {path}: {len(texts)} texts; expected at least 2")
    return texts


def measure_accuracy(
    model_dir: Path,
    precisions: Sequence[str],
    texts: Sequence[str],
    device: str = "cpu",
    k: int = 10,
) -> list[AccuracyReport]:
    """Each precision of ``precisions`` against fp32 on ``texts`` (fp32 itself included if
    asked: its report is the identity, a check of the method)."""
    model = text_model(model_dir)
    fp32 = load_at(model, "fp32", device)
    try:
        reference = embed(fp32, model, texts)
    finally:
        fp32.unload()
    reports = []
    for precision in precisions:
        backend = load_at(model, precision, device)
        try:
            reports.append(compare(precision, embed(backend, model, texts), reference, k))
        finally:
            backend.unload()
    return reports
