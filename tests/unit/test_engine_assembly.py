"""Batch assembly as pure functions: rows, shape keys, stacking, output checks and the split."""

from __future__ import annotations

import numpy as np
import pytest

from gpuserve.backends.base import RowErrors
from gpuserve.config import ModelConfig, TensorSpec
from gpuserve.engine.assembly import (
    OutputMismatch,
    OutputSpec,
    check_outputs,
    request_rows,
    shape_key,
    split_outputs,
    stack_inputs,
)
from gpuserve.engine.batch import Pending
from gpuserve.engine.request import InferenceRequest
from gpuserve.errors import BackendError, InvalidInputError

SPEC = OutputSpec("m", ("A", "B"), batched=True)


def item(rows: int, start: float = 0.0, requested: list[str] | None = None) -> Pending:
    x = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) + start
    request = InferenceRequest("m", None, {"x": x, "n": np.full((rows, 1), rows)}, requested)
    return Pending(request, request_rows(request), shape_key(request), 0.0)


def test_rows_are_the_first_dimension():
    request = InferenceRequest("m", None, {"x": np.zeros((3, 5)), "y": np.zeros((3,))})
    assert request_rows(request) == 3


def test_shape_key_is_the_non_batch_shape_of_every_input():
    a = InferenceRequest("m", None, {"x": np.zeros((3, 5)), "y": np.zeros((3,))})
    b = InferenceRequest("m", None, {"x": np.zeros((1, 5)), "y": np.zeros((1,))})
    c = InferenceRequest("m", None, {"x": np.zeros((3, 6)), "y": np.zeros((3,))})
    assert shape_key(a) == (("x", (5,)), ("y", ()))
    assert shape_key(a) == shape_key(b) != shape_key(c)
    assert hash(shape_key(a)) == hash(shape_key(b))


def test_stack_concatenates_in_item_order_and_a_single_request_is_not_copied():
    items = [item(1, 0.0), item(3, 100.0)]
    stacked = stack_inputs(items)
    assert stacked["x"].shape == (4, 2) and stacked["x"].dtype == np.float32
    np.testing.assert_array_equal(stacked["x"][0], [0.0, 1.0])
    np.testing.assert_array_equal(stacked["x"][1], [100.0, 101.0])
    np.testing.assert_array_equal(stacked["n"][:, 0], [1, 3, 3, 3])
    alone = item(2)
    assert stack_inputs([alone])["x"] is alone.request.inputs["x"]


def test_check_outputs_refuses_missing_outputs_scalars_and_wrong_row_counts():
    good = {"A": np.zeros((4, 2)), "B": np.zeros((4,))}
    check_outputs(SPEC, good, 4)
    with pytest.raises(OutputMismatch, match=r"did not return output\(s\) \['B'\]"):
        check_outputs(SPEC, {"A": np.zeros((4, 2))}, 4)
    with pytest.raises(OutputMismatch, match="returned 3 rows in output 'A' for a batch of 4"):
        check_outputs(SPEC, {"A": np.zeros((3, 2)), "B": np.zeros((4,))}, 4)
    with pytest.raises(OutputMismatch, match="returned a scalar in output 'B'"):
        check_outputs(SPEC, {"A": np.zeros((4, 2)), "B": np.float32(1.0)}, 4)
    # a model without batching returns whatever shape it likes
    check_outputs(OutputSpec("m", ("A",), batched=False), {"A": np.float32(1.0)}, 1)
    assert issubclass(OutputMismatch, BackendError)


def test_split_uses_the_counted_rows_and_the_requested_outputs():
    items = [item(1), item(3, requested=["B"]), item(2)]
    outputs = {"A": np.arange(6 * 2).reshape(6, 2), "B": np.arange(6) * 10}
    items[1].request.inputs = {}  # the split reads Pending.rows (counted at admission) only
    results = split_outputs(SPEC, items, outputs)
    assert sorted(results[0]) == ["A", "B"]  # every declared output when none is named
    np.testing.assert_array_equal(results[0]["A"], [[0, 1]])
    assert list(results[1]) == ["B"]
    np.testing.assert_array_equal(results[1]["B"], [10, 20, 30])
    np.testing.assert_array_equal(results[2]["A"], [[8, 9], [10, 11]])
    assert np.shares_memory(results[2]["A"], outputs["A"])  # views, not copies


def test_a_batch_of_one_gets_the_arrays_themselves():
    outputs = {"A": np.zeros((2, 2)), "B": np.zeros((2,))}
    (result,) = split_outputs(SPEC, [item(2)], outputs)
    assert result["A"] is outputs["A"]


def test_row_errors_fail_only_the_requests_that_own_the_rows():
    items = [item(1), item(2), item(1)]
    outputs = RowErrors(
        {"A": np.zeros((4, 2)), "B": np.zeros((4,))},
        {2: "bad token", 3: InvalidInputError("row 0 is empty")},
    )
    ok, second, third = split_outputs(SPEC, items, outputs, outputs.errors)
    assert isinstance(ok, dict)
    assert isinstance(second, BackendError)
    assert second.message == "model 'm' failed on row 1 of the request: bad token"
    assert isinstance(third, InvalidInputError)  # a gpuserve error keeps its status


def test_spec_from_config():
    config = ModelConfig(
        name="m",
        max_batch_size=0,
        inputs=[TensorSpec(name="x", datatype="FP32", shape=[2])],
        outputs=[
            TensorSpec(name="A", datatype="FP32", shape=[2]),
            TensorSpec(name="B", datatype="FP32", shape=[1]),
        ],
    )
    f32 = np.dtype(np.float32)
    assert OutputSpec.of(config) == OutputSpec(
        "m", ("A", "B"), batched=False, shapes=((2,), (1,)), dtypes=(f32, f32)
    )


def declared(**extra) -> OutputSpec:
    return OutputSpec(
        "m", ("Y",), batched=True, shapes=((-1, 4),), dtypes=(np.dtype(np.float32),), **extra
    )


def test_outputs_are_checked_against_the_declared_shape_and_datatype():
    spec = declared()
    check_outputs(spec, {"Y": np.zeros((2, 7, 4), np.float32)}, 2)  # -1: any size
    shape = r"output 'Y' of shape \[2, 3\]; its config declares \[-1, -1, 4\]"
    with pytest.raises(OutputMismatch, match=shape):
        check_outputs(spec, {"Y": np.zeros((2, 3), np.float32)}, 2)
    with pytest.raises(OutputMismatch, match="of shape"):
        check_outputs(spec, {"Y": np.zeros((2, 1, 5), np.float32)}, 2)
    exact = {"Y": np.ones((1, 2, 4), np.float64)}
    check_outputs(spec, exact, 1)
    assert exact["Y"].dtype == np.float32  # converted: every value survives
    with pytest.raises(OutputMismatch, match="as float64; its config declares float32"):
        check_outputs(spec, {"Y": np.full((1, 2, 4), 0.1, np.float64)}, 1)
    nan = {"Y": np.full((1, 1, 4), np.nan, np.float64)}
    check_outputs(spec, nan, 1)  # NaN converts exactly
    bytes_spec = OutputSpec("m", ("T",), batched=False, shapes=((1,),), dtypes=(None,))
    check_outputs(bytes_spec, {"T": np.array([b"a"], dtype=object)}, 1)


def test_shape_key_of_one_input_equals_the_general_form():
    one = InferenceRequest("m", None, {"x": np.zeros((2, 7, 3))})
    assert shape_key(one) == (("x", (7, 3)),)
    assert hash(shape_key(one)) == hash((("x", (7, 3)),))
