"""Requests the server refuses before they reach a model (BC-02, BC-03, BC-04 and BC-07 of
shared/cases/README.md, and bad parameters or requested outputs), over HTTP and gRPC in both
input encodings of each (HTTP: JSON data and the binary tensor extension; gRPC: typed contents
and raw_input_contents).

Each is INVALID_ARGUMENT (HTTP 400) with one exact message. The checks of shape and datatype
are shared, so their message is the same over every encoding; a data size that does not match
the shape is worded after the field that carried the data (the one difference between the
protocols). Each refusal is counted as ``invalid`` and never runs the model, and afterwards
the server still serves the same model and another one ("server alive")."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from tests.integration.frontends import (
    FrontendError,
    Status,
    Tensor,
    attempt,
    failure_reasons,
    tensor,
)

ROW = np.arange(16, dtype=np.float32)
FIELD = {"FP32": "fp32_contents", "BYTES": "bytes_contents", "INT64": "int64_contents"}
ITEMSIZE = {"FP32": 4, "INT64": 8}


def assert_alive(frontend) -> None:
    result = frontend.infer("double_fp32", [tensor("INPUT0", ROW[None])])
    np.testing.assert_array_equal(result.outputs["OUTPUT0"], ROW[None] * 2)
    other = frontend.infer("varlen_fp32", [tensor("X", np.array([[1, 2, 3]], np.float32))])
    np.testing.assert_array_equal(other.outputs["Y"], [[2, 3, 4]])


def count_mismatch(
    name: str, datatype: str, shape: list[int], got: int, model: str = "double_fp32"
) -> dict[str, str]:
    """The message for numeric data of ``got`` elements sent for ``shape``, per encoding
    (the raw ones in Triton's words first)."""
    need = int(np.prod(shape))
    text = f"input {name!r}: shape {shape} needs {need} elements, got {got}"
    got_bytes, need_bytes = got * ITEMSIZE[datatype], need * ITEMSIZE[datatype]
    triton = (
        f"input byte size mismatch for input '{name}' for model '{model}'. Expected "
        f"{need_bytes}, got {got_bytes}"
    )
    sizes = f"{got_bytes} does not match shape {shape} {datatype} = {need_bytes} bytes)"
    return {
        "json": text,
        "contents": f"{text} in contents.{FIELD[datatype]}",
        "binary": f"{triton} (input {name!r}: binary_data_size {sizes}",
        "raw": f"{triton} (input {name!r}: raw_input_contents size {sizes}",
    }


@dataclass(frozen=True)
class Case:
    """One refused request: to ``model``, with ``inputs`` and the ``infer`` keywords
    ``options``; ``message`` is one text, or one per encoding."""

    id: str
    model: str
    inputs: list[Tensor]
    message: str | dict[str, str]
    options: dict[str, Any] | None = None


def fp32(shape: list[int], values: Any, model: str = "double_fp32", name: str = "INPUT0"):
    return [tensor(name, np.asarray(values, np.float32).ravel(), "FP32", shape)]


BATCH_0 = "shape {}: batch dimension 0 is not allowed (must be 1..max_batch_size, here 1..8)"
NEGATIVE = (
    "input 'INPUT0': shape {} has a negative dimension; shapes sent by a client must be "
    "concrete non-negative integers"
)
TWO_BYTES = "input 'TEXT': shape [2, 1] needs 2 elements, got 1"
#: Triton's words for too few BYTES elements, then the byte size.
TOO_FEW = (
    "expected 2 string elements for inference input 'TEXT' for model 'echo_bytes', got 1 ({} 5)"
)

CASES = [
    # BC-02: data/shape mismatch and bad dims
    Case(
        "18-values",
        "double_fp32",
        fp32([1, 16], range(18)),
        count_mismatch("INPUT0", "FP32", [1, 16], 18),
    ),
    Case(
        "17-values",
        "double_fp32",
        fp32([1, 16], range(17)),
        count_mismatch("INPUT0", "FP32", [1, 16], 17),
    ),
    Case(
        "15-values",
        "double_fp32",
        fp32([1, 16], range(15)),
        count_mismatch("INPUT0", "FP32", [1, 16], 15),
    ),
    Case(
        "2-rows-1-given",
        "double_fp32",
        fp32([2, 16], ROW),
        count_mismatch("INPUT0", "FP32", [2, 16], 16),
    ),
    Case(
        "no-values",
        "double_fp32",
        fp32([1, 16], []),
        {
            **count_mismatch("INPUT0", "FP32", [1, 16], 0),
            "contents": "input 'INPUT0': no data: shape [1, 16] needs 16 elements in "
            "contents.fp32_contents or raw_input_contents",
        },
    ),
    Case("wildcard-batch", "double_fp32", fp32([-1, 16], ROW), NEGATIVE.format("[-1, 16]")),
    Case("negative-dim", "double_fp32", fp32([1, -16], ROW), NEGATIVE.format("[1, -16]")),
    Case(
        "no-shape",
        "double_fp32",
        fp32([], ROW),
        "input 'INPUT0': shape [] has 0 dimensions but the model expects 2: [-1, 16] (the first "
        "dimension is the batch, 1..8)",
    ),
    Case(
        "overflowing-shape",
        "double_fp32",
        fp32([4294967296, 4294967296], [1, 2]),
        "input 'INPUT0': shape [4294967296, 4294967296]: batch dimension 4294967296 exceeds "
        "max_batch_size 8",
    ),
    Case(
        "batch-9",
        "double_fp32",
        fp32([9, 16], range(9 * 16)),
        "input 'INPUT0': shape [9, 16]: batch dimension 9 exceeds max_batch_size 8",
    ),
    Case(
        "unknown-input",
        "double_fp32",
        fp32([1, 16], ROW, name="NOPE"),
        "input 'NOPE' is not an input of model 'double_fp32'; its inputs are 'INPUT0'",
    ),
    Case(
        "no-inputs",
        "double_fp32",
        [],
        "expected 1 inputs but got 0 inputs for model 'double_fp32'. Got input(s) [], but "
        "missing required input(s) ['INPUT0']. Please provide all required input(s).",
    ),
    Case(
        "repeated-input",
        "double_fp32",
        fp32([1, 16], ROW) * 2,
        "input 'INPUT0' already exists in request",
    ),
    # BC-03: datatypes
    Case(
        "int32-for-fp32",
        "double_fp32",
        [tensor("INPUT0", np.arange(16, dtype=np.int32)[None])],
        "input 'INPUT0': datatype INT32 does not match the model's FP32",
    ),
    Case(
        "int32-for-int64",
        "tokens_int64",
        [tensor("input_ids", np.array([[101, 2023, 102]], np.int32))],
        "input 'input_ids': datatype INT32 does not match the model's INT64",
    ),
    Case(
        "uint64-for-int64",
        "tokens_int64",
        [tensor("input_ids", np.array([[2**63]], np.uint64))],
        "input 'input_ids': datatype UINT64 does not match the model's INT64",
    ),
    # BC-04: BYTES
    Case(
        "bytes-2-rows-1-given",
        "echo_bytes",
        [tensor("TEXT", [b"a"], "BYTES", [2, 1])],
        {
            "json": TWO_BYTES,
            "contents": f"{TWO_BYTES} in contents.bytes_contents",
            "binary": TOO_FEW.format("binary_data_size"),
            "raw": TOO_FEW.format("raw_input_contents size"),
        },
    ),
    # BC-07: an empty batch
    Case(
        "empty-batch",
        "varlen_fp32",
        fp32([0, 5], [], name="X"),
        "input 'X': " + BATCH_0.format("[0, 5]"),
    ),
    Case(
        "empty-batch-0x0",
        "varlen_fp32",
        fp32([0, 0], [], name="X"),
        "input 'X': " + BATCH_0.format("[0, 0]"),
    ),
    Case(
        "empty-bytes-batch",
        "echo_bytes",
        [tensor("TEXT", np.zeros(0, object), "BYTES", [0, 1])],
        "input 'TEXT': " + BATCH_0.format("[0, 1]"),
    ),
    # requested outputs and request parameters
    Case(
        "unknown-output",
        "double_fp32",
        fp32([1, 16], ROW),
        "output 'NOPE' is not an output of model 'double_fp32'; its outputs are 'OUTPUT0'",
        {"outputs": ["NOPE"]},
    ),
    Case(
        "repeated-output",
        "double_fp32",
        fp32([1, 16], ROW),
        "output 'OUTPUT0' already exists in request",
        {"outputs": ["OUTPUT0", "OUTPUT0"]},
    ),
    Case(
        "priority-level",
        "double_fp32",
        fp32([1, 16], ROW),
        "parameter 'priority': 3 is not a level of model 'double_fp32' (1..1, 1 = highest)",
        {"parameters": {"priority": 3}},
    ),
    Case(
        "priority-negative",
        "double_fp32",
        fp32([1, 16], ROW),
        "request parameter 'priority' must be a non-negative integer, got -1",
        {"parameters": {"priority": -1}},
    ),
    Case(
        "timeout-text",
        "double_fp32",
        fp32([1, 16], ROW),
        "request parameter 'timeout' must be a non-negative integer, got \"x\"",
        {"parameters": {"timeout": "x"}},
    ),
]


def executions(frontend, model: str) -> int:
    (stats,) = frontend.stats(model)
    return stats.execution_count


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_refused_request_is_invalid_argument_with_its_message(server, frontend, case):
    ran = executions(frontend, case.model)
    for client in frontend.variants():
        invalid = failure_reasons(server, case.model).get("invalid", 0)
        with pytest.raises(FrontendError) as err:
            client.infer(case.model, case.inputs, **(case.options or {}))
        assert err.value.status == Status.INVALID_ARGUMENT, (client.encoding, err.value)
        assert err.value.native in (400, "INVALID_ARGUMENT")
        message = case.message if isinstance(case.message, str) else case.message[client.encoding]
        assert err.value.message == message, client.encoding
        assert failure_reasons(server, case.model).get("invalid", 0) == invalid + 1
    assert executions(frontend, case.model) == ran  # refused before the model ran
    assert_alive(frontend)


def test_the_refusals_of_a_batch_window_fail_alone(frontend):
    """BC-14: valid and invalid requests sent together: the valid ones are batched and
    answered, the invalid ones refused before batching."""
    good = [fp32([1, 16], np.full(16, float(i))) for i in range(6)]
    bad = [
        [tensor("INPUT0", np.arange(16, dtype=np.int32)[None])],
        fp32([1, 15], ROW[:15]),
    ]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outcomes = list(
            pool.map(
                lambda inputs: attempt(lambda: frontend.infer("double_fp32", inputs)), good + bad
            )
        )
    for i, outcome in enumerate(outcomes[:6]):
        assert not isinstance(outcome, FrontendError), outcome
        np.testing.assert_array_equal(outcome.outputs["OUTPUT0"], np.full((1, 16), 2.0 * i))
    assert [o.status for o in outcomes[6:]] == [Status.INVALID_ARGUMENT] * 2
