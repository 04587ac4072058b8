"""Ensembles, the pure part: the plan of a step DAG, one request's run through it, and the
checks of an ensemble against its step models' configurations.

:class:`EnsemblePlan` is built once per loaded ensemble version from its ``ensemble`` section
(:mod:`gpuserve.config.ensemble` has already checked the graph). :class:`EnsembleRun` is one
request's progress: which steps may start (every tensor they consume exists), the tensors
produced so far, and the ensemble's outputs once every step is done. Nothing here waits or
touches a scheduler: :mod:`gpuserve.engine.runners.ensemble` drives it on the event loop.

Tensors are whatever the step models return, handed from step to step as they are: no copy,
no encoding; a step output stays a ``torch.Tensor`` on its device where
:mod:`gpuserve.engine.ensemble.handoff` says so. :func:`step_problems` runs at load, once the
steps' served configurations are known.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuserve.config import ModelConfig, TensorSpec
from gpuserve.config.ensemble import EnsembleConfig, dependencies, step_label


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step as the driver runs it.

    Attributes:
        index: Its index in ``ensemble.steps``.
        model: The step model's name.
        version: The version a step request names (None: the model's default version).
        inputs: ``(step input name, ensemble tensor name)`` pairs.
        outputs: ``(step output name, ensemble tensor name)`` pairs; the step requests only
            these outputs.
        needs: Indices of the steps whose outputs it consumes.
        label: How errors name it: ``ensemble.steps[i] (model 'name')``.
    """

    index: int
    model: str
    version: str | None
    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]
    needs: frozenset[int]
    label: str

    @property
    def requested_outputs(self) -> list[str]:
        """The step model's outputs to request."""
        return [name for name, _ in self.outputs]


@dataclass(frozen=True, slots=True)
class EnsemblePlan:
    """The DAG of one ensemble version.

    Attributes:
        name: The ensemble's name.
        steps: Every step, by index.
        dependents: Per step, the steps that consume one of its outputs.
        outputs: The ensemble's declared output names.
    """

    name: str
    steps: tuple[StepPlan, ...]
    dependents: tuple[tuple[int, ...], ...]
    outputs: tuple[str, ...]

    @classmethod
    def of(cls, config: ModelConfig) -> EnsemblePlan:
        """The plan of an ensemble ``config`` (``config.ensemble`` is set)."""
        assert config.ensemble is not None
        steps_cfg = config.ensemble.steps
        deps = dependencies(steps_cfg)
        steps = tuple(
            StepPlan(
                index=i,
                model=step.model_name,
                version=step.version_label,
                inputs=tuple(step.input_map.items()),
                outputs=tuple(step.output_map.items()),
                needs=deps[i],
                label=step_label(i, step),
            )
            for i, step in enumerate(steps_cfg)
        )
        dependents = tuple(
            tuple(j for j in range(len(steps)) if i in deps[j]) for i in range(len(steps))
        )
        return cls(config.name or "", steps, dependents, tuple(t.name for t in config.outputs))


@dataclass(slots=True, eq=False)
class EnsembleRun:
    """One request's progress through an :class:`EnsemblePlan` (pure state).

    Args:
        plan: The ensemble's plan.
        inputs: The request's inputs, by ensemble tensor name.

    Attributes:
        tensors: Every tensor that exists so far, by ensemble tensor name.
        waiting: Per step not started, how many of the steps it needs have not finished.
        running: Steps started and not finished.
        finished: Steps finished.
    """

    plan: EnsemblePlan
    tensors: dict[str, Any]
    waiting: dict[int, int] = field(default_factory=dict)
    running: set[int] = field(default_factory=set)
    finished: set[int] = field(default_factory=set)

    @classmethod
    def begin(cls, plan: EnsemblePlan, inputs: Mapping[str, Any]) -> EnsembleRun:
        """A run with ``inputs`` and no step started."""
        run = cls(plan, dict(inputs))
        run.waiting = {s.index: len(s.needs) for s in plan.steps}
        return run

    def start(self) -> list[int]:
        """The steps that may start now (they need no step); marks them running."""
        ready = [i for i, left in self.waiting.items() if left == 0]
        for i in ready:
            del self.waiting[i]
            self.running.add(i)
        return ready

    def step_inputs(self, index: int) -> dict[str, Any]:
        """The inputs of step ``index``'s request, by the step model's input names (an
        optional ensemble input the request omitted is left out)."""
        tensors = self.tensors
        return {name: tensors[t] for name, t in self.plan.steps[index].inputs if t in tensors}

    def complete(self, index: int, outputs: Mapping[str, Any]) -> list[int]:
        """Record step ``index``'s ``outputs`` (by the step model's output names); returns the
        steps that may start now, marked running.

        Raises:
            KeyError: ``outputs`` lacks an output of the step's ``output_map`` (the name).
        """
        step = self.plan.steps[index]
        for name, tensor in step.outputs:
            self.tensors[tensor] = outputs[name]
        self.running.discard(index)
        self.finished.add(index)
        ready = []
        for j in self.plan.dependents[index]:
            left = self.waiting.get(j)
            if left is None:
                continue
            if left == 1:
                del self.waiting[j]
                self.running.add(j)
                ready.append(j)
            else:
                self.waiting[j] = left - 1
        return ready

    @property
    def done(self) -> bool:
        """Whether every step has finished."""
        return len(self.finished) == len(self.plan.steps)

    def outputs(self, requested: list[str] | None) -> dict[str, Any]:
        """The ensemble's outputs (``requested`` ones, or every declared one)."""
        names = self.plan.outputs if requested is None else requested
        return {name: self.tensors[name] for name in names}


