"""Models' admission steps in the inference service, without sockets: the step runs on the
admission threads between decoding and queueing (HTTP ``submit`` and gRPC ``run``), its cost
and replacement inputs reach the batch, its errors fail only its request (400 as raised, 500
for anything else, counted on the version), the waiting work is bounded (429 with the
reason), a cancelled caller drops a step not yet started, shutdown waits for steps, and a
model without a step is queued exactly as before (the scheduler's own future, no thread)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from gpuserve.backends.base import Admitted, Backend, Capabilities
from gpuserve.config import ModelConfig, ServerConfig, TensorSpec
from gpuserve.engine.admission import AdmissionPool
from gpuserve.engine.request import InferenceRequest, RequestCost
from gpuserve.engine.runners.batching import BatchingRunner
from gpuserve.errors import BackendError, InvalidInputError, OverloadedError
from gpuserve.repository.manager import Model, ModelManager, ModelVersion, Route, VersionState
from gpuserve.service.inference import InferenceService


def config() -> ModelConfig:
    return ModelConfig(
        name="m",
        max_batch_size=8,
        inputs=[TensorSpec(name="TEXT", datatype="BYTES", shape=[1])],
        outputs=[TensorSpec(name="Y", datatype="FP32", shape=[1])],
    )


class StepBackend:
    """A backend whose admission step is ``step`` (None: it declares none)."""

    def __init__(self, step=None) -> None:
        self.step = step

    def admission(self):
        return self.step

    def capabilities(self) -> Capabilities:
        return Capabilities(admission=self.step)


@dataclass
class Context:
    device: str = "cpu"


@dataclass
class RecordingInstance:
    """Takes one batch at a time and never finishes it: the test reads what was queued."""

    backend: object
    name: str = "rec"
    in_flight: int = 0
    capacity: int = 1
    context: Context = field(default_factory=Context)
    batches: list = field(default_factory=list)

    def submit(self, batch) -> None:
        self.in_flight += 1
        self.batches.append(batch)


class Wire:
    def __init__(self, *texts: bytes) -> None:
        self.texts = texts

    def request_id(self) -> str | None:
        return None

    def decode(self, config, model_name, model_version) -> InferenceRequest:
        values = np.array([[t] for t in self.texts], dtype=object)
        return InferenceRequest(model_name, model_version, {"TEXT": values})


def service_for(backend: object, **settings) -> tuple[InferenceService, ModelVersion]:
    cfg = config()
    mv = ModelVersion("m", 1, Path("/repo/m/1"), cfg, state=VersionState.READY)
    manager = ModelManager(Path("/nonexistent"))
    model = Model("m", cfg, path=Path("/repo/m"))
    model.versions = {1: mv}
    model.route = Route(mv)
    manager.models["m"] = model
    manager.initial_load_done = True
    settings.setdefault("admission_inline_bytes", 0)  # the threads, unless a test asks
    server = ServerConfig(model_repository=Path("/nonexistent"), **settings)
    service = InferenceService(manager, server)
    instance = RecordingInstance(backend)
    has = hasattr(backend, "capabilities")
    instance.capabilities = backend.capabilities() if has else Capabilities()
    mv.runner = BatchingRunner(cfg, "1", instance.capabilities, service.admission_pool)
    mv.runner.instances = [instance]
    return service, mv


def attach(mv: ModelVersion) -> RecordingInstance:
    assert isinstance(mv.runner, BatchingRunner)
    (instance,) = mv.runner.instances
    mv.runner.attach([instance], asyncio.get_running_loop())
    assert isinstance(instance, RecordingInstance)
    return instance


def cut_step(threads: list[str]):
    """Counts bytes per row and cuts every text to its first 3 bytes (same shape)."""

    def step(inputs: dict[str, np.ndarray]) -> Admitted:
        threads.append(threading.current_thread().name)
        texts = inputs["TEXT"]
        cut = np.array([[t[:3]] for t in texts[:, 0]], dtype=object)
        return Admitted(tuple(len(t) for t in texts[:, 0]), {"TEXT": cut})

    return step


def queued_request(instance: RecordingInstance) -> InferenceRequest:
    (batch,) = instance.batches
    (item,) = batch.items
    return item.request


def test_without_a_step_submit_is_the_schedulers_own_future_and_no_thread_runs():
    service, mv = service_for(StepBackend(None))

    async def go() -> None:
        instance = attach(mv)
        admission = service.admit("m", None, Wire(b"hello"))
        assert admission.runner.capabilities.admission is None
        future = service.submit(admission)
        assert mv.runner is not None and future in mv.runner._waiters.values()
        assert queued_request(instance).cost is None
        assert service.admission_pool._pool is None  # never started

    asyncio.run(go())


def test_the_step_runs_on_an_admission_thread_and_its_cost_and_inputs_reach_the_batch():
    threads: list[str] = []
    service, mv = service_for(StepBackend(cut_step(threads)))

    async def go() -> None:
        instance = attach(mv)
        admission = service.admit("m", None, Wire(b"hello world", b"hi"))
        future = service.submit(admission)
        while not instance.batches:
            await asyncio.sleep(0.001)
        request = queued_request(instance)
        assert request.cost == RequestCost((11, 2))
        assert request.inputs["TEXT"].tolist() == [[b"hel"], [b"hi"]]
        assert not future.done()
        assert threads and threads[0].startswith("gpuserve-admission")

    asyncio.run(go())


@pytest.mark.parametrize("front", ["submit", "run"])
def test_a_small_request_runs_its_step_inline_and_a_large_one_on_a_thread(front):
    threads: list[str] = []
    service, mv = service_for(StepBackend(cut_step(threads)), admission_inline_bytes=16)

    async def go() -> None:
        instance = attach(mv)
        small = service.admit("m", None, Wire(b"hello world", b"hi"))  # 13 bytes
        if front == "submit":
            service.submit(small)
        else:
            task = asyncio.ensure_future(service.run(small))
            await asyncio.sleep(0)
        # measured before the call returned (submit) or at its first step (run): no thread
        assert threads == [threading.current_thread().name]
        assert small.request.cost == RequestCost((11, 2))
        assert service.admission_pool.waiting == 0
        large = service.admit("m", None, Wire(b"x" * 17))
        if front == "submit":
            service.submit(large)
        else:
            other = asyncio.ensure_future(service.run(large))
        while len(threads) < 2:
            await asyncio.sleep(0.001)
        assert threads[1].startswith("gpuserve-admission")
        while not instance.batches:
            await asyncio.sleep(0.001)
        if front == "run":
            task.cancel()
            other.cancel()

    asyncio.run(go())


def test_run_awaits_the_step_then_queues():
    threads: list[str] = []
    service, mv = service_for(StepBackend(cut_step(threads)))

    async def go() -> None:
        instance = attach(mv)
        admission = service.admit("m", None, Wire(b"abcdef"))
        task = asyncio.ensure_future(service.run(admission))
        while not instance.batches:
            await asyncio.sleep(0.001)
        assert queued_request(instance).cost == RequestCost((6,))
        task.cancel()

    asyncio.run(go())


@pytest.mark.parametrize(
    ("raised", "error", "message"),
    [
        (InvalidInputError("input 'TEXT': row 0 is bad"), InvalidInputError, "row 0 is bad"),
        (RuntimeError("boom"), BackendError, r"admission step failed \(RuntimeError: boom\)"),
    ],
)
def test_a_failing_step_fails_its_request_only_and_is_counted(raised, error, message):
    def step(inputs):
        if inputs["TEXT"][0, 0] == b"bad":
            raise raised
        return Admitted((1,))

    service, mv = service_for(StepBackend(step))

    async def go() -> None:
        instance = attach(mv)
        bad = service.submit(service.admit("m", None, Wire(b"bad")))
        with pytest.raises(error, match=message):
            await bad
        good = service.admit("m", None, Wire(b"good"))
        service.submit(good)
        while not instance.batches:
            await asyncio.sleep(0.001)
        assert queued_request(instance) is good.request
        with pytest.raises(error, match=message):  # the gRPC path says the same
            await service.run(service.admit("m", None, Wire(b"bad")))

    asyncio.run(go())
    assert mv.runner is not None
    assert mv.runner.stats.fail_reasons[error.reason] == 2


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (Admitted((1, 2)), "2 lengths for 1 rows"),
        (Admitted((1,), {"OTHER": np.zeros(1)}), r"replacement inputs \['OTHER'\]"),
        (
            Admitted((1,), {"TEXT": np.zeros((1, 1), np.float32)}),
            "input 'TEXT' replaced by float32",
        ),
        ("nonsense", "expected an Admitted, got str"),
    ],
)
def test_a_wrong_answer_is_a_500_naming_what_is_wrong(answer, message):
    service, mv = service_for(StepBackend(lambda inputs: answer))

    async def go() -> None:
        attach(mv)
        with pytest.raises(BackendError, match=message):
            await service.submit(service.admit("m", None, Wire(b"x")))

    asyncio.run(go())


def test_waiting_work_is_bounded_with_a_429_that_says_why():
    release = threading.Event()

    def slow(inputs):
        release.wait(10)
        return Admitted((1,))

    service, mv = service_for(StepBackend(slow), admission_workers=1, admission_queue=2)

    async def go() -> None:
        attach(mv)
        first = service.submit(service.admit("m", None, Wire(b"a")))
        second = service.submit(service.admit("m", None, Wire(b"b")))
        with pytest.raises(OverloadedError, match=r"2 requests are waiting .*admission_queue"):
            service.submit(service.admit("m", None, Wire(b"c")))
        assert service.admission_pool.waiting == 2
        release.set()
        await asyncio.wait_for(asyncio.gather(asyncio.sleep(0), _settled(service)), 10)
        assert not first.done() and not second.done()  # queued now (the instance holds them)
        service.submit(service.admit("m", None, Wire(b"d")))  # room again

    asyncio.run(go())
    assert mv.runner is not None and mv.runner.stats.fail_reasons["rejected"] == 1


async def _settled(service: InferenceService) -> None:
    while service.admission_pool.waiting:
        await asyncio.sleep(0.001)


def test_a_cancelled_caller_drops_a_step_that_has_not_started():
    release = threading.Event()
    ran: list[bytes] = []

    def slow(inputs):
        ran.append(inputs["TEXT"][0, 0])
        release.wait(10)
        return Admitted((1,))

    service, mv = service_for(StepBackend(slow), admission_workers=1)

    async def go() -> None:
        attach(mv)
        busy = asyncio.ensure_future(service.run(service.admit("m", None, Wire(b"first"))))
        waiting = asyncio.ensure_future(service.run(service.admit("m", None, Wire(b"second"))))
        while not ran:
            await asyncio.sleep(0.001)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)  # cancelled before it starts
        release.set()
        await _settled(service)
        busy.cancel()

    asyncio.run(go())
    assert ran == [b"first"]


def test_shutdown_waits_for_steps_in_progress():
    release = threading.Event()

    def slow(inputs):
        release.wait(10)
        return Admitted((1,))

    service, mv = service_for(StepBackend(slow))

    async def go() -> None:
        attach(mv)
        service.submit(service.admit("m", None, Wire(b"a")))
        assert not await service.wait_idle(0.05)  # the step still runs
        release.set()
        assert await service.admission_pool.wait_idle(10)

    asyncio.run(go())


def test_the_step_is_declared_once_in_the_backends_capabilities():
    def step(inputs):
        return Admitted((1,))

    assert StepBackend(step).capabilities().admission is step
    assert StepBackend(None).capabilities().admission is None
    runner = BatchingRunner(config(), "1", StepBackend(step).capabilities())
    assert runner.capabilities.admission is step


def test_the_python_backend_forwards_model_admit():
    from gpuserve.backends.python import PythonBackend
    from gpuserve.backends.triton_python.backend import PythonModelBackend

    class WithStep:
        def admit(self, inputs):
            return Admitted((1,))

    inner = PythonBackend()
    inner.model = WithStep()
    outer = PythonModelBackend()
    outer.impl = inner
    step = outer.admission()
    assert step is not None and step({}) == Admitted((1,))
    assert outer.admission() is step  # looked up once per model object
    inner.model = object()
    assert outer.admission() is None
    assert isinstance(outer, Backend) and Backend.admission(outer) is None


def test_the_pool_closes_and_restarts_its_threads():
    pool = AdmissionPool(1, 4)

    async def go() -> None:
        request = InferenceRequest("m", None, {"TEXT": np.array([[b"x"]], dtype=object)})
        admitted = await pool.run(lambda inputs: Admitted((1,)), request, 1, "model 'm'")
        assert admitted == Admitted((1,))

    asyncio.run(go())
    pool.close()
    asyncio.run(go())
    pool.close()
