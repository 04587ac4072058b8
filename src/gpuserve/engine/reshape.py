"""Inputs and outputs whose ``reshape`` differs from their shape (see
:mod:`gpuserve.config.reshape`), applied where Triton applies them: a request's inputs at
admission, before it is batched, so the batcher, the instance and the model all see the
model's shape; its outputs when its batch has run, before anyone else sees them.

Pure functions of a model's configuration; arrays are reshaped, never copied (a reshape of a
contiguous array is a view). Anything with ``.shape`` and ``.reshape(tuple)`` works: numpy
arrays, and torch tensors handed between ensemble steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from gpuserve.config import ModelConfig
from gpuserve.config.reshape import transfer_shape, uses_reshape
from gpuserve.engine.batch import Outputs
from gpuserve.engine.request import InferenceRequest
from gpuserve.errors import BackendError, GpuserveError, InvalidInputError

__all__ = ["ReshapeSpec", "TensorReshape"]


@dataclass(frozen=True, slots=True)
class TensorReshape:
    """One tensor's two shapes, both without the batch dimension (``-1`` variable).

    Attributes:
        name: The tensor's name.
        dims: The shape clients use (``TensorSpec.shape``).
        reshape: The shape the model uses.
    """

    name: str
    dims: tuple[int, ...]
    reshape: tuple[int, ...]


def _reshaped(array: Any, batched: bool, source: tuple[int, ...], target: tuple[int, ...]) -> Any:
    """``array`` (batch dimension first when ``batched``) rewritten from ``source`` to
    ``target``. Raises ValueError when it does not fit ``source``."""
    shape = tuple(array.shape)
    rows, rest = (shape[:1], shape[1:]) if batched else ((), shape)
    if batched and not rows:
        raise ValueError("a scalar has no batch dimension")
    return array.reshape(rows + transfer_shape(rest, source, target))


def _text(shape: Sequence[int], batched: bool) -> str:
    return str(["batch", *shape] if batched else list(shape)).replace("'", "")


@dataclass(frozen=True, slots=True)
class ReshapeSpec:
    """The reshapes of one model: what admission and completion apply.

    Attributes:
        model: The model's name, for messages.
        batched: Whether the model batches (arrays then have the batch dimension first).
        inputs / outputs: Only the tensors whose reshape differs from their shape.
    """

    model: str
    batched: bool
    inputs: tuple[TensorReshape, ...]
    outputs: tuple[TensorReshape, ...]

    @classmethod
    def of(cls, config: ModelConfig) -> ReshapeSpec | None:
        """The spec of ``config``, or None when no tensor of it reshapes."""

        def pick(specs: Sequence[Any]) -> tuple[TensorReshape, ...]:
            return tuple(
                TensorReshape(s.name, tuple(s.shape), tuple(s.reshape))
                for s in specs
                if uses_reshape(s)
            )

        inputs, outputs = pick(config.inputs), pick(config.outputs)
        if not inputs and not outputs:
            return None
        return cls(config.name or "", config.max_batch_size > 0, inputs, outputs)

    def request(self, request: InferenceRequest) -> InferenceRequest:
        """A copy of ``request`` whose inputs are in the model's shapes (views of the same
        arrays); ``request`` itself is left as it is, so a refused admission changes nothing.

        Raises:
            InvalidInputError: an input does not fit its declared shape (only a caller that
                skipped the protocol's validation can send one), naming it and the shape.
        """
        if not self.inputs:
            return request
        inputs = dict(request.inputs)
        for tensor in self.inputs:
            array = inputs.get(tensor.name)
            if array is None:  # an optional input the request left out
                continue
            try:
                inputs[tensor.name] = _reshaped(array, self.batched, tensor.dims, tensor.reshape)
            except ValueError:
                raise InvalidInputError(
                    f"model '{self.model}' input '{tensor.name}': shape {list(array.shape)}, "
                    f"expected {_text(tensor.dims, self.batched)}"
                ) from None
        return replace(request, inputs=inputs)

    def outputs_of(self, outputs: Outputs) -> Outputs:
        """One request's outputs (as the model made them) in the shapes clients use.

        Raises:
            BackendError: an output is not in its reshape, naming it and both shapes.
        """
        if not self.outputs:
            return outputs
        result = dict(outputs)
        for tensor in self.outputs:
            array = result.get(tensor.name)
            if array is None:  # not requested
                continue
            try:
                result[tensor.name] = _reshaped(array, self.batched, tensor.reshape, tensor.dims)
            except ValueError:
                raise BackendError(
                    f"model '{self.model}' returned output '{tensor.name}' of shape "
                    f"{list(array.shape)}, which does not fit its reshape "
                    f"{_text(tensor.reshape, self.batched)} (dims "
                    f"{_text(tensor.dims, self.batched)})"
                ) from None
        return result

    def results(self, results: Sequence[Outputs | GpuserveError]) -> list[Outputs | GpuserveError]:
        """Each request's result of a batch: its outputs in the clients' shapes, or its
        error (an output that does not fit fails that request alone, with a BackendError)."""
        out: list[Outputs | GpuserveError] = []
        for result in results:
            if isinstance(result, GpuserveError):
                out.append(result)
                continue
            try:
                out.append(self.outputs_of(result))
            except BackendError as err:
                out.append(err)
        return out
