"""Ensembles, the pure parts: graph validation of the ``ensemble`` section (config.yaml and
Triton's config.pbtxt / JSON), the DAG run of one request, the load-time checks against the
step models' configurations, and the scheduler driving steps on fake step schedulers."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from gpuserve.config import ModelConfig, parse_model_config
from gpuserve.engine.calls import check_call_inputs
from gpuserve.engine.checks import check_request
from gpuserve.engine.ensemble.plan import EnsemblePlan, EnsembleRun, step_problems
from gpuserve.engine.request import InferenceRequest, InferenceResponse
from gpuserve.engine.runners.ensemble import EnsembleRunner
from gpuserve.errors import (
    BackendError,
    ConfigError,
    InvalidInputError,
    ModelNotReadyError,
    RequestTimeoutError,
)
from gpuserve.repository.triton.pbtxt import parse_text
from gpuserve.repository.triton.config import triton_config, triton_config_from_json

PATH = Path("repo/ens/config.yaml")

DIAMOND = """
backend: ensemble
max_batch_size: 8
inputs: [{name: IN, datatype: FP32, shape: [4]}]
outputs: [{name: OUT, datatype: FP32, shape: [4]}]
ensemble:
  steps:
    - {model_name: join, input_map: {A: left, B: right}, output_map: {Y: OUT}}
    - {model_name: split, input_map: {X: IN}, output_map: {L: l0, R: r0}}
    - {model_name: f, input_map: {X: l0}, output_map: {Y: left}}
    - {model_name: g, input_map: {X: r0}, output_map: {Y: right}}
