"""An input's or output's ``reshape``: the shape the model sees, when it differs from ``dims``.

Triton's ``ModelInput.reshape`` / ``ModelOutput.reshape`` with Triton's rules, in
``config.pbtxt`` (``reshape: { shape: [ 2, 2 ] }``) or ``config.yaml`` (``reshape: [2, 2]``
beside ``shape``)::

    inputs:
      - {name: IMAGE, datatype: FP32, shape: [12], reshape: [3, 4]}

* Clients send an input in its ``shape`` (``dims``; validated against it); the model receives
  each request's tensor in ``reshape`` (batch dimension first when ``max_batch_size > 0``). An
  output the model produces in ``reshape`` reaches clients in ``shape``. The data is not
  copied: a reshape is a view of the same row-major values.
* Both hold the same number of elements. ``-1`` (variable) dimensions: both have the same
  number of them, in the same order, and the runs of fixed dimensions between them hold equal
  element counts (``[2, 4, -1, 6]`` may become ``[8, -1, 1, 6]``); each ``-1`` of the reshape
  takes the size the request gave the matching ``-1`` of ``shape``.
* ``reshape: []`` (a scalar per row) is allowed for a one-element ``shape`` of a batching
  model (``dims: [1]`` seen by the model as ``[batch]``), not for ``max_batch_size: 0``.
* A reshape equal to ``shape`` changes nothing. A different one is not served (a clear load
  error) yet for decoupled, sequence-batched and ensemble models, and on inputs that pad
  (``pad_value``) or outputs that ``unpad``. ``model_warmup`` samples are given in
  ``shape`` (as clients send) and reach the model reshaped, like requests.

The functions here are pure (shapes in, shapes or a problem out); the engine applies them to
requests at admission (:mod:`gpuserve.engine.reshape`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuserve.config.model import ModelConfig, TensorSpec

__all__ = [
    "check_reshape_dims",
    "refused_with",
    "reshape_problem",
    "reshapes",
    "transfer_shape",
    "uses_reshape",
]


def check_reshape_dims(reshape: list[int] | None) -> list[int] | None:
    """Each dimension of a reshape is a positive integer or -1 (Triton refuses 0).

    Raises:
        ValueError: a dimension is 0 or below -1.
    """
    if reshape is not None:
        for dim in reshape:
            if dim < 1 and dim != -1:
                raise ValueError(
                    f"each reshape dim must be a positive integer or -1, got {reshape}"
                )
    return reshape


def _trunks(shape: Sequence[int]) -> list[int]:
    """Element counts of the runs of fixed dimensions around the ``-1`` dimensions:
    ``[2, 4, -1, 6]`` -> ``[8, 6]``."""
    counts, current = [], 1
    for dim in shape:
        if dim == -1:
            counts.append(current)
            current = 1
        else:
            current *= dim
    counts.append(current)
    return counts


def reshape_problem(
    dims: Sequence[int], reshape: Sequence[int] | None, batching: bool, dims_label: str = "dims"
) -> str | None:
    """What is wrong with ``reshape`` for a tensor of ``dims`` (Triton's rules), or None.

    Args:
        dims: The shape clients use, without the batch dimension; ``-1`` variable.
        reshape: The shape the model uses, without the batch dimension; None: no reshape.
        batching: Whether the model batches (``max_batch_size > 0``).
        dims_label: What messages call ``dims`` (``shape`` in a ``config.yaml``).
    """
    if reshape is None:
        return None
    for dim in reshape:
        if dim < 1 and dim != -1:
            return f"each reshape dim must be a positive integer or -1, got {list(reshape)}"
    if not reshape:
        if not batching:
            return (
                "an empty reshape needs a batching model (max_batch_size > 0): with "
                "max_batch_size 0 the tensor would be a scalar, which is not served"
            )
        if -1 in dims or math.prod(dims) != 1:
            return (
                f"an empty reshape needs {dims_label} of one element (such as [1]), got "
                f"{list(dims)}"
            )
        return None
    variable = (list(dims).count(-1), list(reshape).count(-1))
    if variable[0] != variable[1]:
        return (
            f"reshape {list(reshape)} has {variable[1]} variable (-1) dimension(s) and "
            f"{dims_label} {list(dims)} has {variable[0]}: they must have the same number, in "
            "the same order"
        )
    if _trunks(dims) != _trunks(reshape):
        if not variable[0]:
            return (
                f"reshape {list(reshape)} holds {math.prod(reshape)} elements, but {dims_label} "
                f"{list(dims)} hold {math.prod(dims)}: they must hold the same number"
            )
        return (
            f"reshape {list(reshape)} does not fit {dims_label} {list(dims)}: the fixed dimensions "
            "between the variable (-1) ones must hold the same number of elements in both"
        )
    return None


def transfer_shape(
    shape: Sequence[int], source: Sequence[int], target: Sequence[int]
) -> tuple[int, ...]:
    """A concrete shape written in ``source`` (``dims`` or ``reshape``) rewritten in ``target``:
    each ``-1`` of ``target`` takes, in order, the size ``shape`` has at ``source``'s ``-1``s.

    Args:
        shape: The tensor's shape without the batch dimension; fits ``source``.
        source / target: A valid pair (see :func:`reshape_problem`), either way round.

    Raises:
        ValueError: ``shape`` does not fit ``source`` (another rank or fixed size).
    """
    if len(shape) != len(source) or any(
        want != -1 and want != got for got, want in zip(shape, source, strict=True)
    ):
        raise ValueError(f"shape {list(shape)} does not fit {list(source)}")
    sizes = iter([got for got, want in zip(shape, source, strict=True) if want == -1])
    return tuple(next(sizes) if dim == -1 else dim for dim in target)


def uses_reshape(spec: TensorSpec) -> bool:
    """Whether ``spec`` has a reshape that changes its shape (one equal to it is a no-op)."""
    return spec.reshape is not None and spec.reshape != spec.shape


def reshapes(specs: Sequence[TensorSpec], batching: bool, label: str) -> str | None:
    """The first problem of the reshapes of ``specs`` (the ``inputs`` or ``outputs`` of a
    model, ``label`` naming which), or None."""
    for index, spec in enumerate(specs):
        problem = reshape_problem(spec.shape, spec.reshape, batching, "shape")
        if problem is not None:
            return f"{label}[{index}] ('{spec.name}'): {problem}"
    return None


def refused_with(config: ModelConfig | Mapping[str, Any]) -> str | None:
    """Why a model whose tensors reshape cannot be served with the rest of its config, or
    None (also None when nothing reshapes). ``config`` is a ModelConfig or its validated
    fields."""
    data: Mapping[str, Any] = config if isinstance(config, Mapping) else dict(config)
    inputs: list[TensorSpec] = list(data.get("inputs", []))
    outputs: list[TensorSpec] = list(data.get("outputs", []))
    named = [f"input '{s.name}'" for s in inputs if uses_reshape(s)]
    named += [f"output '{s.name}'" for s in outputs if uses_reshape(s)]
    if not named:
        return None
    which = ", ".join(named)
    policy = data.get("model_transaction_policy")
    blockers = [
        ("backend 'ensemble'", data.get("backend") == "ensemble"),
        ("sequence_batching", data.get("sequence_batching") is not None),
        ("a decoupled model", policy is not None and getattr(policy, "decoupled", False)),
        ("pad_value", any(s.pad_value is not None for s in inputs if uses_reshape(s))),
        ("unpad", any(s.unpad is not None for s in outputs if uses_reshape(s))),
    ]
    for what, present in blockers:
        if present:
            return (
                f"a reshape different from the shape ({which}) is not supported by gpuserve "
                f"yet with {what}"
            )
    return None
