"""Load on demand racing explicit loads, unloads and reloads, on a fake clock.

The real :class:`~gpuserve.repository.manager.ModelManager` (its on-demand driver, executor
and locks) runs on an event loop whose clock is virtual: a sleep returns at once with the
clock moved on, so tens of seconds of traffic run in well under a second and every run of a
seed is the same. Loads are fake (``_load_version`` is replaced: a virtual sleep, then a
runner that counts what it serves); nothing else is.

Each seed mixes, at random over four models under ``--max-loaded-models 2``: requests (with
and without a version, as ``InferenceService.admit_loaded`` enters: cold check, load on
demand, then admission with no await in between), explicit unloads, explicit loads and
reloads with a changed configuration, with idle unload on. It checks:

* no request meets an error, 503 included: a request for a model that loads on demand waits
  for an unload in its way and the load that follows, and its own model answers it;
* never more models loaded (or loading) than the limit;
* nothing left LOADING or UNLOADING at the end;
* an explicit load is refused only for want of room (its documented 503).
"""

from __future__ import annotations

import asyncio
import random
import selectors
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from gpuserve.errors import GpuserveError, ModelNotReadyError
from gpuserve.repository.lifecycle import executor as executor_module
from gpuserve.repository.ondemand import footprint
from gpuserve.repository.ondemand import loader as ondemand
from gpuserve.repository.manager import ModelManager
from gpuserve.repository.ondemand.residency import Limits
from gpuserve.repository.state import ModelVersion, VersionState

MODELS = 4
LIMIT = 2


class VirtualSelector(selectors.DefaultSelector):
    """A selector that never blocks: a wait for ``timeout`` moves the virtual clock on."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0

    def select(self, timeout: float | None = None) -> list[Any]:
        ready = super().select(0)
        if ready:
            return ready
        if timeout is None:
            raise AssertionError("deadlock: nothing scheduled and nothing to wait for")
        self.now += timeout
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop on the selector's virtual clock."""

    def __init__(self) -> None:
        self.selector = VirtualSelector()
        super().__init__(self.selector)

    def time(self) -> float:
        return self.selector.now


class InlineExecutor(ThreadPoolExecutor):
    """Runs ``run_in_executor`` work at once on the loop's thread (no real time passes)."""

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as err:
            future.set_exception(err)
        return future


class FakeStats:
    def __init__(self) -> None:
        self.last_inference_ms = 0


class FakeRunner:
    """What the manager and the request path read of a runner."""

    kind = "fake"
    healthy = True
    unhealthy_reason = ""

    def __init__(self, mv: ModelVersion) -> None:
        self.model = mv.model
        self.ident = mv.config.parameters.get("ident")
        self.stats = FakeStats()
        self.instances: list[Any] = []
        self.in_flight_requests = 0
        self.closed = False

    async def close(self, timeout_s: float) -> None:
        self.closed = True


def write_repository(root: Path) -> Path:
    for i in range(MODELS):
        folder = root / f"m{i}"
        (folder / "1").mkdir(parents=True)
        (folder / "1" / "model.py").write_text("# loaded by the fake loader\n")
        (folder / "config.yaml").write_text(
            "backend: python\nmax_batch_size: 4\n"
            "inputs: [{name: INPUT0, datatype: FP32, shape: [1]}]\n"
            "outputs: [{name: OUTPUT0, datatype: INT64, shape: [1]}]\n"
            f"parameters: {{ident: {i}}}\n" + ("idle_unload_s: 2.0\n" if i == MODELS - 1 else "")
        )
    return root


def config(i: int, generation: int = 0) -> dict[str, Any]:
    return {
        "backend": "python",
        "max_batch_size": 4,
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1]}],
        "outputs": [{"name": "OUTPUT0", "datatype": "INT64", "shape": [1]}],
        "parameters": {"ident": str(i), "generation": str(generation)},
    }


