"""The reconcile planner: what a lifecycle change should do, as pure functions of state.

Every change of a model (start-up, the repository API, the poll loop, rollback, canary) is
planned here and carried out by :mod:`gpuserve.repository.lifecycle.executor`. The planner reads a
:class:`ModelState` snapshot and the scanned version folders and returns typed plans; it does
no I/O, never awaits and changes nothing, so its invariants are table tests.

A change is planned in steps, because what loads decides what switches:

1. :func:`plan_reconcile`: bookkeeping to drop (holds whose folder changed, notes and failure
   records of folders that are gone), notes to set (incomplete or still changing folders),
   the *candidates* (versions that may serve after the change) and which of them would load;
2. :func:`next_loads`, once per round: the versions to load next, given what loaded or failed
   so far (a failed new version stops being a candidate, so the policy may pick another);
3. :func:`plan_switch`: from the load results, the versions that join the loaded set, those
   that leave, and the route (:func:`~gpuserve.repository.traffic.plan_route`), all
   installed in one synchronous step.

The routing settings (holds, canary, rollback history) that rollback and canary commands set
before a change are planned in :mod:`gpuserve.repository.lifecycle.rollout`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from gpuserve.config import CanaryConfig, VersionPolicy
from gpuserve.repository.scan import Fingerprint, VersionFolder
from gpuserve.repository.state import Model, VersionState
from gpuserve.repository.traffic import RoutePlan, Signature, plan_route, signature

#: Why versions that leave in a change are unloaded, unless the change says otherwise.
NOT_SELECTED = "not selected by the version policy"

# -- what the planner reads --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Loaded:
    """One version of a model's loaded set, as the planner sees it.

    Attributes:
        ready: READY (False while it loads or drains).
        fingerprint: Its version folder's content when it was loaded.
        stale: Loaded from another model configuration than the one versions load with now
            (it must load again).
        signature: Its declared inputs and outputs.
    """

    ready: bool = True
    fingerprint: Fingerprint = ()
    stale: bool = False
    signature: Signature = ((), ())


@dataclass(frozen=True, slots=True)
class Settings:
    """The routing settings a change works from (set by rollback and canary commands).

    Attributes:
        held: Held back versions with their folder's fingerprint then (the policy skips them).
        canary: The canary in effect, or None.
        history: Versions served before, most recent last.
    """

    held: Mapping[int, Fingerprint] = field(default_factory=dict)
    canary: CanaryConfig | None = None
    history: tuple[int, ...] = ()

    @classmethod
    def of(cls, model: Model) -> Settings:
        """A copy of ``model``'s routing settings."""
        return cls(dict(model.held), model.canary, tuple(model.history))


@dataclass(frozen=True, slots=True)
class ModelState:
    """A model's lifecycle state, as the planner reads it (see :func:`snapshot`).

    Attributes:
        name: The model name (error messages).
        policy: The version policy of the configuration versions load with.
        loaded: The loaded set by version number.
        settings: Holds, canary and history.
        failed: Versions that failed to load, with their folder's fingerprint then.
        notes: Versions that have a note (why they are not loaded).
        default: The version the route serves now, or None.
    """

    name: str
    policy: VersionPolicy = field(default_factory=VersionPolicy)
    loaded: Mapping[int, Loaded] = field(default_factory=dict)
    settings: Settings = field(default_factory=Settings)
    failed: Mapping[int, Fingerprint] = field(default_factory=dict)
    notes: frozenset[int] = frozenset()
    default: int | None = None


def snapshot(model: Model) -> ModelState:
    """What the planner needs of ``model`` (copied: later changes of it do not show).

    Raises:
        AssertionError: the model has no configuration to load versions with.
    """
    source = model.source_config
    assert source is not None
    loaded = {
        v: Loaded(
            ready=mv.state is VersionState.READY,
            fingerprint=mv.fingerprint,
            stale=mv.source_config != source,
            signature=signature(mv.config),
        )
        for v, mv in model.versions.items()
    }
    return ModelState(
        name=model.name,
        policy=source.version_policy,
        loaded=loaded,
        settings=Settings.of(model),
        failed=dict(model.failed),
        notes=frozenset(model.notes),
        default=model.served_version(),
    )


