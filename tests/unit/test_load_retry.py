"""A version that failed to load for a reason that went away is loaded again without an edit
of its folder (issue 19, BC-35): ``poll`` mode tries it again after a back-off (doubling per
failure of the same content), an explicit ``load`` at once. Fake clock, no sockets."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gpuserve.errors import ConfigError
from gpuserve.repository.manager import ModelManager
from gpuserve.repository.lifecycle.retry import RetryBackoff

pytestmark = pytest.mark.timeout(60)

MODEL_PY = """
from pathlib import Path

import numpy as np

from gpuserve import PythonModel


class Model(PythonModel):
    def load(self, context):
        flag = Path(context.parameters["fail_while"])
        if flag.exists():
            raise RuntimeError(f"transient: {flag.name} is there")

    def forward(self, batch):
        return {"OUTPUT0": batch["INPUT0"]}
"""


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def flaky_repository(root: Path) -> tuple[Path, Path]:
    """A python model that fails to load while a flag file outside its folder exists."""
    flag = root / "flag"
    flag.touch()
    model = root / "repo" / "flaky"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(MODEL_PY)
    (model / "config.yaml").write_text(
        "backend: python\nmax_batch_size: 4\ninstance_group: [{kind: cpu}]\n"
        "inputs: [{name: INPUT0, datatype: FP32, shape: [2]}]\n"
        "outputs: [{name: OUTPUT0, datatype: FP32, shape: [2]}]\n"
        f"parameters: {{fail_while: '{flag}'}}\n"
    )
    return root / "repo", flag


def state(manager: ModelManager) -> str:
    (row,) = [r for r in manager.index() if r["name"] == "flaky"]
    return f"{row['state']} {row.get('reason', '')}"


def test_backoff_doubles_per_failure_of_the_same_content_and_resets():
    clock = Clock()
    backoff = RetryBackoff(base_s=10, max_s=35, clock=clock)
    assert backoff.due("m", 1, "a")  # never failed
    assert [backoff.failed("m", 1, "a") for _ in range(4)] == [10, 20, 35, 35]
    assert backoff.attempts("m", 1) == 4 and not backoff.due("m", 1, "a")
    clock.now += 35
    assert backoff.due("m", 1, "a")
    assert backoff.due("m", 1, "b")  # new content: at once
    assert backoff.failed("m", 1, "b") == 10  # and from the start
    backoff.forget("m", 1)
    assert backoff.attempts("m", 1) == 0


def test_poll_tries_a_failed_version_again_after_the_backoff(tmp_path):
    repo, flag = flaky_repository(tmp_path)
    clock = Clock()

    async def main() -> None:
        manager = ModelManager(repo, control_mode="poll", poll_interval_s=3600)
        manager._executor.retry = RetryBackoff(base_s=30, max_s=60, clock=clock)
        loads: list[int] = []
        original = manager._load_version

        async def counting(mv):
            loads.append(mv.version)
            await original(mv)

        manager._load_version = counting
        await manager.load_all()
        assert "transient: flag is there" in state(manager) and loads == [1]
        await manager.poll_once()
        assert loads == [1]  # within the back-off: not again
        clock.now += 30
        await manager.poll_once()
        assert loads == [1, 1] and "transient" in state(manager)  # tried; the cause is there
        clock.now += 30
        await manager.poll_once()
        assert loads == [1, 1]  # the wait doubled to 60 s
        flag.unlink()  # the cause goes away; the folder stays as it was
        clock.now += 30
        await manager.poll_once()
        assert loads == [1, 1, 1] and state(manager).startswith("READY")
        await manager.close()

    asyncio.run(main())


def test_explicit_load_tries_again_at_once(tmp_path):
    repo, flag = flaky_repository(tmp_path)

    async def main() -> None:
        manager = ModelManager(repo, control_mode="explicit")
        await manager.load_all()
        with pytest.raises(ConfigError, match="transient"):
            await manager.load("flaky")
        flag.unlink()
        await manager.load("flaky")
        assert state(manager).startswith("READY")
        await manager.close()

    asyncio.run(main())
