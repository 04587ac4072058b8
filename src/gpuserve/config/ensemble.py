"""The ``ensemble`` section of a model's ``config.yaml``: a DAG of models run in the server.

An ensemble model (``backend: ensemble``) declares its own ``inputs`` and ``outputs`` like any
model, and ``ensemble.steps``: each step names a model of the repository and maps that model's
tensors onto the ensemble's tensors (Triton's ``ensemble_scheduling`` names)::

    backend: ensemble
    max_batch_size: 64
    inputs:  [{name: TEXT, datatype: BYTES, shape: [1]}]
    outputs: [{name: EMBEDDING, datatype: FP32, shape: [384]}]
    ensemble:
      steps:
        - model_name: tokenizer
          input_map: {TEXT: TEXT}                 # step input  <- ensemble tensor
          output_map: {INPUT_IDS: ids, ATTENTION_MASK: mask}   # step output -> tensor
        - model_name: encoder
          input_map: {INPUT_IDS: ids, ATTENTION_MASK: mask}
          output_map: {TOKEN_EMBEDDINGS: tokens}
        - model_name: pooling
          input_map: {TOKEN_EMBEDDINGS: tokens, ATTENTION_MASK: mask}
          output_map: {EMBEDDING: EMBEDDING}

:func:`graph_problem` checks the graph alone, when the config is read: every tensor has one
producer (an ensemble input or one step output), every step input is produced, every ensemble
output is produced and every ensemble input consumed, and the steps form a DAG. What needs the
step models' own configurations (the names in the maps, datatypes, shapes, batch sizes) is
checked when the ensemble loads (:mod:`gpuserve.engine.ensemble.plan`).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator


class EnsembleStep(BaseModel):
    """One step of an ensemble (Triton's ``ModelEnsembling.Step``).

    Attributes:
        model_name: The model of the repository that runs this step (any backend, or another
            ensemble).
        model_version: Its version; -1 (default) is the version it serves by default.
        input_map: Step model input name -> ensemble tensor name that feeds it.
        output_map: Step model output name -> ensemble tensor name it produces. Outputs of the
            step model not listed are not requested.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_name: str = Field(min_length=1)
    model_version: int = Field(default=-1, ge=-1)
    input_map: dict[str, str] = Field(min_length=1)
    output_map: dict[str, str] = Field(min_length=1)

    @field_validator("input_map", "output_map")
    @classmethod
    def _names(cls, mapping: dict[str, str]) -> dict[str, str]:
        for key, value in mapping.items():
            if not key or not value:
                raise ValueError(f"tensor names must not be empty, got {key!r}: {value!r}")
        return mapping

    @property
    def version_label(self) -> str | None:
        """The version as a request names it: None for the default version."""
        return None if self.model_version < 0 else str(self.model_version)


class EnsembleConfig(BaseModel):
    """The ``ensemble`` section (Triton's ``ensemble_scheduling``).

    Attributes:
        steps: The steps, in any order (they run as soon as their inputs exist).
        step_timeout_s: Longest one step may take (queue and run), seconds; the request fails
            naming the step after it. 0 = no limit beyond the step model's own queue timeout.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: list[EnsembleStep] = Field(min_length=1)
    step_timeout_s: float = Field(default=0.0, ge=0)


def step_label(index: int, step: EnsembleStep) -> str:
    """``ensemble.steps[i] (model 'name')``, how errors name a step."""
    return f"ensemble.steps[{index}] (model {step.model_name!r})"


def graph_problem(
    ensemble: EnsembleConfig, inputs: Sequence[str], outputs: Sequence[str]
) -> str | None:
    """What is wrong with the graph of ``ensemble`` for the ensemble's declared tensor names,
    or None when it is a valid DAG (see the module docstring)."""
    producer: dict[str, str] = {name: "ensemble input" for name in inputs}
    for index, step in enumerate(ensemble.steps):
        for out, tensor in step.output_map.items():
            if tensor in producer:
                return (
                    f"{step_label(index, step)}: output_map.{out}: tensor {tensor!r} is "
                    f"already produced by the {producer[tensor]}; each tensor needs one producer"
                )
            producer[tensor] = f"output {out!r} of {step_label(index, step)}"
    consumed: set[str] = set()
    for index, step in enumerate(ensemble.steps):
        for name, tensor in step.input_map.items():
            if tensor not in producer:
                known = sorted(producer)
                return (
                    f"{step_label(index, step)}: input_map.{name}: tensor {tensor!r} is "
                    f"produced by no step nor ensemble input (tensors: {known})"
                )
            consumed.add(tensor)
    for name in outputs:
        if name not in producer or producer[name] == "ensemble input":
            return f"output {name!r} is produced by no step's output_map"
    unused = [name for name in inputs if name not in consumed]
    if unused:
        return f"inputs {unused} are consumed by no step's input_map"
    cycle = _cycle(ensemble.steps)
    if cycle is not None:
        path = " -> ".join(step_label(i, ensemble.steps[i]) for i in cycle)
        return f"the steps form a cycle ({path}); they must form a DAG"
    return None


def dependencies(steps: Sequence[EnsembleStep]) -> list[frozenset[int]]:
    """Per step, the steps whose outputs it consumes (ensemble inputs need no step)."""
    made_by = {tensor: i for i, step in enumerate(steps) for tensor in step.output_map.values()}
    return [
        frozenset(made_by[t] for t in step.input_map.values() if t in made_by) for step in steps
    ]


def _cycle(steps: Sequence[EnsembleStep]) -> list[int] | None:
    """A cycle of step indices (first repeated at the end), or None for a DAG."""
    deps = dependencies(steps)
    state = [0] * len(steps)  # 0 unseen, 1 on the path, 2 done
    path: list[int] = []

    def visit(node: int) -> list[int] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(deps[node]):
            if state[dep] == 1:
                return [*path[path.index(dep) :], dep]
            if state[dep] == 0:
                found = visit(dep)
                if found is not None:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in range(len(steps)):
        if state[start] == 0:
            found = visit(start)
            if found is not None:
                return found
    return None
