"""The reconcile planner as tables: a model's state and its version folders in, the plan out.

Each change is driven here the way the executor drives it (plan, loading rounds, switch), with
a table of which loads fail instead of loading anything: pure, no models, no event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpuserve.config import CanaryConfig, ModelConfig, TensorSpec, VersionPolicy
from gpuserve.repository.lifecycle.planner import (
    Loaded,
    LoadResult,
    ModelState,
    Reconcile,
    Settings,
    Switch,
    next_loads,
    plan_reconcile,
    plan_switch,
    snapshot,
)
from gpuserve.repository.scan import Fingerprint, VersionFolder
from gpuserve.repository.state import Model, ModelVersion, VersionState
from gpuserve.repository.traffic import HISTORY_LENGTH, Signature, plan_route, signature

SIG = signature(
    ModelConfig(
        inputs=[TensorSpec(name="X", datatype="FP32", shape=[4])],
        outputs=[TensorSpec(name="Y", datatype="FP32", shape=[4])],
    )
)
OTHER_SIG: Signature = (SIG[0], (TensorSpec(name="Z", datatype="INT64", shape=[1]),))

LATEST = VersionPolicy()
LATEST_2 = VersionPolicy(latest={"num_versions": 2})
ALL = VersionPolicy(all={})
ONLY_1_2 = VersionPolicy(specific={"versions": [1, 2]})


def fp(version: int, edit: int = 0) -> Fingerprint:
    """A folder fingerprint; another ``edit`` is the same folder with changed content."""
    return (("model.py", 100, version * 1000 + edit),)


def folders(
    *versions: int, problem: tuple[int, ...] = (), edited: tuple[int, ...] = ()
) -> dict[int, VersionFolder]:
    """Version folders: ``problem`` ones are incomplete, ``edited`` ones changed since load."""
    return {
        v: VersionFolder(
            v,
            Path(f"/repo/m/{v}"),
            fp(v, 1 if v in edited else 0),
            f"/repo/m/{v}: incomplete" if v in problem else None,
        )
        for v in versions
    }


def state(
    *ready: int,
    policy: VersionPolicy = LATEST,
    held: tuple[int, ...] = (),
    failed: tuple[int, ...] = (),
    canary: tuple[int, float] | None = None,
    history: tuple[int, ...] = (),
    default: int | None = None,
    stale: tuple[int, ...] = (),
    notes: tuple[int, ...] = (),
    signatures: dict[int, Signature] | None = None,
) -> ModelState:
    """A model serving ``ready`` (default: the highest) from unedited folders."""
    sigs = signatures or {}
    return ModelState(
        name="m",
        policy=policy,
        loaded={v: Loaded(True, fp(v), v in stale, sigs.get(v, SIG)) for v in ready},
        settings=Settings(
            {v: fp(v) for v in held},
            CanaryConfig(version=canary[0], weight=canary[1]) if canary else None,
            history,
        ),
        failed={v: fp(v) for v in failed},
        notes=frozenset(notes),
        default=default if default is not None else (max(ready) if ready else None),
    )


@dataclass
class Outcome:
    """What one change does: the planner's steps with a fake loader."""

    plan: Reconcile
    rounds: list[tuple[int, ...]] = field(default_factory=list)
    refused: str | None = None
    switch: Switch | None = None

    @property
    def route(self) -> tuple[int | None, int | None]:
        assert self.switch is not None, self.refused
        return self.switch.route.default, self.switch.route.canary


def drive(
    model: ModelState,
    found: dict[int, VersionFolder],
    *,
    fails: tuple[int, ...] = (),
    retry_failed: bool = True,
    settled: tuple[int, ...] | None = None,
    require: int | None = None,
    forward: bool = True,
    signatures: dict[int, Signature] | None = None,
) -> Outcome:
    """Run plan -> rounds of loads (``fails`` fail) -> switch, as the executor does."""
    plan = plan_reconcile(model, found, settled=settled, retry_failed=retry_failed)
    outcome = Outcome(plan)
    results: dict[int, LoadResult] = {}
    while True:
        step = next_loads(model, plan, results, require)
        if step.refused is not None:
            outcome.refused = step.refused
            return outcome
        if not step.versions:
            break
        outcome.rounds.append(step.versions)
        for v in step.versions:
            sig = (signatures or {}).get(v, SIG)
            results[v] = (
                LoadResult(False, "failed to load: boom")
                if v in fails
                else LoadResult(True, signature=sig)
            )
    switch = plan_switch(model, plan, results, require=require, forward=forward)
    if switch.refused is not None:
        outcome.refused = switch.refused
    else:
        outcome.switch = switch
    return outcome