"""


def config(text: str) -> ModelConfig:
    return parse_model_config(yaml.safe_load(text), PATH, "ens")


def step(name: str, inputs: list[str], outputs: list[str], batch: int = 8, **kw: Any) -> str:
    ins = ", ".join(f"{{name: {n}, datatype: {kw.get('dt', 'FP32')}, shape: [4]}}" for n in inputs)
    outs = ", ".join(f"{{name: {n}, datatype: FP32, shape: [4]}}" for n in outputs)
    return f"backend: python\nmax_batch_size: {batch}\ninputs: [{ins}]\noutputs: [{outs}]\n"


def steps_of(ens: ModelConfig, texts: dict[str, str]) -> dict[int, ModelConfig]:
    assert ens.ensemble is not None
    return {
        i: parse_model_config(yaml.safe_load(texts[s.model_name]), PATH, s.model_name)
        for i, s in enumerate(ens.ensemble.steps)
    }


# -- graph validation ----------------------------------------------------------------------


def test_a_diamond_is_a_valid_graph_and_runs_in_dependency_order():
    ens = config(DIAMOND)
    plan = EnsemblePlan.of(ens)
    run = EnsembleRun.begin(plan, {"IN": "x"})
    assert run.start() == [1]  # split needs only the ensemble input
    assert run.step_inputs(1) == {"X": "x"}
    assert sorted(run.complete(1, {"L": "l", "R": "r"})) == [2, 3]
    assert run.complete(2, {"Y": "fl"}) == []  # join still waits for g
    assert run.complete(3, {"Y": "gr"}) == [0]
    assert run.step_inputs(0) == {"A": "fl", "B": "gr"}
    run.complete(0, {"Y": "out"})
    assert run.done and run.outputs(None) == {"OUT": "out"}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            ("{X: r0}", "{X: nowhere}"),
            "ensemble.steps[3] (model 'g'): input_map.X: tensor 'nowhere' is produced by no step",
        ),
        (("{Y: right}", "{Y: left}"), "tensor 'left' is already produced by the output 'Y'"),
        (("{Y: OUT}", "{Y: other}"), "field 'ensemble': output 'OUT' is produced by no step"),
        (("{X: IN}", "{X: r0}"), "inputs ['IN'] are consumed by no step's input_map"),
        (("{X: l0}", "{X: OUT}"), "the steps form a cycle"),
        (("backend: ensemble", "backend: python"), "backend 'ensemble' and an 'ensemble' section"),
    ],
)
def test_bad_graphs_are_refused_naming_file_step_field_and_value(edit, message):
    with pytest.raises(ConfigError) as err:
        config(DIAMOND.replace(*edit))
    assert str(PATH) in err.value.message
    assert message in err.value.message


def test_an_unused_ensemble_input_is_refused():
    text = DIAMOND.replace(
        "inputs: [{name: IN, datatype: FP32, shape: [4]}]",
        "inputs: [{name: IN, datatype: FP32, shape: [4]},"
        " {name: SPARE, datatype: FP32, shape: [1]}]",
    )
    with pytest.raises(ConfigError, match=r"inputs \['SPARE'\] are consumed by no step"):
        config(text)


# -- Triton's config ----------------------------------------------------------------------

PBTXT = """
name: "ens"
platform: "ensemble"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling {
  step [
    { model_name: "f" model_version: 2
      input_map { key: "X" value: "IN" } output_map { key: "Y" value: "mid" } },
    { model_name: "g" model_version: -1
      input_map { key: "X" value: "mid" } output_map { key: "Y" value: "OUT" } }
  ]
}
"""


def test_config_pbtxt_ensemble_scheduling_maps_onto_the_ensemble_section():
    ens = triton_config(parse_text(PBTXT, PATH), PATH, "ens")
    assert ens.backend == "ensemble" and ens.ensemble is not None
    first, second = ens.ensemble.steps
    assert (first.model_name, first.model_version, first.version_label) == ("f", 2, "2")
    assert first.input_map == {"X": "IN"} and first.output_map == {"Y": "mid"}
    assert (second.model_name, second.version_label) == ("g", None)


def test_triton_json_ensemble_keeps_tensor_names_as_given():
    data = {
        "name": "ens",
        "platform": "ensemble",
        "maxBatchSize": 8,
        "input": [{"name": "IN", "dataType": "TYPE_FP32", "dims": [4]}],
        "output": [{"name": "OUT", "dataType": "TYPE_FP32", "dims": [4]}],
        "ensembleScheduling": {
            "step": [
                {
                    "modelName": "f",
                    "inputMap": {"INPUT0": "IN"},
                    "outputMap": {"OUTPUT0": "OUT"},
                }
            ]
        },
    }
    ens = triton_config_from_json(data, PATH, "ens")
    assert ens.ensemble is not None
    assert ens.ensemble.steps[0].input_map == {"INPUT0": "IN"}
    assert ens.ensemble.steps[0].output_map == {"OUTPUT0": "OUT"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            PBTXT.replace('platform: "ensemble"', 'backend: "python"'),
            "field 'ensemble_scheduling': needs platform \"ensemble\"",
        ),
        (
            PBTXT.replace(
                'model_name: "f" model_version: 2', 'model_name: "f" model_namespace: "x"'
            ),
            "field 'ensemble_scheduling.step[0].model_namespace'",
        ),
        (
            PBTXT.replace('input_map { key: "X" value: "IN" }', 'input_map { key: "X" }'),
            "field 'ensemble_scheduling.step[0].input_map': each entry needs key and value",
        ),
    ],
)
def test_bad_config_pbtxt_ensembles_name_the_field(text, message):
    with pytest.raises(ConfigError) as err:
        triton_config(parse_text(text, PATH), PATH, "ens")
    assert message in err.value.message


# -- load-time checks against the steps ----------------------------------------------------

STEPS = {
    "split": step("split", ["X"], ["L", "R"]),
    "f": step("f", ["X"], ["Y"]),
    "g": step("g", ["X"], ["Y"]),
    "join": step("join", ["A", "B"], ["Y"]),
}


def test_steps_that_fit_have_no_problem():
    ens = config(DIAMOND)
    assert step_problems(ens, steps_of(ens, STEPS)) == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            ("f", step("f", ["Z"], ["Y"])),
            "ensemble.steps[2] (model 'f'): input_map.X: model 'f' has no input 'X'",
        ),
        (
            ("g", step("g", ["X"], ["W"])),
            "ensemble.steps[3] (model 'g'): output_map.Y: model 'g' has no output 'Y'",
        ),
        (
            ("f", step("f", ["X", "EXTRA"], ["Y"])),
            "required input(s) ['EXTRA'] of model 'f' are not mapped",
        ),
        (
            ("f", step("f", ["X"], ["Y"], dt="INT64")),
            "output 'L' of ensemble.steps[1] (model 'split') is FP32, but INT64",
        ),
        (
            ("join", step("join", ["A", "B"], ["Y"], batch=4)),
            "max_batch_size=4, below the ensemble's max_batch_size=8",
        ),
    ],
)
def test_steps_that_do_not_fit_are_named(change, message):
    ens = config(DIAMOND)
    texts = {**STEPS, change[0]: change[1]}
    problems = step_problems(ens, steps_of(ens, texts))
    assert any(message in p for p in problems), problems


# -- the scheduler on fake step schedulers -------------------------------------------------


class FakeStep:
    """A step model's runner: answers with ``fn(inputs)`` on the next loop turn (no
    instances: it neither gives nor takes tensors)."""

    instances: tuple[object, ...] = ()

    def __init__(self, fn, loop, hold: bool = False) -> None:
        self.fn = fn
        self.loop = loop
        self.hold = hold
        self.requests: list[InferenceRequest] = []

    def submit(self, request: InferenceRequest) -> asyncio.Future[InferenceResponse]:
        self.requests.append(request)
        future = self.loop.create_future()
        if not self.hold:
            try:
                outputs = self.fn(request.inputs)
                response = InferenceResponse(request.model_name, "1", request.id, outputs)
                self.loop.call_soon(future.set_result, response)
            except Exception as err:
                self.loop.call_soon(future.set_exception, err)
        return future


class FakeRouter:
    def __init__(self, steps: dict[str, FakeStep]) -> None:
        self.steps = steps

    def runner(self, name: str, version: str | None):
        if name not in self.steps:
            raise ModelNotReadyError(f"model '{name}' is not ready: unloaded")
        return self.steps[name]

    def cold(self, name: str) -> bool:
        return False

    async def ensure_loaded(self, name: str) -> None:
        return None


def fake_steps(loop, **override) -> dict[str, FakeStep]:
    steps = {
        "split": FakeStep(lambda x: {"L": x["X"] + 1, "R": x["X"] - 1}, loop),
        "f": FakeStep(lambda x: {"Y": x["X"] * 2}, loop),
        "g": FakeStep(lambda x: {"Y": x["X"] * 3}, loop),
        "join": FakeStep(lambda x: {"Y": x["A"] + x["B"]}, loop),
    }
    steps.update({k: FakeStep(v, loop) if callable(v) else v for k, v in override.items()})
    return steps


def run_ensemble(text: str, values: np.ndarray, **override):
    async def main():
        loop = asyncio.get_running_loop()
        steps = fake_steps(loop, **override)
        scheduler = EnsembleRunner(config(text), "1", FakeRouter(steps))
        scheduler.attach_loop(loop)
        request = InferenceRequest("ens", None, {"IN": values}, id="r1")
        try:
            return await scheduler.infer(request), scheduler, steps
        except Exception as err:
            return err, scheduler, steps

    return asyncio.run(main())


def test_the_scheduler_composes_the_steps_and_keeps_statistics():
    values = np.arange(8, dtype=np.float32).reshape(2, 4)
    response, scheduler, steps = run_ensemble(DIAMOND, values)
    assert isinstance(response, InferenceResponse)
    np.testing.assert_allclose(response.outputs["OUT"], (values + 1) * 2 + (values - 1) * 3)
    assert response.id == "r1" and response.rows == 2
    assert steps["f"].requests[0].requested_outputs == ["Y"]
    stats = scheduler.stats.as_dict()
    assert stats["inference_count"] == 2
    assert [s["success"]["count"] for s in stats["ensemble_steps"]] == [1, 1, 1, 1]
    assert scheduler.in_flight_requests == 0


def test_a_failing_step_fails_the_request_naming_the_step():
    def broken(_: Any) -> dict:
        raise BackendError("model 'g' raised ValueError: boom")

    error, scheduler, steps = run_ensemble(DIAMOND, np.zeros((1, 4), np.float32), g=broken)
    assert isinstance(error, BackendError)
    assert error.message.startswith("ensemble 'ens' ensemble.steps[3] (model 'g'): ")
    assert "boom" in error.message
    assert steps["join"].requests == []  # never reached
    assert scheduler.stats.fail_reasons["backend_error"] == 1


def test_a_step_model_that_is_not_served_is_503_naming_it():
    async def main():
        loop = asyncio.get_running_loop()
        steps = fake_steps(loop)
        del steps["join"]
        scheduler = EnsembleRunner(config(DIAMOND), "1", FakeRouter(steps))
        scheduler.attach_loop(loop)
        with pytest.raises(ModelNotReadyError, match=r"ensemble.steps\[0\] \(model 'join'\)"):
            await scheduler.infer(InferenceRequest("ens", None, {"IN": np.zeros((1, 4))}))

    asyncio.run(main())


def test_a_step_past_step_timeout_s_fails_the_request_and_drops_its_step():
    text = DIAMOND.replace("ensemble:\n", "ensemble:\n  step_timeout_s: 0.01\n")

    async def main():
        loop = asyncio.get_running_loop()
        held = FakeStep(lambda x: x, loop, hold=True)
        steps = fake_steps(loop, f=held)
        scheduler = EnsembleRunner(config(text), "1", FakeRouter(steps))
        scheduler.attach_loop(loop)
        with pytest.raises(RequestTimeoutError, match=r"steps\[2\] \(model 'f'\).*0.01"):
            await scheduler.infer(InferenceRequest("ens", None, {"IN": np.zeros((1, 4))}))
        assert held.requests[0].is_cancelled is not None and held.requests[0].is_cancelled()
        assert scheduler.in_flight_requests == 0

    asyncio.run(main())


# -- business-logic scripting: the checks of a call's inputs -------------------------------


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"X": np.zeros((2, 4), np.float32), "Z": np.zeros((2, 4))}, r"no input\(s\) \['Z'\]"),
        ({}, r"required input\(s\) \['X'\] not given"),
        ({"X": np.zeros((2, 4), np.int64)}, "dtype int64, expected FP32"),
        ({"X": [1.0, 2.0]}, "expected a numpy array, got list"),
    ],
)
def test_a_calls_inputs_are_checked_against_the_callee(inputs, message):
    callee = parse_model_config(yaml.safe_load(STEPS["f"]), PATH, "f")
    with pytest.raises(InvalidInputError, match=message):
        check_call_inputs(callee, inputs)
    check_call_inputs(callee, {"X": np.zeros((8, 4), np.float32)})  # fits


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (
            {"X": np.zeros(4, np.float32)},
            "input 'X': shape [4] has 1 dimensions but the model expects 2: [-1, 4] "
            "(the first dimension is the batch, 1..8)",
        ),
        (
            {"X": np.zeros((9, 4), np.float32)},
            "input 'X': shape [9, 4]: batch dimension 9 exceeds max_batch_size 8",
        ),
    ],
)
def test_a_calls_shapes_are_checked_as_a_clients(inputs, message):
    # by the callee's runner on entry, as every request's (engine/checks.py)
    callee = parse_model_config(yaml.safe_load(STEPS["f"]), PATH, "f")
    check_call_inputs(callee, inputs)  # names and datatypes only
    with pytest.raises(InvalidInputError) as refused:
        check_request(callee, "f", inputs, None, 0)
    assert refused.value.message == message
    check_request(callee, "f", {"X": np.zeros((8, 4), np.float32)}, None, 0)  # fits


def test_models_validate_reports_a_step_that_names_no_model(tmp_path):
    from gpuserve.repository.scan import validate_repository
    from tests.fixtures.ensemble_models import PIPELINE, pipeline_repository, write_model

    pipeline_repository(tmp_path)
    assert validate_repository(tmp_path) == []
    write_model(
        tmp_path, "pipeline", PIPELINE.replace("model_name: double", "model_name: nope"), None
    )
    assert validate_repository(tmp_path) == [
        f"{tmp_path / 'pipeline'}: field 'ensemble.steps[2].model_name': 'nope' is not another "
        "model of the repository (['add_one', 'combine', 'double', 'pipeline'])"
    ]


def test_decoupled_step_models_are_refused():
    ens = config(DIAMOND)
    decoupled = step("f", ["X"], ["Y"]) + "model_transaction_policy: {decoupled: true}\n"
    problems = step_problems(ens, steps_of(ens, {**STEPS, "f": decoupled}))
    assert any("ensemble.steps[2] (model 'f'): model 'f' is decoupled" in p for p in problems)


def test_statistics_are_one_type_tagged_by_their_steps():
    """An ensemble's statistics are a ModelStats whose ``ensemble_steps`` is set (no subclass
    carries the mode); every other model's JSON has no ``ensemble_steps``."""
    from gpuserve.engine.stats import ModelStats, StepStats

    plain = ModelStats("m", "1")
    assert "ensemble_steps" not in plain.as_dict()
    steps = [StepStats(0, "a"), StepStats(1, "b")]
    steps[1].fail.add(0.5)
    whole = ModelStats("e", "1", ensemble_steps=steps)
    assert type(whole) is ModelStats
    listed = whole.as_dict()["ensemble_steps"]
    assert [(s["step"], s["model"], s["fail"]["count"]) for s in listed] == [(0, "a", 0), (1, "b", 1)]
