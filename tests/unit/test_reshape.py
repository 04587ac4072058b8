"""Input/output ``reshape`` (pure): Triton's rules, the shape mapping, the engine's spec, the
scheduling core applying it, the signature check and the ModelConfig view."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from gpuserve.backends.signature import ModelSignature, ModelTensor, complete_config
from gpuserve.config import ModelConfig, parse_model_config
from gpuserve.config.reshape import reshape_problem, transfer_shape
from gpuserve.config.triton import triton_model_config_dict
from gpuserve.engine.assembly import OutputSpec, split_outputs, stack_inputs
from gpuserve.engine.batch import BatchResult
from gpuserve.engine.request import InferenceRequest, InferenceResponse
from gpuserve.engine.reshape import ReshapeSpec
from gpuserve.engine.scheduling import SchedulerCore
from gpuserve.errors import BackendError, ConfigError, InvalidInputError
from gpuserve.repository.triton.pbtxt import parse_text
from gpuserve.repository.triton.config import triton_config
from gpuserve.server.grpc.messages import model_config
from gpuserve.service.views import ModelConfigView

YAML = Path("/repo/m/config.yaml")
PBTXT = Path("/repo/m/config.pbtxt")


def tensor(name: str, shape, reshape=None, datatype: str = "FP32", **extra) -> dict:
    spec = {"name": name, "datatype": datatype, "shape": list(shape), **extra}
    if reshape is not None:
        spec["reshape"] = list(reshape)
    return spec


def config(inputs, outputs, max_batch_size: int = 8, **fields) -> ModelConfig:
    data = {"backend": "python", "max_batch_size": max_batch_size, **fields}
    return parse_model_config({**data, "inputs": inputs, "outputs": outputs}, YAML, "m")


# -- Triton's rules -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dims", "reshape", "batching"),
    [
        ([4], [2, 2], True),
        ([2, 3, 4], [6, 4], False),
        ([1], [], True),  # a scalar per row
        ([1, 1], [], True),
        ([2, 4, -1, 6], [8, -1, 1, 6], True),  # Triton's own example
        ([-1], [-1, 1], True),
        ([-1, 4], [-1, 2, 2], False),
        ([3], [3], False),  # equal: a no-op
    ],
)
def test_valid_reshapes(dims, reshape, batching):
    assert reshape_problem(dims, reshape, batching) is None


@pytest.mark.parametrize(
    ("dims", "reshape", "batching", "problem"),
    [
        ([4], [3], True, "reshape [3] holds 3 elements, but dims [4] hold 4"),
        ([4], [0, 4], True, "each reshape dim must be a positive integer or -1, got [0, 4]"),
        ([4], [-2, -2], True, "each reshape dim must be a positive integer or -1"),
        ([1], [], False, "an empty reshape needs a batching model"),
        ([2], [], True, "an empty reshape needs dims of one element (such as [1]), got [2]"),
        ([-1], [], True, "an empty reshape needs dims of one element"),
        ([-1], [4], True, "reshape [4] has 0 variable (-1) dimension(s) and dims [-1] has 1"),
        ([4], [-1], True, "reshape [-1] has 1 variable (-1) dimension(s) and dims [4] has 0"),
        ([2, -1], [-1, 2], True, "the fixed dimensions between the variable (-1) ones"),
        ([-1, 6], [-1, 4], True, "does not fit dims [-1, 6]"),
    ],
)
def test_invalid_reshapes_say_why(dims, reshape, batching, problem):
    text = reshape_problem(dims, reshape, batching)
    assert text is not None and problem in text


@pytest.mark.parametrize(
    ("shape", "source", "target", "expected"),
    [
        ((4,), (4,), (2, 2), (2, 2)),
        ((2, 2), (2, 2), (4,), (4,)),
        ((1,), (1,), (), ()),
        ((), (), (1,), (1,)),
        ((2, 4, 5, 6), (2, 4, -1, 6), (8, -1, 1, 6), (8, 5, 1, 6)),
        ((8, 5, 1, 6), (8, -1, 1, 6), (2, 4, -1, 6), (2, 4, 5, 6)),
        ((7, 3, 12), (-1, 3, -1), (-1, -1, 3), (7, 12, 3)),  # -1s taken in order
    ],
)
def test_transfer_shape_fills_variable_dims_in_order(shape, source, target, expected):
    assert transfer_shape(shape, source, target) == expected


@pytest.mark.parametrize(("shape", "source"), [((5,), (4,)), ((4, 1), (4,)), ((), (-1,))])
def test_transfer_shape_refuses_a_shape_that_does_not_fit(shape, source):
    with pytest.raises(ValueError, match="does not fit"):
        transfer_shape(shape, source, source)


# -- config.yaml --------------------------------------------------------------------------


def test_config_yaml_takes_a_reshape_and_names_the_field_of_a_bad_one():
    cfg = config([tensor("A", [4], [2, 2])], [tensor("B", [1], [])])
    assert cfg.inputs[0].reshape == [2, 2] and cfg.outputs[0].reshape == []
    assert cfg.inputs[0].shape == [4]  # clients keep using the shape
    with pytest.raises(ConfigError) as err:
        config([tensor("A", [4], [3])], [tensor("B", [1])])
    message = err.value.message
    assert str(YAML) in message and "field 'inputs'" in message
    assert "inputs[0] ('A'): reshape [3] holds 3 elements, but shape [4] hold 4" in message
    with pytest.raises(ConfigError, match=r"field 'outputs.0.reshape': each reshape dim"):
        config([tensor("A", [4])], [tensor("B", [4], [0])])
    with pytest.raises(ConfigError, match=r"outputs\[0\] \('B'\): an empty reshape needs a batch"):
        config([tensor("A", [4])], [tensor("B", [1], [])], max_batch_size=0)


@pytest.mark.parametrize(
    ("fields", "what"),
    [
        ({"model_transaction_policy": {"decoupled": True}}, "a decoupled model"),
        ({"sequence_batching": {}}, "sequence_batching"),
    ],
)
def test_what_a_reshape_is_not_served_with_yet_is_refused_clearly(fields, what):
    with pytest.raises(ConfigError) as err:
        config([tensor("A", [4], [2, 2])], [tensor("B", [4])], **fields)
    assert (
        "a reshape different from the shape (input 'A') is not supported by gpuserve yet "
        f"with {what}"
    ) in err.value.message
    config([tensor("A", [4], [4])], [tensor("B", [4])], **fields)  # an equal one is a no-op


def test_a_padded_input_cannot_reshape():
    with pytest.raises(ConfigError, match="not supported by gpuserve yet with pad_value"):
        config([tensor("A", [-1], [-1, 1], pad_value=0)], [tensor("B", [1])])


# -- config.pbtxt -------------------------------------------------------------------------

PBTXT_MODEL = """
backend: "python"
max_batch_size: 4
input [ { name: "A" data_type: TYPE_FP32 dims: [ 4 ] reshape: { shape: [ 2, 2 ] } },
        { name: "S" data_type: TYPE_INT32 dims: [ 1 ] reshape: { shape: [ ] } } ]
