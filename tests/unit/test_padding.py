"""pad_value / unpad: config validation and the pure padding functions of engine/padding.py."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from gpuserve.config import ModelConfig
from gpuserve.engine.batch import Pending
from gpuserve.engine.padding import PaddingSpec
from gpuserve.engine.request import InferenceRequest


def config(inputs, outputs, max_batch_size=8) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "name": "m",
            "backend": "python",
            "max_batch_size": max_batch_size,
            "inputs": inputs,
            "outputs": outputs,
        }
    )


IDS = {"name": "ids", "datatype": "INT64", "shape": [-1], "pad_value": 0}
MASK = {"name": "mask", "datatype": "INT64", "shape": [-1], "pad_value": 0}
PER_TOKEN = {"name": "tok", "datatype": "FP32", "shape": [-1, 2], "unpad": "ids"}
POOLED = {"name": "pooled", "datatype": "FP32", "shape": [2]}


@pytest.mark.parametrize(
    ("inputs", "outputs", "max_batch_size", "message"),
    [
        ([{**IDS, "datatype": "BYTES"}], [POOLED], 8, "BYTES inputs cannot be padded"),
        ([{**IDS, "shape": [4]}], [POOLED], 8, "no variable dimension"),
        ([IDS], [POOLED], 0, "needs max_batch_size > 0"),
        ([IDS], [{**PER_TOKEN, "unpad": "mask"}], 8, "'mask' is not an input with pad_value"),
        ([IDS], [{**PER_TOKEN, "shape": [-1, -1]}], 8, "1 to 1 variable dimension"),
        ([{**IDS, "unpad": "ids"}], [POOLED], 8, "'unpad' is for outputs"),
        ([IDS], [{**POOLED, "pad_value": 0}], 8, "'pad_value' is for inputs"),
    ],
)
def test_bad_declarations_name_the_tensor_and_field(inputs, outputs, max_batch_size, message):
    with pytest.raises(ValidationError, match=message):
        config(inputs, outputs, max_batch_size)


def item(ids: np.ndarray, mask: np.ndarray) -> Pending:
    request = InferenceRequest("m", None, {"ids": ids, "mask": mask})
    return Pending(request, ids.shape[0], (), 0.0)


def test_stack_pads_to_the_longest_and_unpad_cuts_back():
    spec = PaddingSpec.of(config([IDS, {**MASK, "pad_value": 7}], [PER_TOKEN, POOLED]))
    assert spec is not None
    a = item(np.array([[1, 2, 3]]), np.array([[1, 1, 1]]))
    b = item(np.array([[4], [5]]), np.array([[1], [1]]))
    stacked = spec.stack([a, b])
    assert stacked["ids"].tolist() == [[1, 2, 3], [4, 0, 0], [5, 0, 0]]
    assert stacked["mask"].tolist() == [[1, 1, 1], [1, 7, 7], [1, 7, 7]]
    assert spec.key(a.request) == spec.key(b.request)
    assert spec.cost(a.request, 1).lengths == (3,)
    assert spec.cost(b.request, 2).lengths == (1, 1)
    outputs = {"tok": np.zeros((2, 3, 2), np.float32), "pooled": np.ones((2, 2), np.float32)}
    cut = spec.unpad(b, outputs)
    assert cut["tok"].shape == (2, 1, 2) and cut["pooled"].shape == (2, 2)


def test_models_without_pad_value_have_no_spec():
    assert PaddingSpec.of(config([{**IDS, "pad_value": None}], [POOLED])) is None
