"""Each batch row's request context (gpuserve.backends.row_context), built by the engine and
read by Triton Python models: ``request_id()``, ``correlation_id()``, ``flags()``,
``parameters()``, ``is_cancelled()``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gpuserve.backends.base import Backend, Capabilities
from gpuserve.backends.row_context import (
    NO_CONTEXT,
    SEQUENCE_END,
    SEQUENCE_START,
    RowContext,
    sequence_flags,
    sequence_id_of,
)
from gpuserve.backends.streaming import StreamCall
from gpuserve.backends.triton_python.backend import PythonModelBackend, TritonPythonRunner
from gpuserve.engine.batch import Pending
from gpuserve.engine.request import InferenceRequest
from gpuserve.engine.rows import BatchRows, context_of


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


def test_flags_from_the_sequence_parameters():
    assert sequence_flags({}) == 0
    assert sequence_flags({"sequence_start": True}) == SEQUENCE_START
    assert sequence_flags({"sequence_end": True}) == SEQUENCE_END
    assert sequence_flags({"sequence_start": True, "sequence_end": True}) == 3
    assert sequence_flags({"sequence_start": "yes"}) == 0


def test_a_requests_context_is_read_from_what_admission_left_on_it():
    gone = [False]
    r = request(2, sequence_id="s-1", sequence_start=True, tag="x")
    r.id, r.awaited_until, r.is_cancelled = "req-7", 12.5, lambda: gone[0]
    context = context_of(r)
    assert (context.request_id, context.correlation_id, context.flags) == ("req-7", "s-1", 1)
    assert context.parameters["tag"] == "x" and context.awaited_until == 12.5
    assert not context.is_cancelled()
    gone[0] = True
    assert context.is_cancelled()
    plain = context_of(request(1))
    assert (plain.request_id, plain.correlation_id, plain.flags) == ("", 0, 0)
    assert not plain.is_cancelled()


def test_batch_rows_repeat_a_requests_context_per_row_built_on_first_use():
    a, b = request(2, sequence_id=5), request(1, sequence_id="t")
    items = [Pending(a, 2, (), 0.0), Pending(b, 1, (), 0.0)]
    rows = BatchRows(items)
    assert rows._rows is None  # nothing built until read
    assert [row.correlation_id for row in rows] == [5, 5, "t"]
    assert len(rows) == 3 and rows[2].correlation_id == "t"


def test_the_triton_runner_builds_one_request_per_row_with_its_context():
    runner = TritonPythonRunner(object)
    runner.batched, runner.name = True, "m"
    inputs = {"X": np.arange(3, dtype=np.int32).reshape(3, 1)}
    contexts = [
        RowContext("r1", 11, SEQUENCE_START, {"k": 1}),
        RowContext("r2", "b", 0),
        RowContext("r1", 11, SEQUENCE_START, {"k": 1}),
    ]
    requests = runner.preprocess_rows(inputs, contexts)
    assert [r.correlation_id() for r in requests] == [11, "b", 11]
    assert [r.request_id() for r in requests] == ["r1", "r2", "r1"]
    assert [r.flags() for r in requests] == [SEQUENCE_START, 0, SEQUENCE_START]
    assert json.loads(requests[0].parameters()) == {"k": 1}
    assert [int(r.inputs()[0].as_numpy()[0, 0]) for r in requests] == [0, 1, 2]
    runner.batched = False
    (whole,) = runner.preprocess_rows({"X": np.zeros(2)}, [RowContext(correlation_id="z")])
    assert whole.correlation_id() == "z" and [t.name() for t in whole.inputs()] == ["X"]
    (warm,) = runner.preprocess({"X": np.zeros(2)})  # a warm-up sample: no context
    assert warm.correlation_id() == 0 and warm.flags() == 0


def test_a_row_whose_client_left_reads_cancelled_in_execute():
    runner = TritonPythonRunner(object)
    runner.batched, runner.name = True, "m"
    gone = [False]
    (row,) = runner.preprocess_rows(
        {"X": np.zeros((1, 1), np.int32)}, [RowContext(probe=lambda: gone[0])]
    )
    assert not row.is_cancelled()
    gone[0] = True
    assert row.is_cancelled()


def test_triton_models_read_rows_and_a_stream_call_carries_its_context():
    triton = PythonModelBackend()
    triton.impl = TritonPythonRunner(object)
    assert triton.capabilities().reads_rows and triton.capabilities().streams_batches
    assert not Capabilities.common([triton.capabilities(), Capabilities()]).reads_rows
    assert StreamCall({}, None).context is NO_CONTEXT  # type: ignore[arg-type]


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


def test_a_gpuserve_model_gets_its_inputs_only():
    backend = PythonModelBackend()
    inner = _Recorder()
    backend.impl = inner
    backend.preprocess_rows({"X": np.zeros((1, 1))}, [RowContext(correlation_id=3)])
    assert inner.seen == [["X"]]
