"""The model manager's lifecycle: explicit and poll modes, swaps that never let a failing
version replace a serving one, rollback, canary, drain on unload, and readiness. The manager
runs on its own event loop with real (tiny) Python models; no sockets."""

from __future__ import annotations

import asyncio
import gc
import logging
import shutil
import weakref

import numpy as np
import pytest

from gpuserve.engine.request import InferenceRequest
from gpuserve.errors import ConfigError, InvalidInputError, ModelNotFoundError, ModelNotReadyError
from gpuserve.repository.manager import ModelManager
from tests.fixtures.lifecycle_support import add_version, make_repository

pytestmark = pytest.mark.timeout(60)


async def infer(manager, name="versioned", version=None, rid=None, start=0.0) -> int:
    """Run one request; for ``versioned`` returns the version that answered."""
    mv = manager.version(name, version)
    if version is None:
        mv = manager.split(mv, rid)
    x = np.arange(16, dtype=np.float32)[None] + start
    request = InferenceRequest(name, version, {"INPUT0": x}, id=rid)
    response = await mv.runner.infer(request)
    return int(response.outputs["OUTPUT0"][0, 0] - x[0, 0])


def row(manager, name, version):
    (found,) = [r for r in manager.index() if r["name"] == name and r["version"] == str(version)]
    return found


def run(coro):
    return asyncio.run(coro)


async def until(condition, what: str, deadline_s: float = 10.0) -> None:
    """``tests.helpers.wait_until`` for this event loop: polls ``condition()`` every 5 ms
    without blocking the loop; AssertionError after ``deadline_s``."""
    end = asyncio.get_running_loop().time() + deadline_s
    while not condition():
        assert asyncio.get_running_loop().time() < end, f"{what}: not true after {deadline_s} s"
        await asyncio.sleep(0.005)


def serves(manager, name) -> bool:
    """Whether ``manager.version(name, None)`` still hands out a version (not unloading)."""
    try:
        manager.version(name, None)
    except ModelNotReadyError:
        return False
    return True


def test_explicit_mode_loads_the_named_models_then_what_the_api_asks(tmp_path):
    repo = make_repository(tmp_path / "repo", "versioned", "double_fp32")

    async def main():
        manager = ModelManager(repo, control_mode="explicit", load_models=["versioned"])
        await manager.load_all()
        assert manager.is_ready() and await infer(manager) == 2
        with pytest.raises(ModelNotReadyError, match="not loaded"):
            manager.version("double_fp32", None)
        assert row(manager, "double_fp32", "")["reason"] == "not loaded"
        await manager.load("double_fp32")
        assert await infer(manager, "double_fp32") == 0  # 2x - x at x[0] = 0
        with pytest.raises(ModelNotFoundError):
            await manager.load("nope")
        await manager.unload("double_fp32")
        with pytest.raises(ModelNotReadyError, match="unload requested"):
            manager.version("double_fp32", None)
        await manager.close()

        fixed = ModelManager(repo)  # mode none: the repository API does not load or unload
        await fixed.load_all()
        with pytest.raises(
            InvalidInputError, match="^explicit model load / unload is not allowed if polling"
        ):
            await fixed.unload("versioned")
        await fixed.close()

    run(main())


def test_readiness_is_never_all_of_an_empty_set(tmp_path):
    repo = make_repository(tmp_path / "repo", "versioned")
    empty = tmp_path / "empty"
    empty.mkdir()

    async def main():
        for manager in (ModelManager(empty), ModelManager(repo, control_mode="explicit")):
            await manager.load_all()
            assert not manager.is_ready()
            await manager.close()
        manager = ModelManager(repo, control_mode="explicit")
        await manager.load_all()
        await manager.load("versioned")
        assert manager.is_ready()
        await manager.unload("versioned")
        assert not manager.is_ready()
        await manager.close()

    run(main())


