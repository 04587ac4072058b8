"""The ``sequence_batching`` section of a model's configuration: stateful models.

A model with this section is served by the sequence batcher
(:mod:`gpuserve.engine.sequence.batcher`) instead of the dynamic batcher. Names follow Triton's
``sequence_batching`` message; times carry their unit in the name, as in the rest of
``config.yaml`` (Triton's ``max_sequence_idle_microseconds`` is ``max_sequence_idle_us``)::

    sequence_batching:
      max_sequence_idle_us: 5000000          # a sequence idle this long is released
      oldest:                                # or direct: {} (the default strategy)
        max_candidate_sequences: 64          # live sequences per instance
        preferred_batch_sizes: [8]
        max_queue_delay_us: 1000
      control_inputs:                        # tensors the server fills in per row
        - {name: START, kind: start, datatype: INT32, false_true: [0, 1]}
        - {name: READY, kind: ready}
        - {name: CORRID, kind: corrid, datatype: UINT64}
      states:                                # implicit state, kept by the server
        - {input_name: SUM_IN, output_name: SUM_OUT, datatype: FP32, shape: [1]}

Control inputs and states are not declared under ``inputs``/``outputs``: clients never send
them; the model receives them like any input (batch dimension first, one row per sequence;
with ``direct``, one row per slot) and returns each state's ``output_name`` like any output
(it is kept, not sent back).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpuserve.config.base import check_dims
from gpuserve.datatypes import Datatype

if TYPE_CHECKING:
    from gpuserve.config.model import ModelConfig

__all__ = [
    "ControlInput",
    "ControlKind",
    "DirectStrategy",
    "OldestStrategy",
    "SequenceBatchingConfig",
    "StateSpec",
    "sequence_problem",
]

#: What a control input carries: the sequence starts / ends in this request, the row holds a
#: request, the sequence's correlation id.
ControlKind = Literal["start", "end", "ready", "corrid"]

#: Datatypes of a START/END/READY control (Triton's int32/fp32/bool ``_false_true``).
FLAG_DATATYPES: tuple[str, ...] = ("INT32", "FP32", "BOOL")
#: Datatypes of a CORRID control (Triton's ``data_type``; BYTES for string ids).
CORRID_DATATYPES: tuple[str, ...] = ("UINT64", "INT64", "UINT32", "INT32", "BYTES")


class _Section(BaseModel):
    """Unknown keys are errors (as in every config section)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ControlInput(_Section):
    """One control tensor the server fills in for each row (Triton's ``control_input``).

    Attributes:
        name: The input name the model reads.
        kind: ``start``, ``end``, ``ready`` or ``corrid``.
        datatype: ``INT32``, ``FP32`` or ``BOOL`` for a flag (default ``INT32``);
            ``UINT64`` (default), ``INT64``, ``UINT32``, ``INT32`` or ``BYTES`` for ``corrid``.
        false_true: Flags only: the values meaning false and true (default ``[0, 1]``).
    """

    name: str = Field(min_length=1)
    kind: ControlKind
    datatype: Datatype | None = None
    false_true: list[float] | None = None

    @model_validator(mode="after")
    def _check(self) -> ControlInput:
        if self.kind == "corrid":
            if self.datatype is not None and self.datatype not in CORRID_DATATYPES:
                raise ValueError(
                    f"control input {self.name!r} (corrid): datatype must be one of "
                    f"{', '.join(CORRID_DATATYPES)}, got {self.datatype}"
                )
            if self.false_true is not None:
                raise ValueError(f"control input {self.name!r} (corrid) takes no false_true")
            return self
        if self.datatype is not None and self.datatype not in FLAG_DATATYPES:
            raise ValueError(
                f"control input {self.name!r} ({self.kind}): datatype must be one of "
                f"{', '.join(FLAG_DATATYPES)}, got {self.datatype}"
            )
        if self.false_true is not None and len(self.false_true) != 2:
            raise ValueError(
                f"control input {self.name!r}: false_true must be two values [false, true], "
                f"got {self.false_true}"
            )
        return self

    @property
    def dtype_name(self) -> str:
        """The datatype, defaults applied (``UINT64`` for corrid, else ``INT32``)."""
        if self.datatype is not None:
            return self.datatype
        return "UINT64" if self.kind == "corrid" else "INT32"

    @property
    def values(self) -> tuple[float, float]:
        """(false, true) of a flag, defaults applied."""
        pair = self.false_true or [0, 1]
        return pair[0], pair[1]