def _compatible(a: list[int], b: list[int]) -> bool:
    return len(a) == len(b) and all(x == y or -1 in (x, y) for x, y in zip(a, b, strict=True))


def step_problems(config: ModelConfig, steps: Mapping[int, ModelConfig]) -> list[str]:
    """What is wrong with ensemble ``config`` given its steps' served configurations.

    Checks that each map names real inputs/outputs of its step model, that every required
    input of a step model is mapped, that producer and consumer of each tensor agree on its
    datatype and (non-batch) shape, and that the steps batch when the ensemble does, with a
    ``max_batch_size`` at least the ensemble's.

    Args:
        config: The ensemble's configuration (``config.ensemble`` set).
        steps: Step index -> the configuration that step's model version is served with.

    Returns:
        One message per problem, each naming the step, the field and the values.
    """
    ensemble = config.ensemble
    assert isinstance(ensemble, EnsembleConfig)
    problems: list[str] = []
    spec_of: dict[str, tuple[TensorSpec, str]] = {
        t.name: (t, f"ensemble input {t.name!r}") for t in config.inputs
    }
    for i, step in enumerate(ensemble.steps):
        cfg = steps[i]
        label = step_label(i, step)
        outs = {t.name: t for t in cfg.outputs}
        for name, tensor in step.output_map.items():
            spec = outs.get(name)
            if spec is None:
                problems.append(
                    f"{label}: output_map.{name}: model {step.model_name!r} has no output "
                    f"{name!r} (outputs: {sorted(outs)})"
                )
                continue
            spec_of[tensor] = (spec, f"output {name!r} of {label}")
    for i, step in enumerate(ensemble.steps):
        cfg = steps[i]
        label = step_label(i, step)
        if config.max_batch_size and cfg.max_batch_size < config.max_batch_size:
            problems.append(
                f"{label}: model {step.model_name!r} has max_batch_size={cfg.max_batch_size}, "
                f"below the ensemble's max_batch_size={config.max_batch_size}"
            )
        if not config.max_batch_size and cfg.max_batch_size:
            problems.append(
                f"{label}: model {step.model_name!r} batches (max_batch_size="
                f"{cfg.max_batch_size}) but the ensemble does not (max_batch_size=0)"
            )
        if cfg.model_transaction_policy.decoupled:
            problems.append(
                f"{label}: model {step.model_name!r} is decoupled (several responses per "
                "request); an ensemble step must answer each request once"
            )
        if cfg.sequence_batching is not None:
            problems.append(
                f"{label}: model {step.model_name!r} uses sequence_batching; sequence models "
                "cannot be ensemble steps yet"
            )
        ins = {t.name: t for t in cfg.inputs}
        for name, tensor in step.input_map.items():
            spec = ins.get(name)
            if spec is None:
                problems.append(
                    f"{label}: input_map.{name}: model {step.model_name!r} has no input "
                    f"{name!r} (inputs: {sorted(ins)})"
                )
                continue
            problems.extend(_agree(spec_of.get(tensor), spec, f"{label}: input_map.{name}"))
            source = spec_of.get(tensor)
            if source is not None and source[0].optional and not spec.optional:
                problems.append(
                    f"{label}: input_map.{name}: required input of {step.model_name!r} is fed "
                    f"by the optional {source[1]}"
                )
        missing = [n for n, t in ins.items() if not t.optional and n not in step.input_map]
        if missing:
            problems.append(
                f"{label}: input_map: required input(s) {missing} of model "
                f"{step.model_name!r} are not mapped"
            )
    for out in config.outputs:
        problems.extend(_agree(spec_of.get(out.name), out, f"ensemble output {out.name!r}"))
    return problems


def _agree(source: tuple[TensorSpec, str] | None, consumer: TensorSpec, where: str) -> list[str]:
    if source is None:  # its producer's map entry is already reported
        return []
    spec, what = source
    if spec.datatype != consumer.datatype:
        return [f"{where}: {what} is {spec.datatype}, but {consumer.datatype} is expected"]
    if not _compatible(spec.shape, consumer.shape):
        return [f"{where}: {what} has shape {spec.shape}, but {consumer.shape} is expected"]
    return []
