"""Sequence ids carried per row to python models (``request.correlation_id()``)."""

from __future__ import annotations

import numpy as np
import pytest

from gpuserve.backends.base import Backend, Capabilities
from gpuserve.backends.correlation import (
    CORRELATION_INPUT,
    correlation_ids,
    sequence_id_of,
    without_correlation_input,
)
from gpuserve.backends.triton_python.backend import PythonModelBackend, TritonPythonRunner
from gpuserve.config import ModelConfig
from gpuserve.engine.assembly import shape_key
from gpuserve.engine.correlation import add_correlation_input, wants_correlation_ids
from gpuserve.engine.request import InferenceRequest


def request(rows: int, **parameters) -> InferenceRequest:
    inputs = {"X": np.arange(rows, dtype=np.int32).reshape(rows, 1)}
    return InferenceRequest("m", None, inputs, parameters=parameters)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(5, 5), ("abc", "abc"), ("7", "7"), (0, None), ("", None), (True, None), (1.5, None)],
)
def test_usable_sequence_ids(value, expected):
    assert sequence_id_of({"sequence_id": value}) == expected
    assert sequence_id_of({}) is None


def test_a_request_with_an_id_gets_it_on_every_row_and_keeps_its_own_dict():
    r = request(3, sequence_id="s-1")
    original = r.inputs
    add_correlation_input(r, 3)
    assert list(original) == ["X"]  # the caller's dict is untouched
    ids = r.inputs[CORRELATION_INPUT]
    assert ids.dtype == object and ids.tolist() == ["s-1", "s-1", "s-1"]
    assert next(iter(r.inputs)) == "X"  # rows are still read from the first input
    plain = request(3)
    add_correlation_input(plain, 3)
    assert CORRELATION_INPUT not in plain.inputs
    assert shape_key(r) != shape_key(plain)  # never one batch of both


READS = Capabilities(reads_row_ids=True)


def test_only_models_whose_backends_read_ids_get_them_unless_padded_or_decoupled():
    base = {
        "name": "m",
        "inputs": [{"name": "X", "datatype": "INT32", "shape": [1]}],
        "outputs": [{"name": "Y", "datatype": "INT32", "shape": [1]}],
    }
    plain = ModelConfig(backend="python", **base)
    assert wants_correlation_ids(plain, False, READS)
    assert not wants_correlation_ids(plain, False, Capabilities.common([READS, Capabilities()]))
    assert not wants_correlation_ids(plain, False, Capabilities.common([]))
    assert not wants_correlation_ids(plain, True, READS)
    decoupled = ModelConfig(backend="python", model_transaction_policy={"decoupled": True}, **base)
    assert not wants_correlation_ids(decoupled, False, READS)
    triton = PythonModelBackend()
    triton.impl = TritonPythonRunner(object)
    assert triton.capabilities().reads_row_ids
    assert triton.capabilities().streams_batches


def test_ids_of_a_stacked_batch_row_by_row():
    ids = np.array([7, "a", b"", 9], dtype=object)  # b"": a sequence batch's filler row
    inputs = {"X": np.zeros((4, 1)), CORRELATION_INPUT: ids}
    assert correlation_ids(inputs, 4) == [7, "a", 0, 9]
    assert correlation_ids({"X": np.zeros((2, 1))}, 2) == [0, 0]
    stripped = without_correlation_input(inputs)
    assert list(stripped) == ["X"] and CORRELATION_INPUT in inputs
    plain = {"X": np.zeros(1)}
    assert without_correlation_input(plain) is plain


def test_the_triton_runner_builds_one_request_per_row_with_its_id():
    runner = TritonPythonRunner(object)
    runner.batched = True
    inputs = {
        "X": np.arange(3, dtype=np.int32).reshape(3, 1),
        CORRELATION_INPUT: np.array([11, "b", 11], dtype=object),
    }
    requests = runner.preprocess(inputs)
    assert [r.correlation_id() for r in requests] == [11, "b", 11]
    assert [[t.name() for t in r.inputs()] for r in requests] == [["X"]] * 3
    assert [int(r.inputs()[0].as_numpy()[0, 0]) for r in requests] == [0, 1, 2]
    runner.batched = False
    (whole,) = runner.preprocess({"X": np.zeros(2), CORRELATION_INPUT: np.array(["z"], object)})
    assert whole.correlation_id() == "z" and [t.name() for t in whole.inputs()] == ["X"]
    (none,) = runner.preprocess({"X": np.zeros(2)})
    assert none.correlation_id() == 0


class _Recorder(Backend):
    def __init__(self) -> None:
        self.seen: list[list[str]] = []

    def load(self, context) -> None:  # pragma: no cover - not loaded here
        pass

    def preprocess(self, inputs):
        self.seen.append(list(inputs))
        return inputs

    def forward(self, prepared):  # pragma: no cover - not run here
        return prepared

    def postprocess(self, raw):  # pragma: no cover - not run here
        return raw


def test_a_gpuserve_model_never_sees_the_ids_input():
    backend = PythonModelBackend()
    inner = _Recorder()
    backend.impl = inner
    backend.preprocess({"X": np.zeros((1, 1)), CORRELATION_INPUT: np.array([3], object)})
    assert inner.seen == [["X"]]
