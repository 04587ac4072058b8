"""The tensors of a model's ``model_warmup`` samples (see :mod:`gpuserve.config.warmup`).

Mostly pure functions: a sample's configuration in, numpy arrays out. An instance runs them
through its own stages before its version serves (``Instance`` in :mod:`.instance`); a
decoupled model's requests go one at a time through its backend's ``stream`` into a
:class:`WarmupSink`, which discards the responses and keeps the first error.

One sample becomes ``batch_size`` requests of one row each (shape ``[1, *dims]``) for a
batching model, as Triton sends them, or one request of shape ``dims`` for ``max_batch_size:
0``; every request holds the same row. ``zero_data`` gives zeros (BYTES: empty strings),
``random_data`` random values (floats in [0, 1), integers in [0, 128), random booleans; BYTES:
empty strings, as Triton falls back to zero data for strings), ``input_data_file`` the raw
values of ``<model>/warmup/<file>`` (row-major, little-endian; BYTES elements each a 4-byte
little-endian length followed by that many bytes), whose size must match ``dims`` exactly.
"""

from __future__ import annotations

import math
import struct
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from gpuserve.backends.base import Backend, Capabilities
from gpuserve.config import ModelConfig
from gpuserve.config.warmup import (
    WARMUP_FOLDER,
    WarmupInput,
    WarmupSample,
    WarmupTarget,
    sample_label,
    warmup_problem,
)
from gpuserve.datatypes import numpy_dtype
from gpuserve.engine.assembly import shape_key
from gpuserve.engine.batch import Batch, Pending
from gpuserve.engine.request import InferenceRequest
from gpuserve.engine.reshape import ReshapeSpec
from gpuserve.errors import BackendError, ConfigError, InvalidInputError

__all__ = [
    "WarmupBatch",
    "WarmupSink",
    "check_warmup_files",
    "file_tensor",
    "random_tensor",
    "sample_tensor",
    "stream_sample",
    "warmup_batches",
    "zero_tensor",
]

#: Longest a decoupled model's warmup request may take to send its final response, seconds.
FINAL_TIMEOUT_S = 300.0
#: Random integers are drawn from [0, _RANDOM_INT_HIGH): valid for every integer datatype
#: and a safe index (token ids, class ids) for most models.
_RANDOM_INT_HIGH = 128
_LENGTH = struct.Struct("<I")


@dataclass(slots=True, frozen=True)
class WarmupBatch:
    """One warmup sample, ready to run.

    Attributes:
        label: How errors and logs name it: ``model_warmup[0] ('zeros')``.
        row: Input name -> one request's array: ``[1, *dims]`` for a batching model, ``dims``
            for ``max_batch_size: 0``; BYTES as ``object`` arrays of ``bytes``.
        requests: Requests in the batch (``batch_size``; 1 without batching).
        runs: Times the batch runs (``count``, at least 1).
        batched: Whether the model batches (``max_batch_size > 0``).
    """

    label: str
    row: dict[str, np.ndarray]
    requests: int
    runs: int
    batched: bool

    def batch(self, model: str) -> Batch:
        """A :class:`Batch` of ``requests`` requests of one row each, holding ``row``."""
        items = []
        for _ in range(self.requests):
            request = InferenceRequest(model, None, dict(self.row), id="warmup")
            items.append(Pending(request, 1, shape_key(request), 0.0))
        return Batch.of(items, 0.0)


@dataclass(eq=False)
class WarmupSink:
    """Where a decoupled model sends a warmup request's responses (a
    :class:`~gpuserve.backends.streaming.ResponseSink`): they are counted and dropped; the
    first error is kept; ``finished`` is set by the final mark. Thread-safe.

    Attributes:
        request_id: ``warmup``.
        parameters: None given.
        responses: Responses sent so far.
        error: The first error sent, or None.
        finished: Set once the final mark came.
    """

    request_id: str = "warmup"
    parameters: dict[str, Any] = field(default_factory=dict)
    responses: int = 0
    error: BaseException | None = None
    finished: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def send(
        self,
        outputs: dict[str, np.ndarray] | None,
        *,
        final: bool = False,
        error: BaseException | None = None,
    ) -> bool:
        """Count ``outputs``, keep ``error`` if it is the first; False after the final."""
        with self._lock:
            if self.finished.is_set():
                return False
            if error is not None and self.error is None:
                self.error = error
            if outputs is not None:
                self.responses += 1
            if final:
                self.finished.set()
            return True

    def is_cancelled(self) -> bool:
        """Never: a warmup request runs to its end."""
        return False


