"""Routing settings of the rollback and canary commands, as pure functions.

Each command changes a model's :class:`~gpuserve.repository.lifecycle.planner.Settings` (held back
versions, canary, rollback history) and then runs one change (the reconcile of
:mod:`gpuserve.repository.lifecycle.planner`) that must end with the version it names serving;
otherwise the settings it started from come back. Holds keep the version policy from serving
a version it would otherwise pick (the newest) until the model is loaded explicitly, a canary
of it is promoted, or its folder changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import ValidationError

from gpuserve.config import CanaryConfig
from gpuserve.errors import ConfigError, InvalidInputError, ModelNotFoundError
from gpuserve.repository.lifecycle.planner import Settings
from gpuserve.repository.scan import VersionFolder


def canary_config(name: str, version: int, weight: float) -> CanaryConfig:
    """The canary a command asks for: ``weight`` (0..1) of the unversioned requests of model
    ``name`` to ``version``.

    Raises:
        InvalidInputError: a version below 1 or a weight outside 0..1 (the message names the
            field, the rule and the value given).
    """
    try:
        return CanaryConfig(version=version, weight=weight)
    except ValidationError as err:
        problem = err.errors()[0]
        field = ".".join(str(part) for part in problem["loc"])
        raise InvalidInputError(
            f"canary for model '{name}': field '{field}': {problem['msg']} "
            f"(given: {problem.get('input')!r})"
        ) from None


def current_canary(name: str, canary: CanaryConfig | None) -> int:
    """The canary version of model ``name``.

    Raises:
        InvalidInputError: it has no canary.
    """
    if canary is None:
        raise InvalidInputError(f"model '{name}' has no canary")
    return canary.version


@dataclass(frozen=True, slots=True)
class Rollback:
    """A rollback (:func:`plan_rollback`).

    Attributes:
        target: The version to serve again.
        settings: The routing settings to change with.
    """

    target: int
    settings: Settings


def plan_rollback(
    name: str, current: int, settings: Settings, folders: Mapping[int, VersionFolder]
) -> Rollback:
    """Roll back from ``current`` to the previously served version.

    The target is the most recent history entry that is loadable and not ``current`` (the
    history is walked back to it); with no such entry, the highest loadable version below
    ``current``. Every version folder above the target is held back, the target is not, and
    the canary ends.

    Args:
        name: The model (error messages).
        current: The version served now.
        settings: The routing settings now.
        folders: The version folders by number.

    Raises:
        InvalidInputError: there is no version to roll back to.
    """
    loadable = [v for v, folder in sorted(folders.items()) if folder.problem is None]
    history = list(settings.history)
    target = None
    while history:
        candidate = history.pop()
        if candidate != current and candidate in loadable:
            target = candidate
            break
    if target is None:
        earlier = [v for v in loadable if v < current]
        if not earlier:
            raise InvalidInputError(
                f"model '{name}' has no version to roll back to from version {current} "
                f"(version folders: {sorted(folders)})"
            )
        target = earlier[-1]
    held = dict(settings.held)
    held.update((v, folder.fingerprint) for v, folder in folders.items() if v > target)
    held.pop(target, None)
    return Rollback(target, Settings(held, None, tuple(history)))


def plan_canary(
    name: str,
    canary: CanaryConfig,
    served: int | None,
    settings: Settings,
    folders: Mapping[int, VersionFolder],
) -> Settings:
    """Make ``canary`` the model's canary; it is no longer held back.

    Args:
        name: The model (error messages).
        canary: The canary version and its weight.
        served: The version served now, or None.
        settings: The routing settings now.
        folders: The version folders by number (the canary's read now).

    Raises:
        ModelNotFoundError: no such version folder.
        ConfigError: its folder cannot be loaded (incomplete, empty, links outside).
        InvalidInputError: the version is the default one.
    """
    folder = folders.get(canary.version)
    if folder is None:
        raise ModelNotFoundError(
            f"model '{name}' has no version folder {canary.version} (versions: {sorted(folders)})"
        )
    if folder.problem is not None:
        raise ConfigError(f"model '{name}': {folder.problem}")
    if served == canary.version:
        raise InvalidInputError(
            f"model '{name}' version {canary.version} is already the default version"
        )
    held = {v: prints for v, prints in settings.held.items() if v != canary.version}
    return Settings(held, canary, settings.history)


def plan_promote(canary: int, settings: Settings, folders: Mapping[int, VersionFolder]) -> Settings:
    """Make the canary the default: it is no longer held back, every loadable version above
    it is, and the canary ends.

    Args:
        canary: The canary version.
        settings: The routing settings now.
        folders: The version folders by number.
    """
    held = {v: prints for v, prints in settings.held.items() if v != canary}
    held.update(
        (v, folder.fingerprint)
        for v, folder in folders.items()
        if v > canary and folder.problem is None
    )
    return Settings(held, None, settings.history)


def plan_abort(
    canary: int, served: int | None, settings: Settings, folders: Mapping[int, VersionFolder]
) -> Settings:
    """End the canary. A canary above the served version is held back (so the policy, which
    would pick it as the newest, does not serve it instead).

    Args:
        canary: The canary version.
        served: The version served now, or None.
        settings: The routing settings now.
        folders: The version folders by number.
    """
    held = dict(settings.held)
    if served is not None and canary > served and canary in folders:
        held[canary] = folders[canary].fingerprint
    return Settings(held, None, settings.history)