def test_a_version_that_fails_to_load_never_replaces_the_serving_one(tmp_path):
    repo = make_repository(tmp_path / "repo", "versioned")

    async def main():
        manager = ModelManager(repo, control_mode="explicit", load_models=["*"])
        await manager.load_all()
        assert await infer(manager) == 2
        add_version(repo, 3, truncated=True)
        with pytest.raises(ConfigError) as err:
            await manager.load("versioned")
        assert "version 3" in err.value.message and "version 2 keeps serving" in err.value.message
        assert await infer(manager) == 2
        assert row(manager, "versioned", 3)["state"] == "UNAVAILABLE"
        assert "failed to load" in row(manager, "versioned", 3)["reason"]
        assert row(manager, "versioned", 2)["traffic"] == 1.0

        (repo / "versioned" / "3" / ".incomplete").touch()  # being rewritten
        shutil.rmtree(repo / "versioned" / "3")
        folder = add_version(repo, 3)
        (folder / ".incomplete").touch()
        await manager.load("versioned")  # the incomplete folder is skipped, not an error
        assert await infer(manager) == 2
        assert "incomplete" in row(manager, "versioned", 3)["reason"]
        (folder / ".incomplete").unlink()
        await manager.load("versioned")
        assert await infer(manager) == 3
        assert row(manager, "versioned", 2)["reason"].startswith("unloaded")
        await manager.close()

    run(main())


def test_rollback_walks_back_through_the_served_versions(tmp_path):
    repo = make_repository(tmp_path / "repo", "versioned", versions={"versioned": [1]})

    async def main():
        manager = ModelManager(repo, control_mode="explicit", load_models=["versioned"])
        await manager.load_all()
        for version in (2, 3):
            add_version(repo, version)
            await manager.load("versioned")
            assert await infer(manager) == version
        assert await manager.rollback("versioned") == 2
        assert await infer(manager) == 2
        status = manager.status("versioned")
        assert status["served_version"] == "2" and status["held_back"] == ["3"]
        assert row(manager, "versioned", 3)["reason"] == "unloaded (rolled back to version 2)"
        assert await manager.rollback("versioned") == 1
        assert await infer(manager) == 1
        with pytest.raises(InvalidInputError, match="no version to roll back to"):
            await manager.rollback("versioned")
        await manager.load("versioned")  # an explicit load lets the policy decide again
        assert await infer(manager) == 3 and manager.status("versioned")["held_back"] == []
        await manager.close()

    run(main())


def test_rollback_to_a_version_that_fails_changes_nothing(tmp_path):
    repo = make_repository(tmp_path / "repo", "versioned")
    weights = repo / "versioned" / "1" / "weights.npy"
    weights.write_bytes(weights.read_bytes()[:40])

    async def main():
        manager = ModelManager(repo, control_mode="explicit", load_models=["versioned"])
        await manager.load_all()
        with pytest.raises(ConfigError, match="version 1 failed to load"):
            await manager.rollback("versioned")
        assert await infer(manager) == 2
        assert manager.status("versioned")["held_back"] == []
        await manager.close()

    run(main())


def test_canary_split_promote_and_abort(tmp_path):
    repo = make_repository(tmp_path / "repo", "versioned", versions={"versioned": [1]})

    async def main():
        manager = ModelManager(repo, control_mode="explicit", load_models=["versioned"])
        await manager.load_all()
        add_version(repo, 2)
        await manager.set_canary("versioned", 2, 0.5)
        status = manager.status("versioned")
        assert status["served_version"] == "1"
        assert status["canary"] == {"version": "2", "weight": 0.5}
        got = [await infer(manager, rid=f"r{i}") for i in range(200)]
        assert 70 <= got.count(2) <= 130 and set(got) == {1, 2}
        assert got == [await infer(manager, rid=f"r{i}") for i in range(200)]  # by id
        assert await infer(manager, version="2") == 2 and await infer(manager, version="1") == 1

        assert await manager.promote_canary("versioned") == 2
        assert manager.status("versioned")["canary"] is None
        assert await infer(manager) == 2 and manager.models["versioned"].ready_versions() == [2]
        assert await manager.rollback("versioned") == 1

        await manager.set_canary("versioned", 2, 0.3)  # a held back version may be a canary
        await manager.abort_canary("versioned")
        assert await infer(manager) == 1 and manager.models["versioned"].ready_versions() == [1]
        assert manager.status("versioned")["held_back"] == ["2"]

        with pytest.raises(InvalidInputError, match="weight"):
            await manager.set_canary("versioned", 2, 1.5)
        with pytest.raises(ModelNotFoundError):
            await manager.set_canary("versioned", 9, 0.1)
        with pytest.raises(InvalidInputError, match="no canary"):
            await manager.promote_canary("versioned")
        with pytest.raises(InvalidInputError, match="already the default"):
            await manager.set_canary("versioned", 1, 0.1)
        add_version(repo, 3, truncated=True)
        with pytest.raises(ConfigError, match="version 3 failed to load"):
            await manager.set_canary("versioned", 3, 0.1)
        assert manager.status("versioned")["canary"] is None and await infer(manager) == 1
        await manager.close()

    run(main())