# -- a change: what loads, what switches, what leaves -------------------------------------------


@pytest.mark.parametrize(
    ("model", "found", "options", "rounds", "install", "retire", "default"),
    [
        pytest.param(
            state(2), folders(1, 2, 3), {}, [(3,)], (3,), (2,), 3, id="new-version-replaces"
        ),
        pytest.param(
            state(2),
            folders(1, 2, 3),
            {"fails": (3,)},
            [(3,)],
            (),
            (),
            2,
            id="failed-new-version-never-replaces-the-serving-one",
        ),
        pytest.param(
            state(2),
            folders(1, 2, edited=(2,)),
            {"fails": (2,)},
            [(2,)],
            (),
            (),
            2,
            id="failed-reload-keeps-the-previous-load-serving",
        ),
        pytest.param(
            state(),
            folders(1, 2, 3),
            {"fails": (3,)},
            [(3,), (2,)],
            (2,),
            (),
            2,
            id="policy-falls-back-when-the-newest-fails",
        ),
        pytest.param(
            state(),
            folders(1, 2),
            {"fails": (1, 2)},
            [(2,), (1,)],
            (),
            (),
            None,
            id="nothing-loads-nothing-serves",
        ),
        pytest.param(state(2), folders(1, 2), {}, [], (), (), 2, id="unchanged-loads-nothing"),
        pytest.param(
            state(2, stale=(2,)),
            folders(1, 2),
            {},
            [(2,)],
            (2,),
            (),
            2,
            id="config-change-reloads-the-version",
        ),
        pytest.param(
            state(2),
            folders(1, 2, 3, problem=(3,)),
            {},
            [],
            (),
            (),
            2,
            id="incomplete-folder-never-loads",
        ),
        pytest.param(
            state(3),
            folders(1, 2, 3, problem=(3,)),
            {},
            [],
            (),
            (),
            3,
            id="serving-version-whose-folder-turns-incomplete-keeps-serving",
        ),
        pytest.param(state(2), folders(1), {}, [(1,)], (1,), (2,), 1, id="removed-folder-retires"),
        pytest.param(
            state(1, 2, policy=LATEST_2),
            folders(1, 2, 3),
            {},
            [(3,)],
            (3,),
            (1,),
            3,
            id="latest-2-keeps-two",
        ),
        pytest.param(
            state(policy=ALL),
            folders(1, 2, 3),
            {"fails": (2,)},
            [(1, 2, 3)],
            (1, 3),
            (),
            3,
            id="all-loads-every-version-in-one-round",
        ),
        pytest.param(
            state(3, held=(3,)),
            folders(1, 2, 3),
            {},
            [(2,)],
            (2,),
            (3,),
            2,
            id="held-version-is-skipped",
        ),
        pytest.param(
            state(3, held=(3,)),
            folders(1, 2, 3, edited=(3,)),
            {},
            [(3,)],
            (3,),
            (),
            3,
            id="hold-ends-when-the-folder-changes",
        ),
        pytest.param(
            state(2),
            folders(1, 2, 3),
            {"settled": (1, 2)},
            [],
            (),
            (),
            2,
            id="poll-leaves-an-unsettled-new-folder-alone",
        ),
        pytest.param(
            state(2),
            folders(1, 2, edited=(2,)),
            {"settled": (1,)},
            [],
            (),
            (),
            2,
            id="poll-does-not-reload-an-unsettled-serving-folder",
        ),
        pytest.param(
            state(2),
            folders(1, 2, 3),
            {"settled": (1, 2, 3)},
            [(3,)],
            (3,),
            (2,),
            3,
            id="poll-loads-a-settled-folder",
        ),
        pytest.param(
            state(2, failed=(3,)),
            folders(1, 2, 3),
            {"retry_failed": False},
            [],
            (),
            (),
            2,
            id="failed-fingerprint-not-retried-without-retry-failed",
        ),
        pytest.param(
            state(2, failed=(3,)),
            folders(1, 2, 3),
            {},
            [(3,)],
            (3,),
            (2,),
            3,
            id="failed-fingerprint-retried-with-retry-failed",
        ),
        pytest.param(
            state(2, failed=(3,)),
            folders(1, 2, 3, edited=(3,)),
            {"retry_failed": False},
            [(3,)],
            (3,),
            (2,),
            3,
            id="failed-version-retried-once-its-folder-changes",
        ),
    ],
)
def test_a_change(model, found, options, rounds, install, retire, default):
    outcome = drive(model, found, **options)
    assert outcome.refused is None and outcome.switch is not None
    assert outcome.rounds == rounds
    assert outcome.switch.install == install
    assert outcome.switch.retire == retire
    assert outcome.switch.route.default == default


