"""Routing settings of the rollback and canary commands as tables: settings in, settings out.

Pure: no models, no event loop. What the change after them does with the settings is in
``test_repository_planner.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuserve.config import CanaryConfig
from gpuserve.errors import ConfigError, InvalidInputError, ModelNotFoundError
from gpuserve.repository.lifecycle.planner import Settings
from gpuserve.repository.report import load_failed
from gpuserve.repository.lifecycle.rollout import (
    canary_config,
    current_canary,
    plan_abort,
    plan_canary,
    plan_promote,
    plan_rollback,
)
from gpuserve.repository.scan import Fingerprint, VersionFolder


def fp(version: int) -> Fingerprint:
    return (("model.py", 100, version),)


def folders(*versions: int, problem: tuple[int, ...] = ()) -> dict[int, VersionFolder]:
    return {
        v: VersionFolder(v, Path(f"/r/m/{v}"), fp(v), "incomplete" if v in problem else None)
        for v in versions
    }


def held(*versions: int) -> dict[int, Fingerprint]:
    return {v: fp(v) for v in versions}


CANARY = CanaryConfig(version=3, weight=0.2)


@pytest.mark.parametrize(
    ("current", "history", "found", "target", "held_after", "history_after"),
    [
        pytest.param(3, (1, 2), folders(1, 2, 3), 2, (3,), (1,), id="last-served"),
        pytest.param(3, (1, 2, 3), folders(1, 2, 3), 2, (3,), (1,), id="skips-the-current-version"),
        pytest.param(
            3, (1, 2), folders(1, 2, 3, problem=(2,)), 1, (2, 3), (), id="skips-not-loadable"
        ),
        pytest.param(3, (1, 5), folders(1, 2, 3), 1, (2, 3), (), id="skips-a-removed-folder"),
        pytest.param(
            3, (), folders(1, 2, 3, 4), 2, (3, 4), (), id="no-history-the-next-lower-version"
        ),
        pytest.param(
            2, (4,), folders(1, 2, 3, 4, 5), 4, (5,), (), id="back-up-to-a-higher-version"
        ),
        pytest.param(
            3,
            (),
            folders(1, 2, 3, 4, problem=(4,)),
            2,
            (3, 4),
            (),
            id="folders-above-the-target-are-held-even-incomplete",
        ),
    ],
)
def test_rollback(current, history, found, target, held_after, history_after):
    settings = Settings(held(target, 9), CANARY, history)
    plan = plan_rollback("m", current, settings, found)
    assert plan.target == target
    assert sorted(plan.settings.held) == sorted({*held_after, 9} - {target})  # target freed
    assert plan.settings.history == history_after
    assert plan.settings.canary is None  # a rollback ends the canary


@pytest.mark.parametrize(
    ("current", "history", "found"),
    [
        pytest.param(1, (), folders(1, 2), id="nothing-below"),
        pytest.param(2, (2,), folders(1, 2, problem=(1,)), id="only-an-incomplete-one-below"),
    ],
)
def test_rollback_without_a_target(current, history, found):
    with pytest.raises(InvalidInputError, match="no version to roll back to from version"):
        plan_rollback("m", current, Settings(history=history), found)


@pytest.mark.parametrize(
    ("canary", "before", "found", "after"),
    [
        pytest.param(3, (3,), folders(1, 2, 3), (), id="the-canary-is-no-longer-held"),
        pytest.param(2, (), folders(1, 2, 3, 4), (3, 4), id="versions-above-it-are-held"),
        pytest.param(2, (1,), folders(1, 2, 3, 4, problem=(4,)), (1, 3), id="only-loadable-ones"),
    ],
)
def test_promote(canary, before, found, after):
    settings = plan_promote(canary, Settings(held(*before), CANARY, (1,)), found)
    assert sorted(settings.held) == list(after)
    assert settings.canary is None and settings.history == (1,)


@pytest.mark.parametrize(
    ("canary", "served", "found", "after"),
    [
        pytest.param(3, 2, folders(1, 2, 3), (3,), id="a-canary-above-the-default-is-held"),
        pytest.param(1, 2, folders(1, 2, 3), (), id="a-canary-below-is-not-held"),
        pytest.param(3, None, folders(1, 2, 3), (), id="nothing-served-nothing-held"),
        pytest.param(3, 2, folders(1, 2), (), id="a-removed-canary-is-not-held"),
    ],
)
def test_abort(canary, served, found, after):
    settings = plan_abort(canary, served, Settings({}, CANARY, (1,)), found)
    assert sorted(settings.held) == list(after)
    assert settings.canary is None and settings.history == (1,)


def test_set_canary_frees_a_held_version_and_refuses_what_cannot_be_one():
    settings = plan_canary("m", CANARY, 2, Settings(held(3, 4), None, (1,)), folders(1, 2, 3))
    assert settings.canary == CANARY and sorted(settings.held) == [4]
    assert settings.history == (1,)
    with pytest.raises(ModelNotFoundError, match=r"no version folder 3 \(versions: \[1, 2\]\)"):
        plan_canary("m", CANARY, 2, Settings(), folders(1, 2))
    with pytest.raises(ConfigError, match="incomplete"):
        plan_canary("m", CANARY, 2, Settings(), folders(1, 2, 3, problem=(3,)))
    with pytest.raises(InvalidInputError, match="already the default version"):
        plan_canary("m", CANARY, 3, Settings(), folders(1, 2, 3))


@pytest.mark.parametrize(
    ("version", "weight", "field"),
    [(2, 1.5, "weight"), (2, -0.1, "weight"), (0, 0.5, "version")],
)
def test_canary_config_names_the_bad_field(version, weight, field):
    with pytest.raises(InvalidInputError, match=f"canary for model 'm': field '{field}'"):
        canary_config("m", version, weight)


def test_current_canary_and_load_failure_message():
    assert current_canary("m", CANARY) == 3
    with pytest.raises(InvalidInputError, match="model 'm' has no canary"):
        current_canary("m", None)
    assert load_failed("m", {3: "boom", 1: "bad"}, 2) == (
        "failed to load model 'm': version 1: bad; version 3: boom; version 2 keeps serving"
    )
    assert load_failed("m", {1: "bad"}, None) == "failed to load model 'm': version 1: bad"