class StateSpec(_Section):
    """One implicit state tensor (Triton's ``state``): the server feeds the model the value
    the model returned for the previous request of the same sequence.

    Attributes:
        input_name: The input the model reads the state from.
        output_name: The output the model writes the new state to (not sent to clients).
        datatype: The state's datatype (not BYTES).
        shape: Its shape without the batch dimension; ``-1`` for a dimension that may grow.
        initial_shape: Shape of the zeros given at the START of a sequence; default
            ``shape`` with every ``-1`` as 0 (an empty state that grows).
    """

    input_name: str = Field(min_length=1)
    output_name: str = Field(min_length=1)
    datatype: Datatype
    shape: list[int]
    initial_shape: list[int] | None = None

    @field_validator("shape")
    @classmethod
    def _dims(cls, shape: list[int]) -> list[int]:
        return check_dims(shape)

    @model_validator(mode="after")
    def _check(self) -> StateSpec:
        if self.datatype == "BYTES":
            raise ValueError(f"state {self.input_name!r}: BYTES states are not supported")
        initial = self.initial_shape
        if initial is not None and (
            len(initial) != len(self.shape)
            or any(d < 0 or s not in (-1, d) for d, s in zip(initial, self.shape, strict=True))
        ):
            raise ValueError(
                f"state {self.input_name!r}: initial_shape {initial} does not fit shape "
                f"{self.shape}"
            )
        return self

    @property
    def start_shape(self) -> tuple[int, ...]:
        """The shape of the zeros a sequence starts with (no batch dimension)."""
        if self.initial_shape is not None:
            return tuple(self.initial_shape)
        return tuple(0 if dim == -1 else dim for dim in self.shape)


class DirectStrategy(_Section):
    """Triton's ``direct`` strategy: each instance has ``max_batch_size`` slots (one if the
    model does not batch); a sequence holds one slot for its life, and a batch is laid out by
    slot: row ``i`` is slot ``i``, up to the highest slot with a request waiting, a slot with
    none being a filler row with READY false (see :mod:`gpuserve.engine.sequence.layout`).

    Attributes:
        max_queue_delay_us: Longest a ready slot waits for other slots to fill, microseconds.
        minimum_slot_utilization: Send without waiting once this share of the instance's
            slots (0..1) have a request.
    """

    max_queue_delay_us: int = Field(default=0, ge=0, le=60_000_000)
    minimum_slot_utilization: float = Field(default=0.0, ge=0.0, le=1.0)


class OldestStrategy(_Section):
    """Triton's ``oldest`` strategy: each instance takes up to ``max_candidate_sequences``
    live sequences; a batch takes the oldest waiting request of up to ``max_batch_size`` of
    them (one request per sequence).

    Attributes:
        max_candidate_sequences: Live sequences per instance; a new one waits for room.
        preferred_batch_sizes: Batch sizes sent without waiting out the delay.
        max_queue_delay_us: Longest the oldest waiting request waits for company, microseconds.
    """

    max_candidate_sequences: int = Field(default=64, ge=1, le=1_000_000)
    preferred_batch_sizes: list[int] = Field(default_factory=list)
    max_queue_delay_us: int = Field(default=0, ge=0, le=60_000_000)

    @field_validator("preferred_batch_sizes")
    @classmethod
    def _sizes(cls, sizes: list[int]) -> list[int]:
        for size in sizes:
            if size < 1:
                raise ValueError(f"preferred_batch_sizes must be >= 1, got {size}")
        return sizes


