"""Triton's classification extension: an output answered as its top-k classes.

A requested output with the parameter ``classification: k`` goes back as a BYTES tensor of
``"score:index"`` strings, ``":label"`` appended when the output declares a ``label_filename``
(one label per line, line ``i`` naming class ``i``; a file in the model folder) and the file
has a line for that index. For a model that batches, each row is ranked on its own and the
tensor's shape is ``[rows, min(k, classes)]``; otherwise ``[min(k, classes)]``, ranking every
element. Scores are printed as Triton prints them (C++ ``std::to_string``: six decimals for
floating-point outputs, the plain integer for integer ones); ties keep the lower index first.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from gpuserve.config import ModelConfig
from gpuserve.engine.request import InferenceResponse
from gpuserve.errors import InvalidInputError

#: Most elements ranked per row (Triton's bound against pathological outputs).
MAX_CLASSES = 1_000_000


def _score(value: np.generic) -> str:
    if isinstance(value, np.floating):
        return f"{float(value):f}"
    return str(int(value))


def top_k(
    array: np.ndarray, k: int, labels: Sequence[str] | None, batched: bool, name: str = ""
) -> np.ndarray:
    """The top ``k`` classes of ``array`` as ``score:index[:label]`` strings.

    Args:
        array: A numeric output; shape ``[rows, ...]`` when ``batched``, else any shape.
        k: Classes to keep per row (at least 1).
        labels: Class labels by index, or None.
        batched: Whether the first dimension is the batch (ranked row by row).
        name: The output's name, for messages.

    Returns:
        ``object`` array of ``bytes``, shape ``[rows, min(k, classes)]`` when ``batched``,
        else ``[min(k, classes)]``.

    Raises:
        InvalidInputError: more than :data:`MAX_CLASSES` classes per row.
    """
    rows = array.reshape(array.shape[0], -1) if batched and array.ndim else array.reshape(1, -1)
    classes = rows.shape[1]
    if classes > MAX_CLASSES:
        raise InvalidInputError(
            f"output {name!r}: {classes} classes per row is too many to classify "
            f"(at most {MAX_CLASSES})"
        )
    keep = min(k, classes)
    result = np.empty((rows.shape[0], keep), dtype=object)
    for row_index, row in enumerate(rows):
        order = np.argsort(-row.astype(np.float64), kind="stable")[:keep]
        for column, index in enumerate(order.tolist()):
            text = f"{_score(row[index])}:{index}"
            if labels is not None and index < len(labels):
                text = f"{text}:{labels[index]}"
            result[row_index, column] = text.encode()
    return result if batched and array.ndim else result.reshape(keep)


@dataclass(frozen=True, slots=True)
class _LabelFile:
    mtime_ns: int
    labels: tuple[str, ...]


class LabelFiles:
    """Label files read once and kept until they change (thread-safe)."""

    def __init__(self) -> None:
        self._files: dict[Path, _LabelFile] = {}
        self._lock = threading.Lock()

    def labels(self, model_dir: Path, filename: str) -> tuple[str, ...]:
        """The labels of ``model_dir/filename``, one per line.

        Raises:
            InvalidInputError: the file cannot be read (the message names it relative to the
                model folder) or lies outside the model folder.
        """
        path = model_dir / filename
        try:
            if not path.resolve().is_relative_to(model_dir.resolve()):
                raise InvalidInputError(f"label_filename {filename!r} is outside the model folder")
            mtime = os.stat(path).st_mtime_ns
        except OSError as err:
            raise InvalidInputError(
                f"cannot read label_filename {filename!r} of model {model_dir.name!r}: "
                f"{err.strerror}"
            ) from None
        with self._lock:
            cached = self._files.get(path)
        if cached is not None and cached.mtime_ns == mtime:
            return cached.labels
        text = path.read_text(encoding="utf-8", errors="replace")
        labels = tuple(line.rstrip("\r") for line in text.split("\n"))
        if labels and labels[-1] == "":
            labels = labels[:-1]
        with self._lock:
            self._files[path] = _LabelFile(mtime, labels)
        return labels


def classify(
    response: InferenceResponse,
    counts: Mapping[str, int],
    config: ModelConfig,
    labels_of: Callable[[str], Sequence[str] | None],
) -> InferenceResponse:
    """``response`` with each output named in ``counts`` replaced by its top-k classes.

    Args:
        response: The engine's answer.
        counts: Output name -> ``k``.
        config: The configuration of the version that answered (batching, datatypes).
        labels_of: Output name -> its labels, or None when it declares none.

    Raises:
        InvalidInputError: see :func:`top_k`, and label files that cannot be read.
    """
    outputs = dict(response.outputs)
    batched = bool(config.max_batch_size)
    for name, k in counts.items():
        array = outputs.get(name)
        if array is None or not isinstance(array, np.ndarray):
            continue  # not answered: the encoder reports a missing or bad output
        if array.dtype.kind not in "iuf":
            continue  # the encoder refuses it against the declared datatype
        outputs[name] = top_k(array, k, labels_of(name), batched, name)
    return replace(response, outputs=outputs)
