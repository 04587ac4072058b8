"""Varied inputs from a file of one request per line (``gpuserve bench --input-lines FILE``).

Two formats, told apart per file (``--input-format auto``: JSON when every line is a JSON
object, else text):

* ``json``: each line is a KServe V2 infer request body, e.g.
  ``{"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["Hi."]}]}``.
  Only ``inputs`` is read (each with ``name``, ``shape``, ``data``; ``datatype`` defaults to the
  declared one); the bench re-encodes it for the chosen protocol and tensor format, so one file
  serves HTTP JSON, the binary extension and gRPC alike.
* ``text``: each line is one text for a model with exactly one BYTES input; the request is
  that input with the text in every element of its shape (``[batch, 1]`` for a batching text
  model such as the default ``text_embedding``).

Empty lines are skipped. Every request keeps its line's texts (the BYTES elements) so that
:mod:`gpuserve.bench.tokens` can size it in tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from gpuserve.bench.inputs import ModelInfo, TensorInfo, resolve_shape
from gpuserve.datatypes import NUMPY_DTYPES

LineFormat = Literal["auto", "json", "text"]
LINE_FORMATS: tuple[str, ...] = ("auto", "json", "text")


@dataclass(frozen=True, slots=True)
class LineInputs:
    """The requests of one file.

    Attributes:
        format: ``json`` or ``text``, as read.
        samples: One request per non-empty line: ``{input name: array with the batch dim}``.
        texts: Per request, the strings its BYTES inputs carry (empty for numeric requests).
    """

    format: Literal["json", "text"]
    samples: list[dict[str, np.ndarray]]
    texts: list[list[str]]


def read_input_lines(
    path: Path, info: ModelInfo, batch_size: int = 1, fmt: str = "auto"
) -> LineInputs:
    """Read ``path`` (see the module docstring).

    Args:
        path: UTF-8 file, one request per line.
        info: The model under test (declared inputs).
        batch_size: Rows per request for ``text`` lines of a batching model.
        fmt: ``auto``, ``json`` or ``text``.

    Raises:
        ValueError: unreadable or empty file, a line that is not a V2 body (its number and
            what is wrong), or text lines for a model without exactly one BYTES input.
    """
    if fmt not in LINE_FORMATS:
        raise ValueError(f"--input-format must be one of {', '.join(LINE_FORMATS)}, got {fmt!r}")
    try:
        raw = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot read input lines: {err}") from None
    numbered = [(n, line) for n, line in enumerate(raw.splitlines(), 1) if line.strip()]
    if not numbered:
        raise ValueError(f"{path}: no requests (the file has no non-empty line)")
    if fmt == "auto":
        fmt = "json" if all(_is_json_object(line) for _, line in numbered) else "text"
    if fmt == "json":
        samples, texts = [], []
        for number, line in numbered:
            sample = _json_sample(path, number, line, info)
            samples.append(sample)
            texts.append(_strings(sample, info))
        return LineInputs("json", samples, texts)
    tensor = _text_input(info)
    shape = resolve_shape(info, tensor, batch_size, {})
    samples = [
        {tensor.name: np.full(shape, line.encode("utf-8"), dtype=object)} for _, line in numbered
    ]
    count = int(np.prod(shape))
    return LineInputs("text", samples, [[line] * count for _, line in numbered])


def _is_json_object(line: str) -> bool:
    stripped = line.lstrip()
    if not stripped.startswith("{"):
        return False
    try:
        return isinstance(json.loads(stripped), dict)
    except ValueError:
        return False


def _text_input(info: ModelInfo) -> TensorInfo:
    texts = [t for t in info.inputs if t.datatype == "BYTES"]
    if len(texts) != 1 or len(info.inputs) != 1:
        declared = ", ".join(f"{t.name} ({t.datatype})" for t in info.inputs) or "none"
        raise ValueError(
            f"text lines need a model with exactly one input, of datatype BYTES; "
            f"{info.name} declares: {declared} (give V2 JSON bodies instead, one per line)"
        )
    return texts[0]


def _json_sample(path: Path, number: int, line: str, info: ModelInfo) -> dict[str, np.ndarray]:
    where = f"{path}:{number}"
    try:
        body = json.loads(line)
    except ValueError as err:
        raise ValueError(f"{where}: not JSON: {err}") from None
    entries = body.get("inputs") if isinstance(body, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{where}: expected a V2 infer body with a non-empty 'inputs' list")
    declared = {t.name: t for t in info.inputs}
    sample: dict[str, np.ndarray] = {}
    for entry in entries:
        if not isinstance(entry, dict) or "name" not in entry or "data" not in entry:
            raise ValueError(f"{where}: every input needs 'name' and 'data'")
        name = entry["name"]
        if name not in declared:
            known = ", ".join(sorted(declared))
            raise ValueError(f"{where}: input {name!r} is not declared by {info.name} ({known})")
        sample[name] = _array(where, entry, declared[name])
    missing = sorted(set(declared) - set(sample))
    if missing:
        raise ValueError(f"{where}: lacks inputs {missing}")
    return sample


def _array(where: str, entry: dict[str, Any], tensor: TensorInfo) -> np.ndarray:
    datatype = entry.get("datatype", tensor.datatype)
    if datatype != tensor.datatype:
        raise ValueError(
            f"{where}: input {tensor.name} has datatype {datatype}, the model declares "
            f"{tensor.datatype}"
        )
    values = np.ravel(np.asarray(entry["data"], dtype=object))
    if datatype == "BYTES":
        flat = np.array(
            [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in values], dtype=object
        )
    else:
        try:
            flat = values.astype(NUMPY_DTYPES[datatype])
        except (TypeError, ValueError):
            raise ValueError(f"{where}: input {tensor.name}: data is not {datatype}") from None
    shape = entry.get("shape", [1, flat.size])
    try:
        return flat.reshape([int(d) for d in shape])
    except (TypeError, ValueError):
        raise ValueError(
            f"{where}: input {tensor.name}: {flat.size} values do not fit shape {shape}"
        ) from None


def _strings(sample: dict[str, np.ndarray], info: ModelInfo) -> list[str]:
    out: list[str] = []
    for tensor in info.inputs:
        if tensor.datatype == "BYTES" and tensor.name in sample:
            out.extend(v.decode("utf-8", "replace") for v in sample[tensor.name].ravel())
    return out