def test_notes_and_bookkeeping_of_a_change():
    model = state(2, held=(4, 5), failed=(6,), notes=(2, 7, 9))
    found = folders(1, 2, 3, 4, 5, problem=(3,), edited=(5,))
    plan = plan_reconcile(model, found, settled={1, 2, 3, 4, 5}, retry_failed=False)
    assert plan.notes == {3: "/repo/m/3: incomplete"}
    assert plan.drop_held == {5} and plan.held == {4}  # 5 changed: no longer held
    assert plan.drop_failed == {6}  # its folder is gone
    assert plan.drop_notes == {7, 9}  # no folder, not loaded
    unsettled = plan_reconcile(model, folders(1, 2, 8), settled={1, 2}, retry_failed=True)
    assert unsettled.notes == {8: "/repo/m/8: still changing; loads once it stays unchanged"}
    assert 8 not in unsettled.candidates
    assert plan.failure_note(2, "boom") == "reload failed: boom"  # 2 keeps serving
    assert plan.failure_note(3, "boom") == "boom"


# -- a change that must end with one version serving (rollback, canary) -------------------------


@pytest.mark.parametrize(
    ("model", "found", "options", "refused"),
    [
        pytest.param(
            state(2, held=(2,)),
            folders(1, 2),
            {"require": 1, "fails": (1,)},
            "model 'm' version 1 failed to load: failed to load: boom",
            id="required-version-fails",
        ),
        pytest.param(
            state(2, policy=ONLY_1_2),
            folders(1, 2, 3),
            {"require": 3},
            "model 'm': version 3 is not selected by the version policy of its config "
            "(versions loadable: [1, 2, 3])",
            id="required-version-not-selected",
        ),
        pytest.param(
            state(2),
            folders(1, 2, 3, problem=(3,)),
            {"require": 3},
            "version 3 is not selected",
            id="required-version-incomplete",
        ),
    ],
)
def test_a_required_version_that_cannot_serve_changes_nothing(model, found, options, refused):
    outcome = drive(model, found, **options)
    assert outcome.switch is None
    assert outcome.refused is not None and refused in outcome.refused


def test_the_required_version_stops_the_loading_rounds():
    # latest-1 over 1..3 with 3 required: it fails, so 2 (the fallback) is never loaded
    outcome = drive(state(), folders(1, 2, 3), require=3, fails=(3,))
    assert outcome.rounds == [(3,)] and "version 3 failed" in (outcome.refused or "")


