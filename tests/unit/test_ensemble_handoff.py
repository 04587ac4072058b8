"""The ensemble device hand-off, the pure parts: tensors beside numpy arrays in batch
assembly (``torch.cat`` on their device, one host copy per batch output for the requests
that need host data), which step outputs stay tensors (:func:`kept_outputs`), and the
ensemble scheduler handing tensors on, or moving them to the host for a step that cannot
take them, on fake step schedulers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from gpuserve.backends import tensors
from gpuserve.backends.base import Capabilities
from gpuserve.config import parse_model_config
from gpuserve.engine.assembly import (
    OutputSpec,
    check_outputs,
    kept_tensors,
    shape_key,
    split_outputs,
    stack_inputs,
    wants_tensors,
)
from gpuserve.engine.batch import Pending
from gpuserve.engine.ensemble.handoff import StepPlacement, kept_outputs, placement_of
from gpuserve.engine.ensemble.plan import EnsemblePlan
from gpuserve.engine.request import InferenceRequest, InferenceResponse
from gpuserve.engine.runners.base import VersionRunner
from gpuserve.engine.runners.ensemble import EnsembleRunner

PATH = Path("repo/ens/config.yaml")

# -- tensors helpers -----------------------------------------------------------------------


def test_tensor_helpers_tell_tensors_from_arrays_and_convert():
    array = np.arange(4, dtype=np.float32)
    tensor = torch.arange(4, dtype=torch.float32)
    assert tensors.is_tensor(tensor) and not tensors.is_tensor(array)
    assert not tensors.is_tensor([1, 2])
    assert tensors.to_host(array) is array
    host = tensors.to_host(tensor)
    assert isinstance(host, np.ndarray) and host.dtype == np.float32
    np.testing.assert_array_equal(host, array)
    bf16 = tensors.to_host(torch.ones(2, dtype=torch.bfloat16))
    assert bf16.dtype == np.float32
    assert tensors.device_of(tensor) == "cpu" == tensors.device_of(array)


def test_concat_of_arrays_is_numpy_and_of_tensors_is_a_tensor():
    a = np.ones((1, 2), np.float32)
    b = np.zeros((2, 2), np.float32)
    both = tensors.concat([a, b])
    assert isinstance(both, np.ndarray) and both.shape == (3, 2)
    readonly = np.full((1, 2), 7, np.float32)
    readonly.flags.writeable = False
    mixed = tensors.concat([torch.ones(1, 2), readonly, torch.zeros(2, 2)])
    assert isinstance(mixed, torch.Tensor) and mixed.shape == (4, 2)
    np.testing.assert_array_equal(mixed.numpy()[:, 0], [1, 7, 0, 0])


# -- batch assembly ------------------------------------------------------------------------


def pending(request: InferenceRequest, rows: int) -> Pending:
    return Pending(request=request, rows=rows, shape_key=shape_key(request), arrival_s=0.0)


def client(inputs: dict[str, Any], outputs: list[str] | None = None) -> InferenceRequest:
    return InferenceRequest("m", None, inputs, requested_outputs=outputs)


def step(inputs: dict[str, Any], keep: frozenset[str] = frozenset()) -> InferenceRequest:
    return InferenceRequest("m", None, inputs, keep_tensors=keep)


def test_kept_tensors_and_wants_tensors():
    plain = pending(client({"X": np.ones((1, 4))}), 1)
    keeping = pending(step({"X": np.ones((1, 4))}, frozenset({"Y"})), 1)
    empty = pending(step({"X": np.ones((1, 4))}), 1)
    assert kept_tensors(plain.request) == frozenset()
    assert kept_tensors(keeping.request) == {"Y"}
    assert not wants_tensors([plain, empty])
    assert wants_tensors([plain, keeping])


def test_stack_inputs_cats_tensors_and_keeps_numpy_batches_numpy():
    arrays = [np.full((r, 4), r, np.float32) for r in (1, 2)]
    items = [pending(client({"X": a}), len(a)) for a in arrays]
    stacked = stack_inputs(items)["X"]
    assert isinstance(stacked, np.ndarray) and stacked.shape == (3, 4)
    handed = [pending(step({"X": torch.full((r, 4), float(r))}), r) for r in (1, 2)]
    stacked = stack_inputs([*handed, items[0]])["X"]
    assert isinstance(stacked, torch.Tensor) and stacked.shape == (4, 4)
    np.testing.assert_array_equal(stacked[:, 0].numpy(), [1, 2, 2, 1])
    alone = stack_inputs(handed[:1])["X"]
    assert alone is handed[0].request.inputs["X"]  # a batch of one: the request's own


def test_shape_keys_of_tensors_and_arrays_agree():
    assert shape_key(client({"X": np.ones((2, 4), np.float32)})) == shape_key(
        step({"X": torch.ones(3, 4)})
    )
    assert hash(shape_key(step({"X": torch.ones(3, 4)}))) == hash((("X", (4,)),))


SPEC = OutputSpec("m", ("Y", "Z"), batched=True)


@pytest.fixture
def host_copies(monkeypatch) -> list[tuple[int, ...]]:
    calls: list[tuple[int, ...]] = []
    original = tensors.to_host

    def counting(value: Any) -> np.ndarray:
        if isinstance(value, torch.Tensor):
            calls.append(tuple(value.shape))
        return original(value)

    monkeypatch.setattr(tensors, "to_host", counting)
    return calls


def test_split_outputs_gives_tensors_to_the_keeping_request_and_numpy_to_others(host_copies):
    items = [
        pending(step({"X": torch.ones(2, 4)}, frozenset({"Y"})), 2),
        pending(client({"X": np.ones((1, 4), np.float32)}), 1),
        pending(client({"X": np.ones((3, 4), np.float32)}, ["Y"]), 3),
    ]
    outputs = {"Y": torch.arange(24.0).reshape(6, 4), "Z": torch.zeros(6, 1)}
    check_outputs(SPEC, outputs, 6)  # reads .shape/.ndim of tensors as of arrays
    first, second, third = split_outputs(SPEC, items, outputs)
    assert isinstance(first, dict) and isinstance(second, dict) and isinstance(third, dict)
    assert isinstance(first["Y"], torch.Tensor) and first["Y"].shape == (2, 4)
    assert isinstance(first["Z"], np.ndarray)  # not kept: host data
    assert isinstance(second["Y"], np.ndarray) and isinstance(third["Y"], np.ndarray)
    np.testing.assert_array_equal(second["Y"], np.arange(8.0, 12.0)[None, :])
    np.testing.assert_array_equal(third["Y"], np.arange(12.0, 24.0).reshape(3, 4))
    assert set(third) == {"Y"}
    assert sorted(host_copies) == [(6, 1), (6, 4)]  # each output moved once for the batch


def test_split_outputs_of_numpy_outputs_is_unchanged(host_copies):
    items = [pending(step({"X": np.ones((1, 4))}, frozenset({"Y"})), 1)]
    outputs = {"Y": np.ones((1, 4)), "Z": np.zeros((1, 1))}
    (only,) = split_outputs(SPEC, items, outputs)
    assert isinstance(only, dict) and only["Y"] is outputs["Y"]
    assert host_copies == []


def test_a_batch_of_one_keeping_request_gets_the_tensors_themselves(host_copies):
    outputs = {"Y": torch.ones(2, 4), "Z": torch.ones(2, 1)}
    items = [pending(step({"X": torch.ones(2, 4)}, frozenset({"Y", "Z"})), 2)]
    (only,) = split_outputs(SPEC, items, outputs)
    assert isinstance(only, dict) and only["Y"] is outputs["Y"] and only["Z"] is outputs["Z"]
    assert host_copies == []


# -- which outputs stay tensors ------------------------------------------------------------

CHAIN = """
backend: ensemble
max_batch_size: 8
inputs: [{name: IN, datatype: FP32, shape: [4]}]
outputs: [{name: OUT, datatype: FP32, shape: [4]}, {name: SIDE, datatype: FP32, shape: [4]}]
ensemble:
  steps:
    - {model_name: a, input_map: {X: IN}, output_map: {Y: t, S: SIDE}}
    - {model_name: b, input_map: {X: t}, output_map: {Y: u}}
    - {model_name: c, input_map: {X: u, W: t}, output_map: {Y: OUT}}