class Simulation:
    """One seed's run (module docstring)."""

    def __init__(self, root: Path, seed: int) -> None:
        self.rng = random.Random(seed)
        self.manager = ModelManager(
            root,
            control_mode="explicit",
            load_on_demand=True,
            limits=Limits(max_models=LIMIT),
            model_load_timeout_s=60.0,
            unload_timeout_s=5.0,
        )
        self.manager._load_version = self.fake_load  # type: ignore[method-assign]
        self.errors: list[str] = []
        self.served: Counter[str] = Counter()
        self.refused_loads = 0
        self.most_loaded = 0

    def loaded_count(self) -> int:
        return sum(1 for m in self.manager.models.values() if m.versions)

    def check_limit(self) -> None:
        count = self.loaded_count()
        self.most_loaded = max(self.most_loaded, count)
        if count > LIMIT:
            self.errors.append(
                f"{count} models loaded at once (limit {LIMIT}): "
                f"{sorted(m.name for m in self.manager.models.values() if m.versions)}"
            )

    async def fake_load(self, mv: ModelVersion) -> None:
        self.check_limit()
        await asyncio.sleep(self.rng.uniform(0.05, 0.5))
        mv.runner = FakeRunner(mv)  # type: ignore[assignment]
        for listener in self.manager.version_listeners:
            listener(mv)
        mv.state = VersionState.READY
        self.check_limit()

    async def request(self, name: str) -> None:
        """As ``InferenceService.admit_loaded``: no await between the load and admission."""
        manager = self.manager
        version = self.rng.choice([None, "1"])
        try:
            if manager.cold(name):
                await manager.ensure_loaded(name)
            runner = manager.runner(name, version)
        except GpuserveError as err:
            self.errors.append(f"request for {name} (version {version}): {err.message}")
            return
        fake: FakeRunner = runner  # type: ignore[assignment]
        if fake.closed:
            self.errors.append(f"request for {name} admitted to a closed runner")
            return
        if fake.model != name or str(fake.ident) != name[1:]:
            self.errors.append(f"request for {name} answered by {fake.model} ({fake.ident})")
        fake.in_flight_requests += 1
        await asyncio.sleep(self.rng.uniform(0.001, 0.05))
        fake.in_flight_requests -= 1
        fake.stats.last_inference_ms = int(asyncio.get_running_loop().time() * 1000)
        self.served[name] += 1

    async def client(self, until: float) -> None:
        loop = asyncio.get_running_loop()
        while loop.time() < until:
            await self.request(f"m{self.rng.randrange(MODELS)}")
            await asyncio.sleep(self.rng.expovariate(20.0))

    async def controller(self, until: float) -> None:
        loop = asyncio.get_running_loop()
        generation = 0
        while loop.time() < until:
            await asyncio.sleep(self.rng.uniform(0.05, 0.6))
            i = self.rng.randrange(MODELS)
            name = f"m{i}"
            action = self.rng.choice(["unload", "unload", "load", "reload"])
            try:
                if action == "unload":
                    await self.manager.unload(name)
                elif action == "load":
                    await self.manager.load(name)
                else:
                    generation += 1
                    await self.manager.load(name, config_override=config(i, generation))
            except ModelNotReadyError as err:  # an explicit load finding no room: its 503
                if "limit of 2 loaded models" not in err.message:
                    self.errors.append(f"{action} {name}: {err.message}")
                self.refused_loads += 1
            except GpuserveError as err:
                self.errors.append(f"{action} {name}: {err.message}")

    async def run(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        self.manager.on_demand.clock = loop.time
        self.manager._executor.retry.clock = loop.time
        await self.manager.load_all()
        until = loop.time() + seconds
        await asyncio.gather(
            *(self.client(until) for _ in range(6)), self.controller(until), self.controller(until)
        )
        # what is left settles: drains end, loads finish
        await asyncio.sleep(10.0)
        for model in self.manager.models.values():
            for mv in model.versions.values():
                if mv.state is not VersionState.READY:
                    self.errors.append(f"{model.name} version {mv.version} left {mv.state}")
            if model.pending:
                self.errors.append(f"{model.name} left loading {sorted(model.pending)}")
        await self.manager.close(1.0)


@pytest.fixture
def quiet_footprint(monkeypatch):
    """No garbage collections or RSS reads per load (they take real time)."""
    monkeypatch.setattr(footprint, "collect_garbage", lambda: None)
    monkeypatch.setattr(footprint, "sample", lambda: {})
    monkeypatch.setattr(ondemand, "held_bytes", lambda backends: {})
    monkeypatch.setattr(executor_module, "release_device_memory", lambda frozen=True: None)


@pytest.mark.parametrize("seed", range(12))
def test_no_request_meets_a_503_for_a_model_it_may_load(tmp_path, seed, quiet_footprint):
    sim = Simulation(write_repository(tmp_path / "repo"), seed)
    loop = VirtualLoop()
    loop.set_default_executor(InlineExecutor(max_workers=1))
    try:
        loop.run_until_complete(sim.run(seconds=30.0))
    finally:
        loop.close()
    assert not sim.errors, sim.errors[:5]
    assert sum(sim.served.values()) > 200, sim.served
    assert all(sim.served[f"m{i}"] for i in range(MODELS)), sim.served
    assert sim.most_loaded == LIMIT