def stream_sample(
    backend: Backend,
    capabilities: Capabilities,
    sample: WarmupBatch,
    model: str,
    timeout_s: float = FINAL_TIMEOUT_S,
) -> BaseException | None:
    """One run of ``sample`` on a decoupled model: each of its requests alone through
    ``backend.stream`` (on this thread), waited for until its final response.

    Args:
        backend: The loaded backend.
        capabilities: What it declared at load.
        sample: The sample.
        model: The model's name, for errors.
        timeout_s: Longest wait for one request's final response, seconds.

    Returns:
        The first error (raised by ``stream`` or sent as a response), or None.
    """
    if not capabilities.streams:
        return BackendError(f"model '{model}': its backend cannot run decoupled models")
    stream = backend.stream
    for _ in range(sample.requests):
        sink = WarmupSink()
        try:
            stream(dict(sample.row), sink)
        except BaseException as err:  # the caller turns it into the load's error
            return err
        if not sink.finished.wait(timeout_s):
            return BackendError(f"model '{model}' sent no final response within {timeout_s:.0f} s")
        if sink.error is not None:
            return sink.error
    return None


def zero_tensor(datatype: str, shape: list[int]) -> np.ndarray:
    """Zeros of ``datatype`` (V2 name) and ``shape``; BYTES: empty strings."""
    if datatype == "BYTES":
        return _bytes_array([b""] * math.prod(shape), shape)
    return np.zeros(shape, dtype=numpy_dtype(datatype))


def random_tensor(datatype: str, shape: list[int], rng: np.random.Generator) -> np.ndarray:
    """Random values of ``datatype`` and ``shape``: floats uniform in [0, 1), integers in
    [0, 128), booleans; BYTES: empty strings (Triton's fallback to zero data for strings)."""
    dtype = numpy_dtype(datatype)
    if datatype == "BYTES":
        return zero_tensor(datatype, shape)
    if datatype == "BOOL":
        return rng.integers(0, 2, size=shape).astype(dtype)
    if dtype.kind == "f":
        return rng.random(size=shape).astype(dtype)
    return rng.integers(0, _RANDOM_INT_HIGH, size=shape).astype(dtype)


def file_tensor(path: Path, datatype: str, shape: list[int], field: str) -> np.ndarray:
    """The values of ``path`` (raw, row-major, little-endian; BYTES length-prefixed) as an
    array of ``datatype`` and ``shape``.

    Args:
        path: The file (``<model>/warmup/<input_data_file>``).
        datatype: V2 datatype name.
        shape: The sample input's ``dims``.
        field: The config field, for errors (``model_warmup[0] ('x').inputs.IN.input_data_file``).

    Raises:
        ConfigError: the file is missing or unreadable, or its size does not match ``shape``;
            names the file, the field and the sizes.
    """
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(
            f"{path}: field '{field}': cannot read the warmup data file: "
            f"{err.strerror or err} (given: {path.name!r})"
        ) from None
    count = math.prod(shape)
    if datatype == "BYTES":
        return _bytes_array(_length_prefixed(data, count, path, field), shape)
    dtype = numpy_dtype(datatype)
    expected = count * dtype.itemsize
    if len(data) != expected:
        raise ConfigError(
            f"{path}: field '{field}': the file holds {len(data)} bytes; dims {shape} of "
            f"{datatype} need {expected} ({count} x {dtype.itemsize}) (given: {path.name!r})"
        )
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