# -- step 1: what may serve, what would load ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reconcile:
    """The start of a change (:func:`plan_reconcile`).

    Attributes:
        drop_notes: Versions whose note goes (no folder and not loaded).
        drop_failed: Failure records that go (their folder is gone).
        drop_held: Holds that end (their folder is gone or changed).
        notes: Notes to set, by version (an incomplete or still changing folder).
        candidates: Versions that may serve after the change, ascending.
        to_load: Candidates to load if the policy wants them: new, changed, or loaded from
            another configuration, and loadable now.
        live: The READY versions now.
        held: The holds in effect (after ``drop_held``).
    """

    drop_notes: frozenset[int] = frozenset()
    drop_failed: frozenset[int] = frozenset()
    drop_held: frozenset[int] = frozenset()
    notes: Mapping[int, str] = field(default_factory=dict)
    candidates: tuple[int, ...] = ()
    to_load: frozenset[int] = frozenset()
    live: frozenset[int] = frozenset()
    held: frozenset[int] = frozenset()

    def failure_note(self, version: int, reason: str) -> str:
        """The index note of ``version`` after it failed to load with ``reason``."""
        return f"reload failed: {reason}" if version in self.live else reason


def plan_reconcile(
    state: ModelState,
    folders: Mapping[int, VersionFolder],
    *,
    settled: Collection[int] | None = None,
    retry_failed: bool,
) -> Reconcile:
    """Step 1 of a change: bookkeeping, notes, candidates and what would load.

    A version with a problem folder (incomplete, empty, outside the repository), one that
    failed before with the same content (unless ``retry_failed``) or, in ``poll`` mode, one
    whose folder is still changing, never loads: it stays a candidate only while it serves.

    Args:
        state: The model now.
        folders: Its version folders by number (the scan the change works from).
        settled: ``poll``: the versions whose folder looked the same on the last scan (the
            others are left for a later scan); None: every folder is settled.
        retry_failed: Load versions again that failed before with the same content.
    """
    held = state.settings.held
    drop_held = {
        v for v, prints in held.items() if v not in folders or folders[v].fingerprint != prints
    }
    failed = {v: prints for v, prints in state.failed.items() if v in folders}
    live = {v for v, loaded in state.loaded.items() if loaded.ready}
    notes: dict[int, str] = {}
    candidates: list[int] = []
    to_load: set[int] = set()
    for v, folder in sorted(folders.items()):
        if folder.problem is not None or (not retry_failed and failed.get(v) == folder.fingerprint):
            if v in live:
                candidates.append(v)
            elif folder.problem is not None:
                notes[v] = folder.problem
            continue
        unsettled = settled is not None and v not in settled
        if unsettled and v not in live:
            notes[v] = f"{folder.path}: still changing; loads once it stays unchanged"
            continue
        candidates.append(v)
        loaded = state.loaded.get(v)
        current = (
            loaded is not None
            and loaded.ready
            and not loaded.stale
            and loaded.fingerprint == folder.fingerprint
        )
        if not unsettled and not current:
            to_load.add(v)
    return Reconcile(
        drop_notes=frozenset(v for v in state.notes if v not in folders and v not in state.loaded),
        drop_failed=frozenset(set(state.failed) - set(failed)),
        drop_held=frozenset(drop_held),
        notes=notes,
        candidates=tuple(candidates),
        to_load=frozenset(to_load),
        live=frozenset(live),
        held=frozenset(set(held) - drop_held),
    )


def select_versions(
    policy: VersionPolicy, candidates: Collection[int], held: Collection[int], canary: int | None
) -> set[int]:
    """The versions to have loaded: the version policy over ``candidates`` without the held
    back ones and the canary, plus the canary (when it is a candidate)."""
    if canary not in candidates:
        canary = None
    base = [v for v in candidates if v != canary and v not in held]
    selected = set(policy.select(base))
    if canary is not None:
        selected.add(canary)
    return selected


