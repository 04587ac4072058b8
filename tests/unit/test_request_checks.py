"""The checks every runner applies on entry (``engine/checks.py``): the fast path of
:class:`RequestChecks` refuses exactly what the codecs' shape checks refuse, with their
message, and a priority or a requested output the model does not have with one message."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from gpuserve.config import ModelConfig, parse_model_config
from gpuserve.engine.checks import RequestChecks
from gpuserve.errors import InvalidInputError
from gpuserve.protocol.shapes import check_shape, validate_request_shapes


def config(max_batch_size: int) -> ModelConfig:
    data = {
        "name": "m",
        "backend": "python",
        "max_batch_size": max_batch_size,
        "inputs": [
            {"name": "A", "datatype": "FP32", "shape": [2, -1]},
            {"name": "B", "datatype": "INT64", "shape": [3]},
        ],
        "outputs": [{"name": "Y", "datatype": "FP32", "shape": [-1]}],
        "dynamic_batching": {"priority_levels": 3},
    }
    return parse_model_config(data, Path("/repo/m/config.yaml"), "m")


def codec_answer(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> str | None:
    """What the wire codecs say of these shapes (None: nothing)."""
    try:
        for spec in cfg.inputs:
            if spec.name in shapes:
                check_shape(spec, spec.name, list(shapes[spec.name]), cfg.max_batch_size)
        validate_request_shapes(shapes, cfg)
    except InvalidInputError as err:
        if "missing required input" in err.message:
            return None  # the caller's to check, not the runner's
        return err.message
    return None


SHAPES_A = [(1, 2, 5), (2, 2, 0), (0, 2, 5), (9, 2, 5), (1, 3, 5), (1, 2), (2, 5), (1, 2, 5, 1)]
SHAPES_B = [(1, 3), (2, 3), (9, 3), (1, 4), (3,), (0, 3)]


@pytest.mark.parametrize("max_batch_size", [0, 8])
def test_the_fast_path_refuses_what_the_codecs_refuse_with_their_message(max_batch_size):
    cfg = config(max_batch_size)
    checks = RequestChecks(cfg, "m")
    for a, b in itertools.product(SHAPES_A, SHAPES_B):
        if not max_batch_size:  # the same dims without a batch dimension
            a, b = a[1:], b[1:]
        shapes = {"A": a, "B": b}
        expected = codec_answer(cfg, shapes)
        inputs = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
        if expected is None:
            checks.check(inputs, None, 0)
        else:
            with pytest.raises(InvalidInputError) as refused:
                checks.check(inputs, None, 0)
            assert refused.value.message == expected, shapes


def test_priority_and_requested_outputs():
    checks = RequestChecks(config(8), "m")
    inputs = {"A": np.zeros((1, 2, 4), np.float32)}
    checks.check(inputs, ["Y"], 3)
    with pytest.raises(InvalidInputError) as refused:
        checks.check(inputs, None, 4)
    assert refused.value.message == (
        "parameter 'priority': 4 is not a level of model 'm' (1..3, 1 = highest)"
    )
    with pytest.raises(InvalidInputError) as refused:
        checks.check(inputs, ["Y", "Z"], 0)
    assert refused.value.message == "output 'Z' is not an output of model 'm'; its outputs are 'Y'"