def _length_prefixed(data: bytes, count: int, path: Path, field: str) -> list[bytes]:
    elements: list[bytes] = []
    offset = 0
    for index in range(count):
        if offset + _LENGTH.size > len(data):
            raise ConfigError(
                f"{path}: field '{field}': the file ends before element {index} of {count} "
                f"(BYTES elements are a 4-byte little-endian length, then the bytes) "
                f"(given: {path.name!r})"
            )
        (length,) = _LENGTH.unpack_from(data, offset)
        offset += _LENGTH.size
        if offset + length > len(data):
            raise ConfigError(
                f"{path}: field '{field}': element {index} claims {length} bytes but only "
                f"{len(data) - offset} are left (given: {path.name!r})"
            )
        elements.append(data[offset : offset + length])
        offset += length
    if offset != len(data):
        raise ConfigError(
            f"{path}: field '{field}': {len(data) - offset} byte(s) left after the {count} "
            f"BYTES element(s) that dims need (given: {path.name!r})"
        )
    return elements


def _bytes_array(elements: list[bytes], shape: list[int]) -> np.ndarray:
    array = np.empty(len(elements), dtype=object)
    array[:] = elements
    return array.reshape(shape)


def sample_tensor(
    given: WarmupInput,
    model_dir: Path,
    field: str,
    rng: np.random.Generator,
) -> np.ndarray:
    """One sample input's values (shape ``dims``, no batch dimension added).

    Raises:
        ConfigError: its ``input_data_file`` is missing or of the wrong size.
    """
    if given.input_data_file is not None:
        path = model_dir / WARMUP_FOLDER / given.input_data_file
        return file_tensor(path, given.data_type, given.dims, f"{field}.input_data_file")
    if given.random_data is not None:
        return random_tensor(given.data_type, given.dims, rng)
    return zero_tensor(given.data_type, given.dims)


def _check(config: ModelConfig, model_dir: Path) -> None:
    # The config read checked the samples against declared inputs; a backend may have
    # filled them in since (onnx), so they are checked again on the completed config.
    problem = warmup_problem(config.model_warmup, WarmupTarget.of(config))
    if problem is not None:
        raise ConfigError(f"{model_dir}: field 'model_warmup': {problem}")


def check_warmup_files(config: ModelConfig, model_dir: Path) -> None:
    """Read every ``input_data_file`` of ``config.model_warmup`` (at config read, so a
    missing or wrong-sized file is reported before any load).

    Raises:
        ConfigError: a file is missing, unreadable or of the wrong size.
    """
    for index, sample in enumerate(config.model_warmup):
        for name, given in sample.inputs.items():
            if given.input_data_file is not None:
                field = f"{sample_label(index, sample)}.inputs.{name}"
                sample_tensor(given, model_dir, field, np.random.default_rng(0))


def warmup_batches(
    config: ModelConfig, model_dir: Path, rng: np.random.Generator | None = None
) -> list[WarmupBatch]:
    """The samples of ``config.model_warmup`` as batches, in order; samples with
    ``batch_size: 0`` are left out (Triton skips them).

    Args:
        config: The version's (completed) configuration.
        model_dir: The model folder (holding ``warmup/``).
        rng: Source of ``random_data``; None: a fresh unseeded generator.

    Raises:
        ConfigError: a sample does not fit the model's inputs, or a data file is missing or
            of the wrong size; names the folder or file, the field and the value.
    """
    _check(config, model_dir)
    rng = rng if rng is not None else np.random.default_rng()
    batched = config.max_batch_size > 0
    reshape = ReshapeSpec.of(config)
    batches = []
    for index, sample in enumerate(config.model_warmup):
        if sample.batch_size == 0:
            continue
        batch = _batch(sample, sample_label(index, sample), model_dir, batched, rng)
        if reshape is not None:  # the model sees its reshape, as admission gives it requests
            label = batch.label
            try:
                row = reshape.request(InferenceRequest(config.name or "", None, batch.row)).inputs
            except InvalidInputError as err:
                raise ConfigError(f"{label}: {err}") from None
            batch = replace(batch, row=dict(row))
        batches.append(batch)
    return batches


def _batch(
    sample: WarmupSample,
    label: str,
    model_dir: Path,
    batched: bool,
    rng: np.random.Generator,
) -> WarmupBatch:
    row = {}
    for name, given in sample.inputs.items():
        values = sample_tensor(given, model_dir, f"{label}.inputs.{name}", rng)
        row[name] = values[np.newaxis] if batched else values
    return WarmupBatch(
        label=label,
        row=row,
        requests=sample.batch_size if batched else 1,
        runs=sample.runs,
        batched=batched,
    )
