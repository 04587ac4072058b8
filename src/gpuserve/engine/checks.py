"""The checks of a request against its model's configuration: one function, and so one error
message, per mistake, whichever path the request came by and whichever runner serves it.

* :func:`output_spec`: a requested output the model does not declare;
* :func:`priority_level`: a priority that is not a level of the model;
* :func:`check_input_shape` / :func:`batch_of`: an input whose shape is not the declared one
  (rank, dimensions, batch dimension 1..``max_batch_size``), inputs that disagree on the batch
  dimension.

Every entry of :class:`~gpuserve.engine.runners.base.VersionRunner` (a client's request through
the service, an ensemble step, a model's call) runs its :class:`RequestChecks` first, so a
decoupled model, a sequence model and an ensemble answer as a batching one does. The wire
codecs (:mod:`gpuserve.protocol`) call the same functions while they decode, before they
build the arrays (a shape is checked before the data it sizes is read); the runner's check of
a request they built then finds nothing and costs a few comparisons.

A model's outputs are checked against its configuration by
:func:`gpuserve.engine.assembly.check_outputs` on every runner (an ensemble's own outputs too).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gpuserve.config import ModelConfig, TensorSpec
from gpuserve.errors import InvalidInputError


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _declared(spec: TensorSpec, max_batch_size: int) -> str:
    """The full shape a request must send, ``-1`` for free dimensions (``[-1, 128]``)."""
    return _shape_text([-1, *spec.shape] if max_batch_size > 0 else spec.shape)


def output_spec(config: ModelConfig, model: str, name: str) -> TensorSpec:
    """The declared output ``name`` of ``model`` (configured by ``config``).

    Raises:
        InvalidInputError: ``model`` declares no such output (400, naming its outputs).
    """
    for spec in config.outputs:
        if spec.name == name:
            return spec
    outputs = ", ".join(repr(spec.name) for spec in config.outputs)
    raise InvalidInputError(
        f"output {name!r} is not an output of model {model!r}; its outputs are {outputs}"
    )


def check_requested_outputs(config: ModelConfig, model: str, names: Iterable[str]) -> None:
    """Every name in ``names`` is a declared output (:func:`output_spec`)."""
    declared = config.outputs
    for name in names:
        for spec in declared:
            if spec.name == name:
                break
        else:
            output_spec(config, model, name)


def priority_level(config: ModelConfig, model: str, priority: int) -> int:
    """The queue level of a request's ``priority`` (0: the model's default level).

    Raises:
        InvalidInputError: ``priority`` is above the model's ``priority_levels``.
    """
    db = config.dynamic_batching
    level = priority or db.default_priority_level
    if level > db.priority_levels:
        raise InvalidInputError(
            f"parameter 'priority': {level} is not a level of model {model!r} "
            f"(1..{db.priority_levels}, 1 = highest)"
        )
    return level


def check_input_shape(
    spec: TensorSpec, name: str, shape: Sequence[int], max_batch_size: int
) -> None:
    """``shape`` (non-negative integers, batch dimension first when the model batches) is
    what ``spec`` declares: as many dimensions, each declared one (``-1``: any), a batch
    dimension of 1..``max_batch_size``.

    Raises:
        InvalidInputError: naming the input, the shape received and the declared one.
    """
    dims = spec.shape
    batched = max_batch_size > 0
    if len(shape) != len(dims) + batched:
        batch_note = f" (the first dimension is the batch, 1..{max_batch_size})" if batched else ""
        raise InvalidInputError(
            f"input {name!r}: shape {_shape_text(shape)} has {len(shape)} dimensions but "
            f"the model expects {len(dims) + batched}: "
            f"{_declared(spec, max_batch_size)}{batch_note}"
        )
    if batched:
        batch = shape[0]
        if batch == 0:
            raise InvalidInputError(
                f"input {name!r}: shape {_shape_text(shape)}: batch dimension 0 is not "
                f"allowed (must be 1..max_batch_size, here 1..{max_batch_size})"
            )
        if batch > max_batch_size:
            raise InvalidInputError(
                f"input {name!r}: shape {_shape_text(shape)}: batch dimension {batch} "
                f"exceeds max_batch_size {max_batch_size}"
            )
    for index, want in enumerate(dims, start=batched):
        if want != -1 and shape[index] != want:
            raise InvalidInputError(
                f"input {name!r}: shape {_shape_text(shape)} does not match the model's "
                f"{_declared(spec, max_batch_size)}: dimension {index} is "
                f"{shape[index]}, expected {want}"
            )


def batch_of(shapes: Mapping[str, Sequence[int]]) -> int | None:
    """The batch dimension the inputs of one request share (of a batching model), or None
    for a request without inputs.

    Raises:
        InvalidInputError: the inputs disagree on it.
    """
    batch = None
    for shape in shapes.values():
        if batch is None:
            batch = shape[0]
        elif shape[0] != batch:
            listing = ", ".join(f"{name!r} has {dims[0]}" for name, dims in shapes.items())
            raise InvalidInputError(
                f"inputs disagree on the batch dimension ({listing}); every input of one "
                f"request must have the same batch size"
            )
    return batch


class RequestChecks:
    """The checks every runner applies to a request on entry (module docstring), made once
    per version from its config: its priority, its requested outputs and the shapes of the
    inputs it carries (names, datatypes and missing inputs are the caller's to check: the
    codecs', a model call's). A request that passes costs a few comparisons per input; the
    first problem found is reported by the functions above (their messages).

    Args:
        config: The configuration of the version the requests run on.
        model: The model's name, for messages.
    """

    __slots__ = ("_fixed", "_levels", "_max_batch_size", "_outputs", "config", "model")

    def __init__(self, config: ModelConfig, model: str) -> None:
        self.config = config
        self.model = model
        self._levels = config.dynamic_batching.priority_levels
        self._outputs = frozenset(spec.name for spec in config.outputs)
        self._max_batch_size = config.max_batch_size
        batched = config.max_batch_size > 0
        #: Input name -> (its spec, its rank, (index, size) of each dimension it fixes).
        self._fixed: dict[str, tuple[TensorSpec, int, tuple[tuple[int, int], ...]]] = {
            spec.name: (
                spec,
                len(spec.shape) + batched,
                tuple(
                    (index, want)
                    for index, want in enumerate(spec.shape, start=batched)
                    if want != -1
                ),
            )
            for spec in config.inputs
        }

    def check(
        self,
        inputs: Mapping[str, Any],
        requested_outputs: Sequence[str] | None,
        priority: int,
    ) -> None:
        """Check one request.

        Args:
            inputs: Input name -> array (numpy or tensor: anything with ``shape``).
            requested_outputs: The outputs asked for, or None for all.
            priority: The request's priority (0: the default level, always one).

        Raises:
            InvalidInputError: the first problem found (400).
        """
        if priority > self._levels:
            priority_level(self.config, self.model, priority)
        if requested_outputs is not None:
            outputs = self._outputs
            for name in requested_outputs:
                if name not in outputs:
                    output_spec(self.config, self.model, name)
        max_batch_size = self._max_batch_size
        batch = -1
        disagree = False
        for name, array in inputs.items():
            entry = self._fixed.get(name)
            if entry is None:
                continue
            spec, rank, fixed = entry
            shape = array.shape
            wrong = len(shape) != rank
            if not wrong:
                for index, want in fixed:
                    if shape[index] != want:
                        wrong = True
                        break
            if not wrong and max_batch_size > 0:
                rows = shape[0]
                wrong = not 0 < rows <= max_batch_size
                if batch < 0:
                    batch = rows
                elif rows != batch:
                    disagree = True
            if wrong:
                check_input_shape(spec, name, tuple(shape), max_batch_size)
        if disagree:  # after every input's own shape, as the codecs check them
            batch_of({key: tuple(value.shape) for key, value in inputs.items()})


def check_request(
    config: ModelConfig,
    model: str,
    inputs: Mapping[str, Any],
    requested_outputs: Sequence[str] | None,
    priority: int,
) -> None:
    """:meth:`RequestChecks.check` of one request (a runner keeps its :class:`RequestChecks`).

    Raises:
        InvalidInputError: the first problem found (400).
    """
    RequestChecks(config, model).check(inputs, requested_outputs, priority)


__all__ = [
    "RequestChecks",
    "batch_of",
    "check_input_shape",
    "check_request",
    "check_requested_outputs",
    "output_spec",
    "priority_level",
]
