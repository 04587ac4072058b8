"""Completing a model config from the tensors a model file declares, or checking it against them.

ONNX graphs and ``torch.export`` programs carry their inputs and outputs (names, element types,
shapes with dynamic dimensions). A backend reads them into a :class:`ModelSignature`;
:func:`complete_config` then

* fills in ``inputs``/``outputs`` that ``config.yaml`` omits (or leaves empty);
* refuses a declaration that disagrees with the model, with one line per disagreement naming
  the config's value and the model's;
* chooses ``max_batch_size`` when ``config.yaml`` does not set it: kept (default 8, capped by
  the largest batch the model accepts) when every tensor's first dimension is dynamic, else 0.

Policies:

* With ``max_batch_size > 0`` every model input and output must have a dynamic first
  dimension (the batch); the config's shapes are the model's without it.
* A tensor with a ``reshape`` is compared by its reshape (the shape the model sees; clients
  use its ``shape``, see :mod:`gpuserve.config.reshape`).
* A model dimension that is fixed must be declared with that value (``-1`` there would let
  requests through that the model then refuses). A dynamic model dimension may be declared
  ``-1`` or a fixed value (the config may narrow what the model accepts).
* Datatypes must be equal: a float16 graph declared FP32 is an error (export with
  ``gpuserve export --fp16`` keeps FP32 inputs/outputs by casting inside the graph).
* Names: by name when the model binds by name (ONNX inputs and outputs, dict outputs of a
  ``torch.export`` program); by position otherwise (``torch.export`` inputs, tuple outputs),
  where only count, datatype and shape are compared, because a Python argument name is not a
  wire name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from gpuserve.config import ModelConfig, TensorSpec
from gpuserve.datatypes import DATATYPES
from gpuserve.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ModelTensor:
    """One input or output as the model file declares it.

    Attributes:
        name: The model's name for the tensor.
        datatype: KServe V2 datatype, or the file's own type name when it has none
            (such a tensor cannot be served).
        shape: Full shape, batch dimension included; ``None`` marks a dynamic dimension.
    """

    name: str
    datatype: str
    shape: tuple[int | None, ...]


@dataclass(frozen=True, slots=True)
class ModelSignature:
    """The tensors of a model file.

    Attributes:
        source: The file, as named in messages (``model.onnx``).
        inputs / outputs: In the model's order.
        inputs_by_name: Inputs are bound by name (else by position).
        outputs_by_name: Output names are the model's own (else positional placeholders).
        max_batch: The largest batch the model accepts, when the file bounds it.
    """

    source: str
    inputs: list[ModelTensor]
    outputs: list[ModelTensor]
    inputs_by_name: bool = True
    outputs_by_name: bool = True
    max_batch: int | None = None


def format_shape(shape: Sequence[int | None]) -> str:
    """``[-1, 8]`` style text of a shape (``None`` shown as -1)."""
    return "[" + ", ".join("-1" if d is None else str(d) for d in shape) + "]"


def complete_config(
    config: ModelConfig, signature: ModelSignature, config_path: Path
) -> ModelConfig:
    """Fill in what ``config`` omits from ``signature`` and check what it declares.

    Args:
        config: The validated ``config.yaml``.
        signature: What the model file declares.
        config_path: The ``config.yaml`` path, for messages.

    Returns:
        A validated config with inputs, outputs and ``max_batch_size`` settled.

    Raises:
        ConfigError: a disagreement (every one found, each naming both values), or a
            model tensor that cannot be served.
    """
    source = signature.source
    errors: list[str] = []
    max_batch_size = _batch_size(config, signature, errors)
    if errors:  # without a batch dimension the shapes below cannot be compared
        raise _error(config_path, source, errors)
    limit = signature.max_batch
    if limit is not None and max_batch_size > limit:
        errors.append(
            f"config.yaml sets max_batch_size: {max_batch_size}, but {source} accepts "
            f"batches of at most {limit} rows"
        )

    def dims(tensor: ModelTensor) -> tuple[int | None, ...]:
        return tensor.shape[1:] if max_batch_size > 0 else tensor.shape

    inputs = _settle(
        "input",
        config.inputs,
        signature.inputs,
        signature.inputs_by_name,
        True,
        source,
        dims,
        errors,
    )
    outputs = _settle(
        "output",
        config.outputs,
        signature.outputs,
        signature.outputs_by_name,
        False,
        source,
        dims,
        errors,
    )
    if errors:
        raise _error(config_path, source, errors)
    data = config.model_dump()
    data.update(
        max_batch_size=max_batch_size,
        inputs=[spec.model_dump() for spec in inputs],
        outputs=[spec.model_dump() for spec in outputs],
    )
    try:
        return ModelConfig.model_validate(data)
    except ValidationError as err:
        lines = [item["msg"].removeprefix("Value error, ") for item in err.errors()]
        raise _error(config_path, source, lines) from None


def _error(config_path: Path, source: str, lines: list[str]) -> ConfigError:
    body = "\n  ".join(lines)
    return ConfigError(f"{config_path}: does not match {source}:\n  {body}")


def _batch_size(config: ModelConfig, signature: ModelSignature, errors: list[str]) -> int:
    tensors = [("input", t) for t in signature.inputs] + [("output", t) for t in signature.outputs]
    unbatched = [(kind, t) for kind, t in tensors if not t.shape or t.shape[0] is not None]
    limit = signature.max_batch
    if "max_batch_size" not in config.model_fields_set:
        if unbatched:
            return 0
        return min(config.max_batch_size, limit) if limit else config.max_batch_size
    size = config.max_batch_size
    if size == 0:
        return 0
    for kind, tensor in unbatched:
        errors.append(
            f"{kind} '{tensor.name}': {signature.source} has shape {format_shape(tensor.shape)} "
            f"with no dynamic first dimension, but config.yaml sets max_batch_size: {size}, "
            "which needs one (set max_batch_size: 0, or export with a dynamic batch axis)"
        )
    return size


def _settle(
    kind: str,
    declared: list[TensorSpec],
    model: list[ModelTensor],
    by_name: bool,
    exhaustive: bool,
    source: str,
    shape_of: Callable[[ModelTensor], tuple[int | None, ...]],
    errors: list[str],
) -> list[TensorSpec]:
    """The specs of one side (inputs or outputs): completed, or checked pairwise.

    ``shape_of`` gives a model tensor's dims as the config writes them (batch dim removed).
    """
    if not declared:
        specs = []
        for tensor in model:
            if tensor.datatype not in DATATYPES:
                errors.append(
                    f"{kind} '{tensor.name}': {source} has type {tensor.datatype}, which has "
                    "no KServe V2 datatype"
                )
                continue
            shape = [-1 if d is None else d for d in shape_of(tensor)]
            specs.append(TensorSpec(name=tensor.name, datatype=tensor.datatype, shape=shape))  # type: ignore[arg-type]
        if not model:
            errors.append(f"{source} declares no {kind}s, and config.yaml declares none either")
        return specs
    model_names = [t.name for t in model]
    pairs: list[tuple[TensorSpec, ModelTensor, str]] = []
    if by_name:
        found = {t.name: t for t in model}
        for spec in declared:
            match = found.get(spec.name)
            if match is None:
                errors.append(
                    f"{kind} '{spec.name}': declared in config.yaml, but {source} has no such "
                    f"{kind} (its {kind}s: {model_names})"
                )
            else:
                pairs.append((spec, match, f"{kind} '{spec.name}'"))
        if exhaustive:
            names = {spec.name for spec in declared}
            for tensor in model:
                if tensor.name not in names:
                    errors.append(
                        f"{kind} '{tensor.name}': {source} needs it, but config.yaml does not "
                        f"declare it (declared {kind}s: {[s.name for s in declared]})"
                    )
    elif len(declared) != len(model):
        errors.append(
            f"config.yaml declares {len(declared)} {kind}(s) {[s.name for s in declared]}, but "
            f"{source} has {len(model)} {model_names} (matched by position)"
        )
    else:
        for spec, tensor in zip(declared, model, strict=True):
            label = f"{kind} '{spec.name}' ({source} {kind} '{tensor.name}', by position)"
            pairs.append((spec, tensor, label))
    for spec, tensor, label in pairs:
        if spec.datatype != tensor.datatype:
            errors.append(
                f"{label}: config.yaml declares datatype {spec.datatype}, but {source} has "
                f"{tensor.datatype}"
            )
        model_dims = shape_of(tensor)
        # The model sees a tensor in its reshape, when it has one (clients use its shape).
        seen, field = (spec.shape, "shape") if spec.reshape is None else (spec.reshape, "reshape")
        agree = len(model_dims) == len(seen) and all(
            m is None or m == c for m, c in zip(model_dims, seen, strict=True)
        )
        if not agree:
            errors.append(
                f"{label}: config.yaml declares {field} {format_shape(seen)}, but {source} "
                f"has {format_shape(model_dims)} (without the batch dimension; -1 = dynamic)"
            )
    return list(declared)
