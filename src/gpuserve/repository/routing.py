"""The two decisions of a lifecycle change, as pure functions of a :class:`Model`'s state:
which versions should be loaded, and where unversioned requests go once they are.

No I/O and no awaiting: the manager loads and drains, these only decide, so they are tested
without loading anything.
"""

from __future__ import annotations

from gpuserve.repository.state import Model, ModelVersion, Route, VersionState

#: How many previously served versions a model remembers for rollback.
HISTORY_LENGTH = 32


def desired_versions(model: Model, candidates: list[int]) -> set[int]:
    """The versions to have loaded: the version policy over ``candidates`` (loadable version
    folders) without the held back ones and the canary, plus the canary.

    Args:
        model: Its ``source_config`` (version policy), ``held`` and ``canary`` are used.
        candidates: Version numbers that may be loaded now.
    """
    assert model.source_config is not None
    canary = model.canary.version if model.canary is not None else None
    if canary not in candidates:
        canary = None
    base = [v for v in candidates if v != canary and v not in model.held]
    selected = set(model.source_config.version_policy.select(base))
    if canary is not None:
        selected.add(canary)
    return selected


def install_route(model: Model, *, forward: bool) -> None:
    """Compute the route from the READY versions and install it in one assignment.

    The default is the highest READY version that is neither held back nor the canary (a
    held back one only when nothing else is READY); the canary takes its weight when it is
    READY and declares the same tensors as the default. ``model.config`` follows the default.

    Args:
        forward: Record the previous default in ``model.history`` when the default changes
            (not for a rollback, which walks the history back).
    """
    ready = {v: mv for v, mv in model.versions.items() if mv.state is VersionState.READY}
    canary = ready.get(model.canary.version) if model.canary is not None else None
    others = [v for v in ready if canary is None or v != canary.version]
    eligible = [v for v in others if v not in model.held] or others
    default = ready[max(eligible)] if eligible else None
    if default is None and canary is not None:
        default, canary = canary, None
    if canary is not None and default is not None and not compatible(default, canary):
        model.warning = (
            f"canary version {canary.version} declares other inputs or outputs than "
            f"version {default.version}; it takes no traffic"
        )
        canary = None
    weight = model.canary.weight if canary is not None and model.canary is not None else 0.0
    old = model.route
    if old.default is default and old.canary is canary and old.weight == weight:
        return
    model.route = Route(default, canary, weight)
    model.config = default.config if default is not None else model.source_config
    before = old.default.version if old.default is not None else None
    after = default.version if default is not None else None
    if forward and before is not None and after is not None and before != after:
        model.history.append(before)
        del model.history[:-HISTORY_LENGTH]


def compatible(a: ModelVersion, b: ModelVersion) -> bool:
    """Whether one request fits both versions (same declared inputs and outputs), so traffic
    can be split between them."""
    return a.config.inputs == b.config.inputs and a.config.outputs == b.config.outputs
