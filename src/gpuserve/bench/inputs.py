"""What the bench sends: the model's declared tensors, sample data, and encoded requests.

Samples are generated from the model's metadata (random values of the declared datatype,
short English-like sentences for BYTES) or read from a JSON file in perf_analyzer's format::

    {"data": [{"INPUT0": [1.0, 2.0, ...]},                       # flat, shape from metadata
              {"INPUT0": {"content": [[1, 2], [3, 4]], "shape": [2, 2]}}]}

A sample is one request: ``{input name: numpy array with the batch dimension}``. Requests are
encoded once, before the load starts, so the generator spends nothing per request on encoding.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from gpuserve.datatypes import NUMPY_DTYPES

_VOCABULARY = (
    "the quick brown fox jumps over lazy dog near quiet river bank model server batch "
    "latency throughput request queue compute token sentence embedding vector search "
    "engine graph memory kernel stream fast slow small large green blue morning night"
)
_WORDS = _VOCABULARY.split()


@dataclass(slots=True)
class TensorInfo:
    """A declared tensor. ``shape`` is as the server's metadata gives it (batch dim included
    as -1 when the model batches); -1 marks a variable dimension."""

    name: str
    datatype: str
    shape: list[int]


@dataclass(slots=True)
class ModelInfo:
    """The model under test, from its metadata (and its configuration when the server has
    the model-configuration extension)."""

    name: str
    version: str | None
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    batching: bool

    @classmethod
    def from_metadata(
        cls, metadata: dict[str, Any], config: dict[str, Any] | None, version: str | None
    ) -> ModelInfo:
        """Build from V2 metadata JSON and (optionally) the config JSON.

        Batching is read from ``max_batch_size`` in the config when present, else assumed when
        every input's first dimension is -1 (how gpuserve and Triton show a batch dimension).
        """
        inputs = [
            TensorInfo(t["name"], t["datatype"], list(t["shape"])) for t in metadata["inputs"]
        ]
        outputs = [
            TensorInfo(t["name"], t["datatype"], list(t["shape"]))
            for t in metadata.get("outputs", [])
        ]
        if config is not None and "max_batch_size" in config:
            batching = int(config["max_batch_size"]) > 0
        else:
            batching = bool(inputs) and all(t.shape[:1] == [-1] for t in inputs)
        return cls(metadata.get("name", ""), version, inputs, outputs, batching)


def resolve_shape(
    info: ModelInfo, tensor: TensorInfo, batch_size: int, shapes: dict[str, list[int]]
) -> list[int]:
    """Concrete request shape of ``tensor``: batch dim = ``batch_size``; other -1 dims from
    ``shapes`` (non-batch dims, ``--shape NAME:dims``) or 1.

    Raises:
        ValueError: ``--shape`` gives a different number of dims than declared, or changes a
            fixed dim.
    """
    dims = list(tensor.shape[1:] if info.batching else tensor.shape)
    given = shapes.get(tensor.name)
    if given is not None:
        if len(given) != len(dims):
            raise ValueError(
                f"--shape {tensor.name}: {len(given)} dims given, the model declares "
                f"{len(dims)} (non-batch shape {dims})"
            )
        for declared, value in zip(dims, given, strict=True):
            if declared != -1 and declared != value:
                raise ValueError(
                    f"--shape {tensor.name}: {given} conflicts with the declared shape {dims}"
                )
        dims = list(given)
    dims = [1 if d == -1 else d for d in dims]
    return [batch_size, *dims] if info.batching else dims


def _sentence(rng: np.random.Generator) -> bytes:
    count = int(rng.integers(6, 16))
    return " ".join(rng.choice(_WORDS, count)).capitalize().encode() + b"."


def random_tensor(datatype: str, shape: list[int], rng: np.random.Generator) -> np.ndarray:
    """Random values of a V2 datatype: small non-negative integers (safe as token ids and
    indices), uniform [0, 1) floats, random booleans, sentences for BYTES."""
    size = int(np.prod(shape)) if shape else 1
    if datatype == "BYTES":
        return np.array([_sentence(rng) for _ in range(size)], dtype=object).reshape(shape)
    dtype = NUMPY_DTYPES[datatype]
    if datatype == "BOOL":
        return rng.integers(0, 2, size).astype(bool).reshape(shape)
    if dtype.kind in "iu":
        return rng.integers(0, 100, size).astype(dtype).reshape(shape)
    return rng.random(size).astype(dtype).reshape(shape)


def generate_samples(
    info: ModelInfo,
    batch_size: int = 1,
    shapes: dict[str, list[int]] | None = None,
    count: int = 16,
    seed: int = 0,
) -> list[dict[str, np.ndarray]]:
    """``count`` random requests for ``info`` (the bench cycles through them)."""
    rng = np.random.default_rng(seed)
    shapes = shapes or {}
    concrete = {t.name: resolve_shape(info, t, batch_size, shapes) for t in info.inputs}
    return [
        {t.name: random_tensor(t.datatype, concrete[t.name], rng) for t in info.inputs}
        for _ in range(count)
    ]


def load_samples(path: Path, info: ModelInfo, batch_size: int = 1) -> list[dict[str, np.ndarray]]:
    """Read requests from a perf_analyzer-style JSON file (see the module docstring).

    Raises:
        ValueError: the file is not JSON of that form, names an unknown input, lacks one, or
            its values do not fit the declared shape.
    """
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: cannot read input data: {err}") from None
    entries = document.get("data", [document]) if isinstance(document, dict) else document
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: expected {{'data': [sample, ...]}} with at least one sample")
    declared = {t.name: t for t in info.inputs}
    samples = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: sample {index} is not an object")
        unknown = sorted(set(entry) - set(declared))
        if unknown:
            raise ValueError(f"{path}: sample {index} names unknown inputs {unknown}")
        missing = sorted(set(declared) - set(entry))
        if missing:
            raise ValueError(f"{path}: sample {index} lacks inputs {missing}")
        samples.append(
            {
                name: _tensor_from_json(path, index, info, declared[name], value, batch_size)
                for name, value in entry.items()
            }
        )
    return samples


def _tensor_from_json(
    path: Path, index: int, info: ModelInfo, tensor: TensorInfo, value: Any, batch_size: int
) -> np.ndarray:
    shape = None
    if isinstance(value, dict):
        shape = value.get("shape")
        value = value.get("content", value.get("b64"))
    dtype = NUMPY_DTYPES[tensor.datatype]
    if tensor.datatype == "BYTES":
        flat = np.array(
            [v.encode() if isinstance(v, str) else bytes(v) for v in np.ravel(value)], dtype=object
        )
    else:
        flat = np.asarray(value, dtype=dtype).ravel()
    if shape is None:
        dims = tensor.shape[1:] if info.batching else tensor.shape
        shape = [batch_size, *dims] if info.batching else list(dims)
        if shape.count(-1) > 1:
            raise ValueError(
                f"{path}: sample {index} input {tensor.name}: give 'shape', the declared shape "
                f"{tensor.shape} has several variable dims"
            )
    try:
        return flat.reshape(shape)
    except ValueError:
        raise ValueError(
            f"{path}: sample {index} input {tensor.name}: {flat.size} values do not fit "
            f"shape {shape}"
        ) from None


def _bytes_payload(array: np.ndarray) -> bytes:
    parts = []
    for item in array.ravel():
        data = item if isinstance(item, bytes) else str(item).encode()
        parts.append(struct.pack("<I", len(data)))
        parts.append(data)
    return b"".join(parts)


def tensor_bytes(datatype: str, array: np.ndarray) -> bytes:
    """Raw little-endian bytes of a tensor as the binary extension and gRPC raw contents
    carry them (BYTES: each element as a 4-byte length then its bytes)."""
    if datatype == "BYTES":
        return _bytes_payload(array)
    return np.ascontiguousarray(array, dtype=NUMPY_DTYPES[datatype]).tobytes()


def encode_http_body(
    info: ModelInfo, sample: dict[str, np.ndarray], binary: bool
) -> tuple[bytes, dict[str, str]]:
    """The body and extra headers of a V2 HTTP infer request.

    JSON mode sends tensors as JSON ``data`` and asks for JSON outputs; binary mode uses the
    binary tensor extension both ways.
    """
    tensors = {t.name: t for t in info.inputs}
    inputs: list[dict[str, Any]] = []
    if not binary:
        for name, array in sample.items():
            data = array.ravel().tolist()
            if tensors[name].datatype == "BYTES":
                data = [v.decode("utf-8", "replace") for v in data]
            inputs.append(
                {
                    "name": name,
                    "shape": list(array.shape),
                    "datatype": tensors[name].datatype,
                    "data": data,
                }
            )
        return orjson.dumps({"inputs": inputs}), {"Content-Type": "application/json"}
    payloads: list[bytes] = []
    for name, array in sample.items():
        payload = tensor_bytes(tensors[name].datatype, array)
        payloads.append(payload)
        inputs.append(
            {
                "name": name,
                "shape": list(array.shape),
                "datatype": tensors[name].datatype,
                "parameters": {"binary_data_size": len(payload)},
            }
        )
    outputs = [{"name": t.name, "parameters": {"binary_data": True}} for t in info.outputs]
    header = orjson.dumps({"inputs": inputs, "outputs": outputs})
    headers = {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(header)),
    }
    return header + b"".join(payloads), headers