output [ { name: "B" data_type: TYPE_FP32 dims: [ -1, 6 ] reshape: { shape: [ -1, 2, 3 ] } } ]
"""


def from_pbtxt(text: str) -> ModelConfig:
    return triton_config(parse_text(text, PBTXT), PBTXT, "m")


def test_pbtxt_reshape_maps_and_shows_in_tritons_model_config():
    cfg = from_pbtxt(PBTXT_MODEL)
    assert [(s.shape, s.reshape) for s in cfg.inputs] == [([4], [2, 2]), ([1], [])]
    view = triton_model_config_dict("m", "python", cfg)
    assert view["input"][0]["dims"] == [4]
    assert view["input"][0]["reshape"] == {"shape": [2, 2]}
    assert view["input"][1]["reshape"] == {"shape": []}
    assert view["output"][0]["reshape"] == {"shape": [-1, 2, 3]}
    message = model_config(ModelConfigView("m", "python", cfg))
    assert list(message.input[0].reshape.shape) == [2, 2]
    assert message.input[1].HasField("reshape") and not message.input[1].reshape.shape
    plain = from_pbtxt(PBTXT_MODEL.replace("reshape: { shape: [ 2, 2 ] }", ""))
    assert "reshape" not in triton_model_config_dict("m", "python", plain)["input"][0]


@pytest.mark.parametrize(
    ("replace", "field", "problem"),
    [
        (
            "shape: [ 2, 2 ]",
            "input[0].reshape",
            "reshape [3] holds 3 elements, but dims [4] hold 4",
        ),
        ("shape: [ -1, 2, 3 ]", "output[0].reshape", "has 0 variable (-1) dimension(s)"),
        ("max_batch_size: 4", "input[1].reshape", "an empty reshape needs a batching model"),
    ],
)
def test_pbtxt_reshape_errors_name_file_field_and_value(replace, field, problem):
    bad = {"shape: [ 2, 2 ]": "shape: [ 3 ]", "shape: [ -1, 2, 3 ]": "shape: [ 2, 3 ]"}
    text = PBTXT_MODEL.replace(replace, bad.get(replace, "max_batch_size: 0"))
    with pytest.raises(ConfigError) as err:
        from_pbtxt(text)
    message = err.value.message
    assert message.startswith(f"{PBTXT}: field '{field}': ") and problem in message
    assert "(given: [" in message


def test_pbtxt_reshape_takes_only_shape():
    with pytest.raises(ConfigError, match=r"field 'input\[0\].reshape.dims'"):
        from_pbtxt(PBTXT_MODEL.replace("shape: [ 2, 2 ]", "dims: [ 2, 2 ]"))


# -- the engine's spec ------------------------------------------------------------------------


def reshaping(max_batch_size: int = 8) -> ModelConfig:
    return config(
        [tensor("A", [4], [2, 2]), tensor("T", [-1, 6], [-1, 2, 3]), tensor("P", [3])],
        [tensor("B", [1], []), tensor("V", [-1, 6], [-1, 3, 2]), tensor("Q", [2])],
        max_batch_size=max_batch_size,
    )


def test_spec_lists_only_tensors_whose_reshape_changes_their_shape():
    assert ReshapeSpec.of(config([tensor("A", [4], [4])], [tensor("B", [4])])) is None
    spec = ReshapeSpec.of(reshaping())
    assert spec is not None
    assert [t.name for t in spec.inputs] == ["A", "T"] and [t.name for t in spec.outputs] == [
        "B",
        "V",
    ]


def test_request_inputs_become_views_in_the_models_shape():
    spec = ReshapeSpec.of(reshaping())
    assert spec is not None
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = np.arange(3 * 5 * 6, dtype=np.float32).reshape(3, 5, 6)
    p = np.zeros((3, 3), dtype=np.float32)
    original = InferenceRequest("m", None, {"A": a, "T": t, "P": p}, id="r1")
    model = spec.request(original)
    assert model is not original and model.id == "r1"
    assert original.inputs["A"] is a  # the request the caller holds is unchanged
    assert model.inputs["A"].shape == (3, 2, 2) and np.shares_memory(model.inputs["A"], a)
    assert model.inputs["T"].shape == (3, 5, 2, 3)
    assert model.inputs["P"] is p
    np.testing.assert_array_equal(model.inputs["A"].reshape(3, 4), a)


def test_request_without_batching_and_without_an_optional_input():
    cfg = config(
        [tensor("A", [4], [2, 2]), tensor("T", [-1, 6], [-1, 2, 3], optional=True)],
        [tensor("B", [4], [1, 4])],
        max_batch_size=0,
    )
    spec = ReshapeSpec.of(cfg)
    assert spec is not None
    model = spec.request(InferenceRequest("m", None, {"A": np.zeros(4, np.float32)}))
    assert model.inputs["A"].shape == (2, 2) and "T" not in model.inputs
    assert spec.outputs_of({"B": np.zeros((1, 4), np.float32)})["B"].shape == (4,)


def test_request_that_skipped_validation_is_refused_naming_the_input():
    spec = ReshapeSpec.of(reshaping())
    assert spec is not None
    with pytest.raises(
        InvalidInputError, match=r"input 'A': shape \[2, 5\], expected \[batch, 4\]"
    ):
        spec.request(InferenceRequest("m", None, {"A": np.zeros((2, 5), np.float32)}))


def test_outputs_come_back_in_dims_and_a_bad_one_fails_only_its_request():
    spec = ReshapeSpec.of(reshaping())
    assert spec is not None
    good = {
        "B": np.arange(2, dtype=np.float32),
        "V": np.zeros((2, 7, 3, 2), np.float32),
        "Q": np.zeros((2, 2), np.float32),
    }
    bad = {"B": np.zeros((1, 5), np.float32)}
    error = InvalidInputError("earlier")
    results = spec.results([good, bad, error])
    assert results[0]["B"].shape == (2, 1) and results[0]["V"].shape == (2, 7, 6)
    assert results[0]["Q"] is good["Q"]
    assert isinstance(results[1], BackendError)
    assert "output 'B' of shape [1, 5], which does not fit its reshape [batch]" in str(
        results[1].message
    )
    assert results[2] is error


def test_outputs_may_be_torch_tensors():
    torch = pytest.importorskip("torch")
    spec = ReshapeSpec.of(reshaping())
    assert spec is not None
    out = spec.outputs_of({"V": torch.zeros(2, 4, 3, 2)})
    assert isinstance(out["V"], torch.Tensor) and tuple(out["V"].shape) == (2, 4, 6)


# -- the scheduling core applies it -------------------------------------------------------


@dataclass(eq=False)
class Worker:
    name: str
    capacity: int = 1
    in_flight: int = 0


def test_scheduling_core_batches_in_the_models_shape_and_answers_in_dims():
    cfg = config([tensor("A", [4], [2, 2])], [tensor("B", [4], [2, 2])], max_batch_size=8)
    core: SchedulerCore[Worker] = SchedulerCore(cfg, "1")
    core.attach([Worker("w0")])
    sent = [np.full((rows, 4), rows, np.float32) for rows in (1, 2)]
    items = [core.admit(InferenceRequest("m", None, {"A": a}), 0.0) for a in sent]
    assert [item.shape_key for item in items] == [(("A", (2, 2)),)] * 2
    plan = core.schedule(1.0)
    (record,) = plan.dispatched
    stacked = stack_inputs(record.batch.items)["A"]
    assert stacked.shape == (3, 2, 2)  # what the model receives
    outputs = {"B": stacked * 10}  # the model answers in its reshape
    spec = OutputSpec("m", ("B",), batched=True)
    results = split_outputs(spec, record.batch.items, outputs)
    done = core.complete(BatchResult(record.batch, results, started_s=1.0, finished_s=1.5), 2.0)
    for item, a in zip(done.finished, sent, strict=True):
        assert isinstance(item.outcome, InferenceResponse)
        np.testing.assert_array_equal(item.outcome.outputs["B"], a * 10)  # back in dims [4]


def test_scheduling_core_refuses_an_input_that_cannot_reshape():
    cfg = config([tensor("A", [4], [2, 2])], [tensor("B", [4])])
    core: SchedulerCore[Worker] = SchedulerCore(cfg, "1")
    core.attach([Worker("w0")])
    with pytest.raises(InvalidInputError, match="input 'A'"):
        core.admit(InferenceRequest("m", None, {"A": np.zeros((1, 3), np.float32)}), 0.0)
    assert core.queued == 0 and core.in_flight_requests == 0


# -- the model file is checked against the reshape ---------------------------------------------


def test_signature_compares_the_reshape_with_the_model_file():
    sig = ModelSignature(
        "model.onnx",
        [ModelTensor("A", "FP32", (None, 2, 2))],
        [ModelTensor("B", "FP32", (None,))],
    )
    onnx = {"backend": "onnx", "max_batch_size": 8}
    good = parse_model_config(
        {**onnx, "inputs": [tensor("A", [4], [2, 2])], "outputs": [tensor("B", [1], [])]}, YAML, "m"
    )
    done = complete_config(good, sig, YAML)
    assert done.inputs[0].shape == [4] and done.inputs[0].reshape == [2, 2]
    no_reshape = parse_model_config(
        {**onnx, "inputs": [tensor("A", [4])], "outputs": [tensor("B", [1], [])]}, YAML, "m"
    )
    with pytest.raises(ConfigError) as err:
        complete_config(no_reshape, sig, YAML)
    assert "config.yaml declares shape [4], but model.onnx has [2, 2]" in err.value.message
    wrong = parse_model_config(
        {**onnx, "inputs": [tensor("A", [4], [4, 1])], "outputs": [tensor("B", [1], [])]},
        YAML,
        "m",
    )
    with pytest.raises(ConfigError) as err:
        complete_config(wrong, sig, YAML)
    assert "config.yaml declares reshape [4, 1], but model.onnx has [2, 2]" in err.value.message


def test_a_load_override_in_tritons_json_takes_reshape_too():
    from gpuserve.repository.triton.config import triton_config_from_json

    data = {
        "backend": "python",
        "maxBatchSize": 2,
        "input": [
            {"name": "A", "dataType": "TYPE_FP32", "dims": ["4"], "reshape": {"shape": ["2", "2"]}}
        ],
        "output": [{"name": "B", "data_type": "TYPE_FP32", "dims": [1], "reshape": {}}],
    }
    cfg = triton_config_from_json(data, PBTXT, "m")
    assert (cfg.inputs[0].reshape, cfg.outputs[0].reshape) == ([2, 2], [])
    data["input"][0]["reshape"] = {"shape": [3]}
    with pytest.raises(ConfigError, match=r"field 'input\[0\].reshape': reshape \[3\] holds 3"):
        triton_config_from_json(data, PBTXT, "m")


def test_warmup_samples_are_given_in_dims_and_reach_the_model_reshaped(tmp_path):
    from gpuserve.engine.warmup_samples import warmup_batches

    warm = {
        "model_warmup": [
            {
                "name": "z",
                "batch_size": 2,
                "inputs": {"A": {"data_type": "FP32", "dims": [4], "zero_data": True}},
            }
        ]
    }
    cfg = config([tensor("A", [4], [2, 2])], [tensor("B", [4])], **warm)
    (batch,) = warmup_batches(cfg, tmp_path)
    assert batch.row["A"].shape == (1, 2, 2)
    assert batch.requests == 2
    assert [p.request.inputs["A"].shape for p in batch.batch("m").items] == [(1, 2, 2)] * 2
