"""The route decision: which READY version takes the requests that name no version, and the
canary's share of them (pure; see :class:`~gpuserve.repository.state.Route` for the route a
request reads, and :mod:`gpuserve.repository.lifecycle.planner` for the change that installs it).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from gpuserve.config import CanaryConfig, ModelConfig, TensorSpec

#: How many previously served versions a model remembers for rollback.
HISTORY_LENGTH = 32

#: The declared inputs and outputs of a version: a canary must match the default's to share
#: its traffic (one request has to fit both).
Signature = tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]


def signature(config: ModelConfig) -> Signature:
    """The declared inputs and outputs of ``config`` (compared with ``==``)."""
    return tuple(config.inputs), tuple(config.outputs)


@dataclass(frozen=True, slots=True)
class RoutePlan:
    """Where unversioned requests go (see :class:`~gpuserve.repository.state.Route`).

    Attributes:
        default: The served version, or None.
        canary: The canary taking ``weight`` of the requests, or None.
        weight: The canary's share, 0..1 (0.0 without a canary).
        warning: A warning to show on the model (a canary that cannot take traffic), or None
            (the model's warning stays as it is).
        history: The rollback history after the change, most recent last.
    """

    default: int | None = None
    canary: int | None = None
    weight: float = 0.0
    warning: str | None = None
    history: tuple[int, ...] = ()


def plan_route(
    ready: Mapping[int, Signature],
    *,
    held: Collection[int],
    canary: CanaryConfig | None,
    history: tuple[int, ...],
    before: int | None,
    forward: bool,
) -> RoutePlan:
    """The route over the READY versions.

    The default is the highest READY version that is neither held back nor the canary (a
    held back one only when nothing else is READY; the canary only when it is alone). The
    canary takes its weight when it is READY and declares the same tensors as the default.

    Args:
        ready: The READY versions with their declared tensors.
        held: The held back versions.
        canary: The canary in effect, or None.
        history: The rollback history, most recent last.
        before: The version served before, or None.
        forward: Record ``before`` in the history when the default changes (not for a
            rollback, which walks the history back).
    """
    config = canary
    number = config.version if config is not None and config.version in ready else None
    others = [v for v in ready if v != number]
    eligible = [v for v in others if v not in held] or others
    default = max(eligible) if eligible else None
    if default is None and number is not None:
        default, number = number, None
    warning = None
    if number is not None and default is not None and ready[number] != ready[default]:
        warning = (
            f"canary version {number} declares other inputs or outputs than "
            f"version {default}; it takes no traffic"
        )
        number = None
    if forward and before is not None and default is not None and before != default:
        history = (*history, before)[-HISTORY_LENGTH:]
    weight = config.weight if number is not None and config is not None else 0.0
    return RoutePlan(default, number, weight, warning, history)
