"""The inference service's admission, without sockets: the order of its steps (resolve ->
canary split -> decode against the routed version -> shutdown refusal), what each refusal is
counted on, and the probe it installs. A spy wire records what it was asked."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from gpuserve.config import ModelConfig, ServerConfig, TensorSpec
from gpuserve.engine.request import InferenceRequest
from gpuserve.engine.runners.batching import ModelScheduler
from gpuserve.errors import (
    InvalidInputError,
    ModelNotFoundError,
    ModelNotReadyError,
    UnavailableError,
)
from gpuserve.metrics import ServerMetrics
from gpuserve.repository.manager import Model, ModelManager, ModelVersion, Route, VersionState
from gpuserve.service.inference import InferenceService


def config(max_batch_size: int) -> ModelConfig:
    return ModelConfig(
        name="m",
        max_batch_size=max_batch_size,
        inputs=[TensorSpec(name="X", datatype="FP32", shape=[2])],
        outputs=[TensorSpec(name="Y", datatype="FP32", shape=[2])],
    )


class BusyInstance:
    """An instance that never has room: admitted requests stay queued (nothing runs)."""

    name = "busy"
    in_flight = 0
    capacity = 0


def version(number: int, max_batch_size: int) -> ModelVersion:
    cfg = config(max_batch_size)
    mv = ModelVersion("m", number, Path(f"/repo/m/{number}"), cfg, state=VersionState.READY)
    mv.runner = ModelScheduler(cfg, str(number))
    mv.runner.instances = [BusyInstance()]  # healthy, never dispatching
    return mv


class SpyWire:
    """A WireRequest that records the calls the service makes."""

    def __init__(self, request_id: str | None = "abc", fail: str | None = None) -> None:
        self.id = request_id
        self.fail = fail
        self.calls: list[str] = []
        self.decoded_with: ModelConfig | None = None

    def request_id(self) -> str | None:
        self.calls.append("request_id")
        if self.fail == "id":
            raise InvalidInputError("request 'id' must be a string, got 3")
        return self.id

    def decode(self, config, model_name, model_version) -> InferenceRequest:
        self.calls.append("decode")
        self.decoded_with = config
        if self.fail == "decode":
            raise InvalidInputError(f"too many rows for max_batch_size {config.max_batch_size}")
        return InferenceRequest(model_name, model_version, {"X": np.zeros((1, 2), np.float32)})


def service_with(route: Route, *versions: ModelVersion) -> InferenceService:
    manager = ModelManager(Path("/nonexistent"))
    model = Model("m", versions[0].config, path=Path("/repo/m"))
    model.versions = {mv.version: mv for mv in versions}
    model.route = route
    manager.models["m"] = model
    manager.initial_load_done = True
    metrics = ServerMetrics(manager, gpu=False, process=False)
    return InferenceService(manager, ServerConfig(model_repository=Path("/nonexistent")), metrics)


def unrouted(service: InferenceService, reason: str) -> float:
    assert service.metrics is not None
    value = service.metrics.registry.get_sample_value(
        "gpuserve_requests_total",
        {"model": "_unknown", "version": "_unknown", "outcome": "failure", "reason": reason},
    )
    return value or 0.0


@pytest.fixture
def canaried():
    one, two = version(1, 8), version(2, 2)
    return service_with(Route(one, two, 1.0), one, two), one, two


def test_a_canary_is_chosen_before_decoding_and_decodes_with_its_own_config(canaried):
    service, _, two = canaried
    wire = SpyWire()
    admission = service.admit("m", None, wire)
    assert wire.calls == ["request_id", "decode"]
    assert wire.decoded_with is two.config and wire.decoded_with.max_batch_size == 2
    assert (admission.model, admission.version, admission.config) == ("m", "2", two.config)


def test_without_a_canary_share_the_default_version_decodes():
    one, two = version(1, 8), version(2, 2)
    service = service_with(Route(one, two, 0.0), one, two)
    wire = SpyWire()
    admission = service.admit("m", None, wire)
    assert admission.version == "1" and wire.decoded_with is one.config


def test_a_named_version_is_not_split(canaried):
    service, one, _ = canaried
    wire = SpyWire()
    admission = service.admit("m", "1", wire)
    assert wire.calls == ["decode"]  # the id is not even read
    assert admission.version == "1" and wire.decoded_with is one.config


def test_a_decode_failure_is_counted_on_the_routed_version(canaried):
    service, one, two = canaried
    with pytest.raises(InvalidInputError, match="max_batch_size 2"):
        service.admit("m", None, SpyWire(fail="decode"))
    assert two.runner.stats.fail.count == 1
    assert one.runner.stats.fail.count == 0


def test_an_unreadable_id_is_counted_on_the_resolved_version(canaried):
    service, one, two = canaried
    with pytest.raises(InvalidInputError, match="'id'"):
        service.admit("m", None, SpyWire(fail="id"))
    assert one.runner.stats.fail_reasons["invalid"] == 1
    assert two.runner.stats.fail.count == 0


@pytest.mark.parametrize(
    ("name", "label", "error"),
    [
        ("nope", None, ModelNotFoundError),
        ("m", "7", ModelNotFoundError),
        ("m", "\u00b2", ModelNotFoundError),  # a digit to str.isdigit, not a version label
    ],
)
def test_refusals_before_any_version_are_counted_unrouted(canaried, name, label, error):
    service, one, two = canaried
    with pytest.raises(error):
        service.admit(name, label, SpyWire())
    assert one.runner.stats.fail.count == two.runner.stats.fail.count == 0
    if name == "nope":
        assert unrouted(service, "not_found") == 1


def test_a_model_with_nothing_serving_is_not_ready():
    one = version(1, 8)
    service = service_with(Route(), one)
    with pytest.raises(ModelNotReadyError, match="not ready"):
        service.admit("m", None, SpyWire())


def test_while_shutting_down_new_requests_are_refused_and_counted(canaried):
    service, _, two = canaried
    service.begin_shutdown()
    assert not service.is_ready()
    with pytest.raises(UnavailableError, match="shutting down"):
        service.admit("m", None, SpyWire())
    assert two.runner.stats.fail_reasons["unavailable"] == 1


def test_the_cancellation_probe_reaches_the_request_and_submit_queues_it(canaried):
    service, _, two = canaried

    def gone() -> bool:
        return True

    admission = service.admit("m", None, SpyWire(), gone)
    assert admission.request.is_cancelled is gone
    assert admission.rows == 1 and admission.shapes() == {"X": [1, 2]}

    async def queue_it() -> None:
        two.runner.attach([BusyInstance()], asyncio.get_running_loop())
        future = service.submit(admission)
        assert not future.done()
        assert two.runner.in_flight_requests == 1

    asyncio.run(queue_it())


def test_without_a_canary_the_id_is_never_read():
    one = version(1, 8)
    service = service_with(Route(one), one)
    wire = SpyWire(fail="id")  # would fail if read
    admission = service.admit("m", None, wire)
    assert wire.calls == ["decode"] and admission.version == "1"