def test_canary_from_the_config(tmp_path):
    repo = make_repository(tmp_path / "repo", "versioned")
    with (repo / "versioned" / "config.yaml").open("a") as config:
        config.write("canary: {version: 2, weight: 0.25}\n")

    async def main():
        manager = ModelManager(repo)
        await manager.load_all()
        status = manager.status("versioned")
        assert status["served_version"] == "1"
        assert status["canary"] == {"version": "2", "weight": 0.25}
        await manager.close()

    run(main())


def test_unload_lets_admitted_requests_finish_and_refuses_new_ones(tmp_path):
    repo = make_repository(tmp_path / "repo", "slow_fp32")

    async def main():
        manager = ModelManager(repo, control_mode="explicit", load_models=["slow_fp32"])
        await manager.load_all()
        runner = manager.version("slow_fp32", None).runner
        admitted = [asyncio.create_task(infer(manager, "slow_fp32")) for _ in range(4)]
        await until(lambda: runner.in_flight_requests == 4, "4 requests admitted")
        unload = asyncio.create_task(manager.unload("slow_fp32"))
        await until(lambda: not serves(manager, "slow_fp32"), "the unload started")
        with pytest.raises(ModelNotReadyError, match="UNLOADING"):
            manager.version("slow_fp32", None)
        assert not unload.done()  # draining the admitted ones (slow_fp32: 0.5 s a batch)
        assert await asyncio.gather(*admitted) == [0, 0, 0, 0]  # all ran (2x - x at 0)
        await unload
        assert row(manager, "slow_fp32", 1)["reason"] == "unloaded (unload requested)"
        await manager.close()

    run(main())


def test_unload_runs_the_backend_unload_and_drops_every_reference(tmp_path):
    repo = make_repository(tmp_path / "repo", "versioned")

    async def main():
        manager = ModelManager(repo, control_mode="explicit", load_models=["versioned"])
        await manager.load_all()
        mv = manager.version("versioned", None)
        backend = mv.runner.instances[0].backend
        user_model = backend.model
        ref = weakref.ref(user_model)
        await manager.unload("versioned")
        assert user_model.unloaded and backend.model is None and mv.runner is None
        return user_model, ref, manager

    user_model, ref, _manager = run(main())
    del user_model
    gc.collect()
    assert ref() is None, gc.get_referrers(ref())


def test_concurrent_load_and_unload_of_one_model_end_in_the_last_ones_state(tmp_path):
    repo = make_repository(tmp_path / "repo", "versioned")

    async def main():
        manager = ModelManager(repo, control_mode="explicit", load_models=["versioned"])
        await manager.load_all()
        for _ in range(2):
            await asyncio.gather(manager.load("versioned"), manager.unload("versioned"))
            assert row(manager, "versioned", 2)["state"] == "UNAVAILABLE"
            assert not manager.is_ready()
            await asyncio.gather(manager.unload("versioned"), manager.load("versioned"))
            assert row(manager, "versioned", 2)["state"] == "READY"
            assert manager.is_ready() and await infer(manager) == 2
        await manager.close()

    run(main())