# -- the route --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ready", "held", "canary", "route"),
    [
        pytest.param((1, 2, 3), (), None, (3, None, 0.0), id="highest-ready"),
        pytest.param((1, 2, 3), (3,), None, (2, None, 0.0), id="highest-not-held"),
        pytest.param((2, 3), (2, 3), None, (3, None, 0.0), id="all-held-the-highest-serves"),
        pytest.param((1, 2, 3), (), (3, 0.2), (2, 3, 0.2), id="canary-is-never-the-default"),
        pytest.param((1, 2), (), (1, 0.4), (2, 1, 0.4), id="canary-below-the-default"),
        pytest.param((3,), (), (3, 0.2), (3, None, 0.0), id="a-lone-canary-serves-all"),
        pytest.param((1, 2), (), (5, 0.2), (2, None, 0.0), id="canary-not-ready-no-share"),
        pytest.param((), (), (1, 0.2), (None, None, 0.0), id="nothing-ready"),
    ],
)
def test_route(ready, held, canary, route):
    config = CanaryConfig(version=canary[0], weight=canary[1]) if canary else None
    plan = plan_route(
        dict.fromkeys(ready, SIG), held=held, canary=config, history=(), before=None, forward=True
    )
    assert (plan.default, plan.canary, plan.weight) == route
    assert plan.warning is None


def test_a_canary_with_other_inputs_or_outputs_takes_no_traffic():
    config = CanaryConfig(version=3, weight=0.5)
    plan = plan_route(
        {2: SIG, 3: OTHER_SIG}, held=(), canary=config, history=(), before=2, forward=True
    )
    assert (plan.default, plan.canary, plan.weight) == (2, None, 0.0)
    assert plan.warning == (
        "canary version 3 declares other inputs or outputs than version 2; it takes no traffic"
    )
    # through a whole change: the canary loads, and still takes nothing
    outcome = drive(state(2, canary=(3, 0.5)), folders(1, 2, 3), signatures={3: OTHER_SIG})
    assert outcome.switch is not None and outcome.switch.install == (3,)
    assert outcome.route == (2, None) and outcome.switch.route.warning is not None


@pytest.mark.parametrize(
    ("before", "after", "forward", "history"),
    [
        pytest.param(1, 2, True, (7, 1), id="forward-records-the-previous-default"),
        pytest.param(1, 2, False, (7,), id="rollback-does-not-record"),
        pytest.param(2, 2, True, (7,), id="same-default-records-nothing"),
        pytest.param(None, 2, True, (7,), id="first-load-records-nothing"),
    ],
)
def test_history(before, after, forward, history):
    plan = plan_route(
        {after: SIG}, held=(), canary=None, history=(7,), before=before, forward=forward
    )
    assert plan.default == after and plan.history == history


def test_history_is_bounded():
    long = tuple(range(1, HISTORY_LENGTH + 1))
    plan = plan_route({99: SIG}, held=(), canary=None, history=long, before=50, forward=True)
    assert len(plan.history) == HISTORY_LENGTH and plan.history[-1] == 50


def test_a_canary_loads_beside_the_default_and_held_canary_still_serves_as_canary():
    outcome = drive(state(1, canary=(2, 0.3), held=(2,)), folders(1, 2))
    assert outcome.rounds == [(2,)] and outcome.route == (1, 2)
    assert outcome.switch is not None and outcome.switch.route.weight == 0.3


# -- the snapshot the executor plans from -------------------------------------------------------


def test_snapshot_reads_a_model():
    config = ModelConfig(
        inputs=[TensorSpec(name="X", datatype="FP32", shape=[4])],
        outputs=[TensorSpec(name="Y", datatype="FP32", shape=[4])],
    )
    changed = config.model_copy(update={"max_batch_size": 4})
    model = Model("m", config, source_config=changed)
    model.versions = {
        1: ModelVersion(
            "m", 1, Path("1"), config, VersionState.READY, fingerprint=fp(1), source_config=config
        ),
        2: ModelVersion("m", 2, Path("2"), config, VersionState.LOADING, source_config=changed),
    }
    model.held, model.history, model.notes = {1: fp(1)}, [3], {4: "unloaded"}
    got = snapshot(model)
    assert got.loaded[1] == Loaded(True, fp(1), True, SIG)  # loaded from another config
    assert got.loaded[2].ready is False and got.loaded[2].stale is False
    assert got.settings.held == {1: fp(1)} and got.settings.history == (3,)
    assert got.notes == {4} and got.default is None