# -- step 2: loading rounds --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoadResult:
    """How loading one version for a change ended.

    Attributes:
        ready: It loaded and warmed up.
        reason: Why it failed, or "".
        signature: Its declared inputs and outputs (completed by its backend).
    """

    ready: bool
    reason: str = ""
    signature: Signature = ((), ())


@dataclass(frozen=True, slots=True)
class LoadStep:
    """One loading round (:func:`next_loads`).

    Attributes:
        versions: The versions to load now, ascending (empty: loading is over).
        refused: Why the change stops and nothing switches (the required version failed),
            or None.
    """

    versions: tuple[int, ...] = ()
    refused: str | None = None


def _remaining(plan: Reconcile, results: Mapping[int, LoadResult]) -> list[int]:
    """The candidates left: a new version that failed to load is no longer one."""
    return [v for v in plan.candidates if v in plan.live or v not in results or results[v].ready]


def _desired(state: ModelState, plan: Reconcile, results: Mapping[int, LoadResult]) -> set[int]:
    canary = state.settings.canary
    return select_versions(
        state.policy,
        _remaining(plan, results),
        plan.held,
        canary.version if canary is not None else None,
    )


def next_loads(
    state: ModelState,
    plan: Reconcile,
    results: Mapping[int, LoadResult],
    require: int | None = None,
) -> LoadStep:
    """Step 2, once per round: what to load next given what loaded or failed so far.

    Args:
        state: The model when the change started.
        plan: Its :func:`plan_reconcile`.
        results: Every version loaded for this change so far, by number.
        require: The version the change exists for: if it failed, nothing switches.
    """
    if require is not None and require in results and not results[require].ready:
        return LoadStep(
            refused=f"model '{state.name}' version {require} failed to load: "
            f"{results[require].reason}"
        )
    desired = _desired(state, plan, results)
    return LoadStep(tuple(v for v in sorted(desired) if v not in results and v in plan.to_load))


# -- step 3: the switch ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Switch:
    """Step 3: the one synchronous change of the loaded set and the route.

    Attributes:
        refused: Why nothing switches (the required version is not selected), or None.
        install: Versions loaded for this change that join the loaded set (replacing a
            loaded version of the same number, which then drains).
        retire: Versions that leave the loaded set (they drain), ascending.
        route: The route after the switch.
    """

    refused: str | None = None
    install: tuple[int, ...] = ()
    retire: tuple[int, ...] = ()
    route: RoutePlan = field(default_factory=RoutePlan)


def plan_switch(
    state: ModelState,
    plan: Reconcile,
    results: Mapping[int, LoadResult],
    *,
    require: int | None = None,
    forward: bool = True,
) -> Switch:
    """Step 3: from the load results, what joins, what leaves and the route.

    A version that failed to load never replaces one that serves: a loaded copy of it keeps
    serving, and a new one is simply absent.

    Args:
        state: The model when the change started.
        plan: Its :func:`plan_reconcile`.
        results: Every version loaded for this change, by number.
        require: The version the change exists for: if the policy does not select it,
            nothing switches.
        forward: See :func:`~gpuserve.repository.traffic.plan_route`.
    """
    desired = _desired(state, plan, results)
    if require is not None and require not in desired:
        return Switch(
            refused=f"model '{state.name}': version {require} is not selected by the version "
            f"policy of its config (versions loadable: {sorted(_remaining(plan, results))})"
        )
    install = tuple(sorted(v for v, result in results.items() if result.ready))
    after = {v: loaded.signature for v, loaded in state.loaded.items() if loaded.ready}
    after.update((v, results[v].signature) for v in install)
    ready = {v: sig for v, sig in after.items() if v in desired}
    route = plan_route(
        ready,
        held=plan.held,
        canary=state.settings.canary,
        history=state.settings.history,
        before=state.default,
        forward=forward,
    )
    return Switch(None, install, tuple(sorted(set(after) - desired)), route)