class SequenceBatchingConfig(_Section):
    """Serve a stateful model: requests carry a sequence id (request parameters
    ``sequence_id``, ``sequence_start``, ``sequence_end``, as Triton's clients send them).

    Attributes:
        max_sequence_idle_us: A live sequence with no request for this long is released (its
            slot and state dropped), microseconds; its next request without START is refused.
        direct / oldest: The strategy; set at most one (none: ``direct``).
        control_inputs: Tensors the server fills in per row (see :class:`ControlInput`).
        states: Implicit state tensors kept by the server (see :class:`StateSpec`).
        max_queue_size: Most requests waiting (all sequences together); one more gets 429.
        max_batch_tokens: Most padded tokens (rows x the longest row's tokens) in one batch
            of a model whose requests carry a cost (an admission step measures them), as
            ``dynamic_batching.max_batch_tokens``; the oldest sequence always runs. None
            (default): 512 when every instance is on a CPU, 16384 when one is on a GPU.
    """

    max_sequence_idle_us: int = Field(default=1_000_000, ge=1, le=86_400_000_000)
    direct: DirectStrategy | None = None
    oldest: OldestStrategy | None = None
    control_inputs: list[ControlInput] = Field(default_factory=list)
    states: list[StateSpec] = Field(default_factory=list)
    max_queue_size: int = Field(default=1024, ge=1)
    max_batch_tokens: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _check(self) -> SequenceBatchingConfig:
        if self.direct is not None and self.oldest is not None:
            raise ValueError("set one strategy, direct or oldest, not both")
        names = [c.name for c in self.control_inputs] + [s.input_name for s in self.states]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"control and state input names must be unique; repeated: {repeated}")
        kinds = [c.kind for c in self.control_inputs]
        twice = sorted({k for k in kinds if kinds.count(k) > 1})
        if twice:
            raise ValueError(f"one control input per kind; repeated kinds: {twice}")
        outputs = [s.output_name for s in self.states]
        again = sorted({n for n in outputs if outputs.count(n) > 1})
        if again:
            raise ValueError(f"state output names must be unique; repeated: {again}")
        return self

    @property
    def strategy(self) -> Literal["direct", "oldest"]:
        """``oldest`` when that section is set, else ``direct``."""
        return "oldest" if self.oldest is not None else "direct"


def sequence_problem(config: ModelConfig) -> str | None:
    """What is wrong with ``config.sequence_batching`` given the model's other fields, or
    None: control and state inputs must not be declared inputs, state outputs must not be
    declared outputs, preferred sizes fit ``max_batch_size``, and ``dynamic_batching`` is not
    set as well (Triton refuses both)."""
    seq = config.sequence_batching
    if seq is None:
        return None
    where = "sequence_batching"
    if "dynamic_batching" in config.model_fields_set:
        return (
            f"{where}: a model takes dynamic_batching or sequence_batching, not both "
            "(remove dynamic_batching)"
        )
    declared = {t.name for t in config.inputs}
    for name in [c.name for c in seq.control_inputs] + [s.input_name for s in seq.states]:
        if name in declared:
            return (
                f"{where}: {name!r} is also a declared input; control and state inputs are "
                "filled by the server and must not be listed under inputs"
            )
    outputs = {t.name for t in config.outputs}
    for state in seq.states:
        if state.output_name in outputs:
            return (
                f"{where}.states: output {state.output_name!r} is also a declared output; a "
                "state output is kept by the server and must not be listed under outputs"
            )
    if seq.oldest is not None and config.max_batch_size:
        for size in seq.oldest.preferred_batch_sizes:
            if size > config.max_batch_size:
                return (
                    f"{where}.oldest: preferred_batch_sizes entry {size} exceeds "
                    f"max_batch_size={config.max_batch_size}"
                )
    return None
