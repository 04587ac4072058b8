"""The ``model_warmup`` section of a model's configuration: requests run before it serves.

Triton's ``model_warmup`` with the same field names, in ``config.yaml`` or ``config.pbtxt``::

    model_warmup:
      - name: zeros                 # named in logs and in a failed load's error
        batch_size: 4               # rows (<= max_batch_size); 1 for max_batch_size 0;
                                    # 0 skips the sample (as Triton does)
        count: 2                    # runs of this sample (0 or 1: once)
        inputs:
          INPUT0: {data_type: FP32, dims: [16], zero_data: true}
          INPUT1: {data_type: INT32, dims: [16], random_data: true}
          TEXT: {data_type: BYTES, dims: [1], input_data_file: text.bin}   # <model>/warmup/

Before a version turns READY each instance runs every sample ``count`` times (at least once)
through its real execution path (preprocess, forward, postprocess), after the backend's own
per-bucket warm-up (a decoupled model: each request alone through its stream, until its final
response); outputs are discarded, and a failing sample fails the load with the sample named
(see :mod:`gpuserve.engine.warmup_samples`). Ensembles take no samples (as in Triton), nor,
yet, sequence-batched models. ``dims`` exclude the batch dimension of a batching model and
are the full shape for ``max_batch_size: 0``; a sample's input holds one row, repeated
``batch_size`` times.

Data: ``zero_data`` zeros (empty strings for BYTES); ``random_data`` random values of the
datatype (BYTES: empty strings, as Triton falls back to zero data for strings);
``input_data_file`` a file of the model's ``warmup/`` folder holding one row's raw values in
row-major order (little-endian; BYTES as a 4-byte little-endian length before each element's
bytes). ``data_type`` takes the V2 name (``FP32``) or Triton's (``TYPE_FP32``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import Field, field_validator, model_validator

from gpuserve.config.base import Strict
from gpuserve.datatypes import Datatype

if TYPE_CHECKING:
    from gpuserve.config.model import ModelConfig, TensorSpec

__all__ = [
    "WARMUP_FOLDER",
    "WarmupInput",
    "WarmupSample",
    "WarmupTarget",
    "sample_label",
    "warmup_problem",
]

#: The folder (in the model folder, beside the version folders) of ``input_data_file``s.
WARMUP_FOLDER = "warmup"


class WarmupInput(Strict):
    """One input of a warmup sample (Triton's ``ModelWarmup.Input``).

    Attributes:
        data_type: The input's datatype; must equal the declared input's.
        dims: Its shape without the batch dimension (the full shape for ``max_batch_size:
            0``); every dimension concrete (> 0), equal to the declared one where that is
            fixed.
        zero_data: Zeros (BYTES: empty strings).
        random_data: Random values of the datatype (BYTES: empty strings, as Triton).
        input_data_file: A file name in the model's ``warmup/`` folder: one row's raw values,
            row-major, little-endian; BYTES elements each a 4-byte little-endian length then
            the bytes. Its size must match ``dims`` exactly.

    Exactly one of ``zero_data``, ``random_data`` and ``input_data_file`` is set (as Triton,
    the value of the two flags is not looked at: setting the field chooses it).
    """

    data_type: Datatype
    dims: list[int] = Field(default_factory=list)
    zero_data: bool | None = None
    random_data: bool | None = None
    input_data_file: str | None = None

    @field_validator("data_type", mode="before")
    @classmethod
    def _triton_name(cls, value: object) -> object:
        if isinstance(value, str) and value.startswith("TYPE_"):
            return "BYTES" if value == "TYPE_STRING" else value.removeprefix("TYPE_")
        return value

    @field_validator("dims")
    @classmethod
    def _concrete(cls, dims: list[int]) -> list[int]:
        for dim in dims:
            if dim < 1:
                raise ValueError(f"each dim must be a positive integer, got {dims}")
        return dims

    @field_validator("input_data_file")
    @classmethod
    def _inside_warmup_folder(cls, value: str | None) -> str | None:
        if value is not None and (
            not value or value.startswith("/") or ".." in value.replace("\\", "/").split("/")
        ):
            raise ValueError(
                f"must be a file name inside the model's {WARMUP_FOLDER}/ folder, got {value!r}"
            )
        return value

    @model_validator(mode="after")
    def _one_source(self) -> WarmupInput:
        chosen = [
            name
            for name in ("zero_data", "random_data", "input_data_file")
            if getattr(self, name) is not None
        ]
        if len(chosen) != 1:
            raise ValueError(
                "set exactly one of zero_data, random_data, input_data_file; "
                f"got {chosen or 'none'}"
            )
        return self

    @property
    def source(self) -> str:
        """``zero_data``, ``random_data`` or ``input_data_file``."""
        if self.input_data_file is not None:
            return "input_data_file"
        return "random_data" if self.random_data is not None else "zero_data"


class WarmupSample(Strict):
    """One warmup request (Triton's ``ModelWarmup``).

    Attributes:
        name: The sample's name (in logs and errors).
        batch_size: Rows of the request (each input's row repeated); at most
            ``max_batch_size``, and 1 for a model without batching. 0 skips the sample, as
            Triton does.
        inputs: Input name -> how its data is made; every required input of the model.
        count: How many times the sample runs; 0 (Triton's default) runs it once.
    """

    name: str = ""
    batch_size: int = Field(default=1, ge=0, le=1_000_000)
    inputs: dict[str, WarmupInput] = Field(default_factory=dict)
    count: int = Field(default=0, ge=0, le=100_000)

    @property
    def runs(self) -> int:
        """Times the sample runs (``count``, at least 1)."""
        return max(1, self.count)


def sample_label(index: int, sample: WarmupSample) -> str:
    """``model_warmup[0] ('zeros')``: how errors name a sample."""
    return f"model_warmup[{index}]" + (f" ({sample.name!r})" if sample.name else "")


@dataclass(frozen=True, slots=True)
class WarmupTarget:
    """The parts of a model's configuration its warmup samples are checked against.

    Attributes:
        max_batch_size: The model's; 0 means dims are the full shape and batch_size is 1.
        inputs: The declared inputs (``TensorSpec``); empty when the model file declares
            them (checked again at load, once the backend filled them in).
        refused: Why this model cannot take warmup samples, or None.
    """

    max_batch_size: int
    inputs: Sequence[TensorSpec]
    refused: str | None = None

    @classmethod
    def of(cls, config: ModelConfig) -> WarmupTarget:
        """The target of a whole (validated, possibly completed) configuration."""
        return cls.of_fields(dict(config))

    @classmethod
    def of_fields(cls, data: Mapping[str, Any]) -> WarmupTarget:
        """The target from ``ModelConfig``'s already validated fields (a field validator's
        ``info.data``; fields that failed their own validation are absent)."""
        refused = None
        if data.get("ensemble") is not None:
            refused = "an ensemble cannot have warmup samples (as in Triton)"
        elif data.get("sequence_batching") is not None:
            refused = "not supported by gpuserve yet for sequence_batching models"
        return cls(int(data.get("max_batch_size", 0)), list(data.get("inputs", [])), refused)


def warmup_problem(samples: Sequence[WarmupSample], target: WarmupTarget) -> str | None:
    """What is wrong with ``samples`` for the model ``target`` describes, or None."""
    if not samples:
        return None
    if target.refused is not None:
        return target.refused
    for index, sample in enumerate(samples):
        problem = _sample_problem(target, sample)
        if problem is not None:
            return f"{sample_label(index, sample)}: {problem}"
    return None


def _sample_problem(target: WarmupTarget, sample: WarmupSample) -> str | None:
    batching = target.max_batch_size > 0
    if batching and sample.batch_size > target.max_batch_size:
        return f"batch_size {sample.batch_size} exceeds max_batch_size={target.max_batch_size}"
    if not batching and sample.batch_size > 1:
        return f"batch_size must be 1 for a model with max_batch_size 0, got {sample.batch_size}"
    if not target.inputs:  # declared by the model file: checked at load
        return None
    declared = {spec.name: spec for spec in target.inputs}
    for name, given in sample.inputs.items():
        spec = declared.get(name)
        if spec is None:
            return f"inputs.{name}: not an input of the model (inputs: {sorted(declared)})"
        where = f"inputs.{name}"
        if given.data_type != spec.datatype:
            return (
                f"{where}.data_type: {given.data_type} does not match the input's {spec.datatype}"
            )
        fits = len(given.dims) == len(spec.shape) and all(
            want in (-1, got) for got, want in zip(given.dims, spec.shape, strict=True)
        )
        if not fits:
            whole = "full shape" if not batching else "shape without the batch dimension"
            return (
                f"{where}.dims: {given.dims} do not fit the input's {whole} {spec.shape} "
                "(every -1 given as a positive size)"
            )
    missing = [s.name for s in target.inputs if not s.optional and s.name not in sample.inputs]
    if missing:
        return f"inputs: the model's required input(s) {missing} are not given"
    return None
