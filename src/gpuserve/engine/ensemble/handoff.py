"""The device hand-off of an ensemble: which step outputs stay ``torch.Tensor`` on their
device between steps, and the step inputs that must reach the host after all.

A step output is handed on as a tensor (no host round trip, no re-encoding) when its
producer's backend gives tensors (``Backend.gives_tensors``: the torch backend), every step
consuming it takes tensors (``Backend.takes_tensors``), producer and consumers all run on one
same single device, and it is not an ensemble output (clients get numpy arrays). Its step
request then names it in ``keep_tensors`` (a field of every request, empty for clients'); the
producing instance returns it as a tensor and batch assembly concatenates it for the consumer
with ``torch.cat`` on the device. Every other output is moved to the host once, by the
producing instance.

The decision (:func:`kept_outputs`, pure) is taken per request from where the step models run
now (:func:`placement_of`), and cached while the step schedulers stay the same
(:class:`HandoffDecision`). If a consumer changed between its producer's run and its own (a
version swapped to another backend), :func:`host_inputs` moves the tensors it cannot take to
the host, on the event loop: correct, and rare.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gpuserve.backends import tensors as _tensors
from gpuserve.engine.ensemble.plan import EnsemblePlan
from gpuserve.engine.runners.base import VersionRunner
from gpuserve.engine.stats import StepStats


@dataclass(frozen=True, slots=True)
class StepPlacement:
    """Where a step model runs now, as the device hand-off needs to know it.

    Attributes:
        gives_tensors: Every instance's backend can return its outputs as device tensors.
        takes_tensors: Every instance's backend takes tensor inputs, and the model does not
            pad its inputs (padding works on numpy arrays).
        devices: The devices of its instances (``"cpu"``, ``"cuda:0"``); empty for a step
            with no instance (an ensemble, a step that is not loaded).
    """

    gives_tensors: bool = False
    takes_tensors: bool = False
    devices: frozenset[str] = frozenset()


def kept_outputs(
    plan: EnsemblePlan, placements: Sequence[StepPlacement | None]
) -> tuple[frozenset[str], ...]:
    """Per step, the names of its outputs that are handed on as device tensors.

    A step output is kept as a tensor when the producing step gives tensors, its ensemble
    tensor is not an ensemble output, at least one step consumes it, every consuming step
    takes tensors, and producer and consumers all run on one same single device.

    Args:
        plan: The ensemble's plan.
        placements: Per step, by index, its :class:`StepPlacement` (None: unknown, e.g. a step
            that loads on demand; nothing it gives or takes is kept).

    Returns:
        Per step, the step model's output names (not ensemble tensor names) to keep.
    """
    consumers: dict[str, list[int]] = {}
    for step in plan.steps:
        for _, tensor in step.inputs:
            consumers.setdefault(tensor, []).append(step.index)
    final = set(plan.outputs)
    kept: list[frozenset[str]] = []
    for step in plan.steps:
        producer = placements[step.index]
        if producer is None or not producer.gives_tensors or len(producer.devices) != 1:
            kept.append(frozenset())
            continue
        names = []
        for name, tensor in step.outputs:
            users = consumers.get(tensor, [])
            if tensor in final or not users:
                continue
            if all(_takes_on(placements[u], producer.devices) for u in users):
                names.append(name)
        kept.append(frozenset(names))
    return tuple(kept)


def _takes_on(consumer: StepPlacement | None, devices: frozenset[str]) -> bool:
    return consumer is not None and consumer.takes_tensors and consumer.devices == devices


def placement_of(runner: VersionRunner | None) -> StepPlacement | None:
    """Where the step model behind ``runner`` runs now (None for None: not known).

    A runner without instances (an ensemble used as a step) neither gives nor takes tensors;
    neither does a model that pads its inputs (padding works on numpy arrays).
    """
    if runner is None:
        return None
    if not runner.instances:
        return StepPlacement()
    capabilities = runner.capabilities
    return StepPlacement(
        gives_tensors=not runner.pads and capabilities.gives_tensors,
        takes_tensors=not runner.pads and capabilities.takes_tensors,
        devices=runner.devices,
    )


class HandoffDecision:
    """:func:`kept_outputs` of one ensemble, taken again only when a step model's scheduler
    changed (a swap, a load). The schedulers are held weakly: an unloaded version is not kept
    alive by the cache.

    Args:
        plan: The ensemble's plan.
    """

    def __init__(self, plan: EnsemblePlan) -> None:
        self.plan = plan
        self._refs: tuple[Callable[[], object] | None, ...] = ()
        self._keep: tuple[frozenset[str], ...] = ()

    def keep(self, schedulers: Sequence[VersionRunner | None]) -> tuple[frozenset[str], ...]:
        """Per step, the step outputs to keep as tensors, given each step's scheduler now
        (None: not served, or loads on demand)."""
        refs = self._refs
        if len(refs) == len(schedulers) and all(
            (ref() if ref is not None else None) is s
            for ref, s in zip(refs, schedulers, strict=True)
        ):
            return self._keep
        keep = kept_outputs(self.plan, [placement_of(s) for s in schedulers])
        self._refs = tuple(None if s is None else weakref.ref(s) for s in schedulers)
        self._keep = keep
        return keep


def host_inputs(
    plan: EnsemblePlan,
    index: int,
    inputs: dict[str, Any],
    tensors: dict[str, Any],
    scheduler: VersionRunner,
    stats: StepStats,
) -> dict[str, Any]:
    """Step ``index``'s ``inputs`` (by step input name) as its model can take them now.

    A tensor input stays a tensor when the model takes tensors (counted in
    ``stats.tensor_inputs``); otherwise it is moved to the host and the host copy replaces
    the tensor in the run's ``tensors`` (by ensemble tensor name), so a tensor is moved once
    per run (counted in ``stats.host_copies``).
    """
    handed = [(n, t) for n, t in plan.steps[index].inputs if _tensors.is_tensor(inputs.get(n))]
    if not handed:
        return inputs
    placement = placement_of(scheduler)
    if placement is not None and placement.takes_tensors:
        stats.tensor_inputs += len(handed)
        return inputs
    for name, tensor in handed:
        host = tensors[tensor] = _tensors.to_host(tensors[tensor])
        inputs[name] = host
        stats.host_copies += 1
    return inputs