def test_poll_mode_applies_changes_once_folders_stop_changing(tmp_path):
    repo = make_repository(tmp_path / "repo", "versioned", versions={"versioned": [1]})

    async def main():
        manager = ModelManager(repo, control_mode="poll", poll_interval_s=3600)
        await manager.load_all()
        loads = []
        original = manager._load_version

        async def counting(mv):
            loads.append(mv.version)
            await original(mv)

        manager._load_version = counting
        assert await infer(manager) == 1

        add_version(repo, 2)
        await manager.poll_once()  # first sight: may still be being written
        assert await infer(manager) == 1
        assert "still changing" in row(manager, "versioned", 2)["reason"]
        await manager.poll_once()
        assert await infer(manager) == 2 and loads == [2]

        add_version(repo, 3, truncated=True)
        for _ in range(3):
            await manager.poll_once()
        assert await infer(manager) == 2
        assert loads == [2, 3]  # tried once; not again while the folder is unchanged
        assert "failed to load" in row(manager, "versioned", 3)["reason"]

        (add_version(repo, 4) / ".incomplete").touch()
        await manager.poll_once()
        await manager.poll_once()
        assert await infer(manager) == 2 and "incomplete" in row(manager, "versioned", 4)["reason"]
        (repo / "versioned" / "4" / ".incomplete").unlink()
        await manager.poll_once()
        await manager.poll_once()
        assert await infer(manager) == 4

        config = repo / "versioned" / "config.yaml"
        text = config.read_text()
        config.write_text(text.replace("max_queue_delay_us: 1000", "max_queue_delay_us: 2000"))
        await manager.poll_once()
        assert await infer(manager) == 4 and loads[-1] == 4 and len(loads) == 4
        assert manager.version("versioned", None).config.dynamic_batching.max_queue_delay_us == 2000

        config.write_text(text + "max_batch_size: -3\n")
        await manager.poll_once()
        assert await infer(manager) == 4
        assert "configuration change not applied" in row(manager, "versioned", 4)["reason"]
        config.write_text(text)

        make_repository(repo, "double_fp32")
        await manager.poll_once()
        await manager.poll_once()
        assert await infer(manager, "double_fp32") == 0
        shutil.rmtree(repo / "double_fp32")
        await manager.poll_once()
        with pytest.raises(ModelNotFoundError):
            manager.version("double_fp32", None)
        await manager.close()

    run(main())


def test_poll_mode_logs_a_new_model_that_cannot_load_as_the_start_does(tmp_path, caplog):
    """A model added to a polled repository that cannot load (a bad configuration, an empty
    version folder, a version whose load fails) logs an error naming it and why, once the
    folder has stopped changing, and once per reason (not at every scan)."""
    repo = make_repository(tmp_path / "repo", "double_fp32")
    good = (repo / "double_fp32" / "config.yaml").read_text()

    async def main():
        manager = ModelManager(repo, control_mode="poll", poll_interval_s=3600)
        await manager.load_all()
        bad = repo / "bad_config"
        (bad / "1").mkdir(parents=True)
        (bad / "config.yaml").write_text(good + "max_batch_size: -3\n")
        empty = repo / "empty_version"
        (empty / "1").mkdir(parents=True)
        (empty / "config.yaml").write_text(good)
        make_repository(repo, "broken_model")
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="gpuserve.repository"):
            await manager.poll_once()  # first sight: may still be being written
            assert "bad_config" not in caplog.text and "empty_version" not in caplog.text
            for _ in range(3):
                await manager.poll_once()
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        bad_lines = [m for m in errors if m.startswith("model bad_config cannot be loaded")]
        assert len(bad_lines) == 1 and "max_batch_size" in bad_lines[0], errors
        empty_lines = [m for m in errors if m.startswith("model empty_version cannot be loaded")]
        assert len(empty_lines) == 1 and "empty version folder" in empty_lines[0], errors
        broken = [m for m in errors if m.startswith("model broken_model")]
        assert broken and "failed to load" in broken[0], errors

        (bad / "config.yaml").write_text(good + "max_batch_size: -4\n")  # another reason
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="gpuserve.repository"):
            await manager.poll_once()
            await manager.poll_once()
        assert "bad_config cannot be loaded" in caplog.text and "-4" in caplog.text
        await manager.close()

    run(main())


def test_strict_readiness_requires_every_required_model_and_recovers(tmp_path):
    repo = make_repository(tmp_path / "repo", "versioned", "broken_model")

    async def main():
        lenient = ModelManager(repo)
        await lenient.load_all()
        assert lenient.is_ready()
        await lenient.close()
        strict = ModelManager(
            repo, control_mode="explicit", load_models=["*"], strict_readiness=True
        )
        await strict.load_all()
        assert not strict.is_ready()  # broken_model is required and failed
        await strict.unload("broken_model")
        assert strict.is_ready()  # recovers without a restart (BC-16)
        with pytest.raises(ConfigError, match="broken_model"):
            await strict.load("broken_model")
        assert strict.is_ready()  # a failed load of a model not serving does not flip it
        await strict.close()

    run(main())