"""


def chain_plan(text: str = CHAIN) -> EnsemblePlan:
    return EnsemblePlan.of(parse_model_config(yaml.safe_load(text), PATH, "ens"))


TORCH = StepPlacement(gives_tensors=True, takes_tensors=True, devices=frozenset({"cpu"}))
HOST = StepPlacement(devices=frozenset({"cpu"}))


def test_outputs_between_torch_steps_on_one_device_stay_tensors_but_final_ones_do_not():
    keep = kept_outputs(chain_plan(), [TORCH, TORCH, TORCH])
    # a: t goes to b and c (both torch), SIDE is an ensemble output; b: u goes to c; c: OUT
    assert keep == (frozenset({"Y"}), frozenset({"Y"}), frozenset())


@pytest.mark.parametrize(
    ("placements", "want"),
    [
        # a python consumer of t (c) takes host data: t is not kept, u still is
        ((TORCH, TORCH, HOST), (frozenset(), frozenset(), frozenset())),
        ((TORCH, HOST, TORCH), (frozenset(), frozenset(), frozenset())),
        # another device
        (
            (
                TORCH,
                StepPlacement(True, True, frozenset({"cuda:0"})),
                TORCH,
            ),
            (frozenset(), frozenset(), frozenset()),
        ),
        # a producer on two devices, an unknown consumer (loads on demand)
        (
            (StepPlacement(True, True, frozenset({"cuda:0", "cuda:1"})), TORCH, TORCH),
            (frozenset(), frozenset({"Y"}), frozenset()),
        ),
        ((TORCH, None, TORCH), (frozenset(), frozenset(), frozenset())),
        ((None, TORCH, TORCH), (frozenset(), frozenset({"Y"}), frozenset())),
    ],
)
def test_a_host_consumer_another_device_or_an_unknown_step_keeps_host_data(placements, want):
    assert kept_outputs(chain_plan(), list(placements)) == want


@dataclass
class FakeBackend:
    gives_tensors: bool = True
    takes_tensors: bool = True

    def capabilities(self) -> Capabilities:
        return Capabilities(gives_tensors=self.gives_tensors, takes_tensors=self.takes_tensors)


@dataclass
class FakeContext:
    device: str = "cpu"


@dataclass
class FakeInstance:
    backend: FakeBackend = field(default_factory=FakeBackend)
    context: FakeContext = field(default_factory=FakeContext)
    capabilities: Capabilities = field(init=False)

    def __post_init__(self) -> None:
        self.capabilities = self.backend.capabilities()  # as Instance does after load


class FakeRunner:
    """What :func:`placement_of` reads of a runner: its instances, what they all can do
    (``Capabilities.common``, as at load), whether it pads, and its devices (the runners')."""

    devices = VersionRunner.devices

    def __init__(self, instances, *, pads: bool = False) -> None:
        self.instances = instances
        self.capabilities = Capabilities.common([i.capabilities for i in instances])
        self.pads = pads


def test_placement_of_reads_the_instances_backends_and_devices():
    assert placement_of(None) is None
    assert placement_of(FakeRunner([])) == StepPlacement()
    two = FakeRunner([FakeInstance(), FakeInstance(context=FakeContext("cuda:1"))])
    assert placement_of(two) == StepPlacement(True, True, frozenset({"cpu", "cuda:1"}))
    mixed = FakeRunner([FakeInstance(), FakeInstance(FakeBackend(False, False))])
    assert placement_of(mixed) == StepPlacement(False, False, frozenset({"cpu"}))
    padded = FakeRunner([FakeInstance()], pads=True)
    assert placement_of(padded) == StepPlacement(False, False, frozenset({"cpu"}))


# -- the scheduler, on fake step schedulers ------------------------------------------------


class TensorStep:
    """A step model's scheduler with one instance: answers ``fn(inputs)`` on the next loop
    turn; outputs the request keeps come back as tensors, the others as numpy arrays."""

    def __init__(self, fn, loop, *, torch_backend: bool = True) -> None:
        self.fn = fn
        self.loop = loop
        self.instances = [FakeInstance(FakeBackend(torch_backend, torch_backend))]
        self.capabilities = self.instances[0].capabilities
        self.pads = False
        self.devices = frozenset({"cpu"})
        self.requests: list[InferenceRequest] = []

    def submit(self, request: InferenceRequest) -> asyncio.Future[InferenceResponse]:
        self.requests.append(request)
        inputs = {
            k: torch.as_tensor(v) if not tensors.is_tensor(v) else v
            for k, v in request.inputs.items()
        }
        keep = kept_tensors(request)
        outputs = {k: v if k in keep else tensors.to_host(v) for k, v in self.fn(inputs).items()}
        future = self.loop.create_future()
        response = InferenceResponse(request.model_name, "1", request.id, outputs)
        self.loop.call_soon(future.set_result, response)
        return future


class Router:
    def __init__(self, steps) -> None:
        self.steps = steps

    def runner(self, name: str, version: str | None):
        return self.steps[name]

    def cold(self, name: str) -> bool:
        return False

    async def ensure_loaded(self, name: str) -> None:
        return None


def run_chain(values: np.ndarray, *, c_torch: bool = True, swap_c: bool = False):
    async def main():
        loop = asyncio.get_running_loop()
        steps = {
            "a": TensorStep(lambda x: {"Y": x["X"] + 1, "S": x["X"] * 0}, loop),
            "b": TensorStep(lambda x: {"Y": x["X"] * 2}, loop),
            "c": TensorStep(lambda x: {"Y": x["X"] + x["W"]}, loop, torch_backend=c_torch),
        }
        ens = parse_model_config(yaml.safe_load(CHAIN), PATH, "ens")
        scheduler = EnsembleRunner(ens, "1", Router(steps))
        scheduler.attach_loop(loop)
        if swap_c:  # c's model becomes one that takes host data once the run has started
            future = scheduler.submit(InferenceRequest("ens", None, {"IN": values}))
            steps["c"] = TensorStep(steps["c"].fn, loop, torch_backend=False)
            response = await future
        else:
            response = await scheduler.infer(InferenceRequest("ens", None, {"IN": values}))
        return response, scheduler, steps

    return asyncio.run(main())


def test_the_scheduler_hands_tensors_between_torch_steps_and_answers_numpy():
    values = np.arange(8, dtype=np.float32).reshape(2, 4)
    response, scheduler, steps = run_chain(values)
    t = values + 1
    np.testing.assert_allclose(response.outputs["OUT"], t * 2 + t)
    assert all(isinstance(v, np.ndarray) for v in response.outputs.values())
    a, b, c = (steps[n].requests[0] for n in "abc")
    assert a.keep_tensors == {"Y"}
    assert isinstance(b.inputs["X"], torch.Tensor)
    assert isinstance(c.inputs["X"], torch.Tensor) and isinstance(c.inputs["W"], torch.Tensor)
    assert kept_tensors(c) == frozenset()
    stats = scheduler.stats.as_dict()["ensemble_steps"]
    assert [s["tensor_inputs"] for s in stats] == [0, 1, 2]
    assert [s["host_copies"] for s in stats] == [0, 0, 0]


def test_a_python_consumer_gets_host_data_from_the_producer():
    values = np.ones((1, 4), np.float32)
    response, scheduler, steps = run_chain(values, c_torch=False)
    t = values + 1
    np.testing.assert_allclose(response.outputs["OUT"], t * 2 + t)
    a, b, c = (steps[n].requests[0] for n in "abc")
    assert kept_tensors(a) == frozenset() and kept_tensors(b) == frozenset()
    assert all(isinstance(v, np.ndarray) for r in (b, c) for v in r.inputs.values())
    stats = scheduler.stats.as_dict()["ensemble_steps"]
    assert [s["host_copies"] for s in stats] == [0, 0, 0]


def test_a_step_that_stopped_taking_tensors_gets_them_moved_to_the_host_once():
    values = np.ones((1, 4), np.float32)
    response, scheduler, steps = run_chain(values, swap_c=True)
    t = values + 1
    np.testing.assert_allclose(response.outputs["OUT"], t * 2 + t)
    (c,) = steps["c"].requests
    assert all(isinstance(v, np.ndarray) for v in c.inputs.values())
    stats = scheduler.stats.as_dict()["ensemble_steps"]
    assert stats[2]["host_copies"] == 2 and stats[2]["tensor_inputs"] == 0


# -- the torch backend's tensor paths (with the hand-off in backends/torch_backend.py) -------

COUNT = """
import torch


class Model(torch.nn.Module):
    def forward(self, x):
        return (x > 0).sum(dim=1, keepdim=True), x * 2  # int64 and float
"""


def torch_backend(tmp_path: Path) -> Any:
    from gpuserve.backends.base import LoadContext
    from gpuserve.backends.torch_backend import TorchBackend
    from gpuserve.config import ModelConfig

    if not TorchBackend.gives_tensors:
        pytest.skip("the torch backend does not give device tensors (gives_tensors False)")
    folder = tmp_path / "m" / "1"
    folder.mkdir(parents=True)
    (folder / "model.py").write_text(COUNT)
    config = ModelConfig(
        name="m",
        backend="torch",
        max_batch_size=8,
        inputs=[{"name": "x", "datatype": "FP32", "shape": [4]}],
        outputs=[
            {"name": "n", "datatype": "INT32", "shape": [1]},
            {"name": "y", "datatype": "FP32", "shape": [4]},
        ],
    )
    backend = TorchBackend()
    backend.load(LoadContext(config=config, version_path=folder, version=1, device="cpu"))
    return backend


def test_the_torch_backend_takes_tensors_and_gives_them_in_the_declared_datatypes(tmp_path):
    backend = torch_backend(tmp_path)
    assert backend.takes_tensors and backend.gives_tensors
    x = torch.tensor([[1.0, -1.0, 2.0, 0.0], [-3.0, 4.0, 5.0, 6.0]])
    raw = backend.forward(backend.preprocess({"x": x}))
    kept = backend.postprocess_tensors(raw)
    assert isinstance(kept["n"], torch.Tensor) and kept["n"].dtype == torch.int32
    assert kept["n"].flatten().tolist() == [2, 3]
    assert isinstance(kept["y"], torch.Tensor) and kept["y"].dtype == torch.float32
    host = backend.postprocess(backend.forward(backend.preprocess({"x": x.numpy()})))
    assert host["n"].dtype == np.int32 and isinstance(host["y"], np.ndarray)
    np.testing.assert_array_equal(host["y"], kept["y"].numpy())
