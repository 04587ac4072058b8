"""Padding variable-length inputs into one batch and cutting outputs back, as pure functions.

For a model whose inputs declare ``pad_value`` (see :mod:`gpuserve.config.padding`):

* :meth:`PaddingSpec.key` is the request's shape key with the padded dimensions wildcarded
  (``-1``), so requests of different lengths share a batch;
* :meth:`PaddingSpec.cost` is its length per row (the product of its first padded input's
  variable dimensions), which the batcher groups by and bounds with ``max_batch_tokens``;
* :meth:`PaddingSpec.stack` pads every request's arrays with ``pad_value`` to the batch's
  largest size along each variable dimension, then concatenates along the batch dimension;
* :meth:`PaddingSpec.unpad` cuts each request's outputs that declare ``unpad`` back to its own
  sizes.

Arrays are numpy with the batch dimension first; axis numbers below count it (a declared
variable dimension at position ``i`` of the config shape is array axis ``i + 1``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gpuserve.config import ModelConfig
from gpuserve.config.padding import variable_axes
from gpuserve.engine.assembly import ShapeKey
from gpuserve.engine.batch import Outputs, Pending
from gpuserve.engine.request import InferenceRequest, RequestCost


@dataclass(slots=True, frozen=True)
class PaddedInput:
    """One input that may be padded.

    Attributes:
        value: The pad value (cast to the input's dtype).
        axes: Array axes (batch dimension = 0) that are padded.
    """

    value: float
    axes: tuple[int, ...]


@dataclass(slots=True, frozen=True)
class Unpadded:
    """One output cut back per request.

    Attributes:
        source: The padded input whose per-request sizes it follows.
        axes: Array axes of the output that are cut, in order.
        source_axes: The input's array axes giving the sizes, matched one to one with ``axes``.
    """

    source: str
    axes: tuple[int, ...]
    source_axes: tuple[int, ...]


@dataclass(slots=True, frozen=True)
class PaddingSpec:
    """What batch assembly needs to pad a model's inputs and unpad its outputs.

    Attributes:
        inputs: Padded input name -> how.
        outputs: Unpadded output name -> how.
        length_input: The input whose variable dimensions give a request's length.
    """

    inputs: dict[str, PaddedInput]
    outputs: dict[str, Unpadded]
    length_input: str

    @classmethod
    def of(cls, config: ModelConfig) -> PaddingSpec | None:
        """The spec of ``config``, or None when no input declares ``pad_value``."""
        inputs = {
            spec.name: PaddedInput(spec.pad_value, tuple(a + 1 for a in variable_axes(spec.shape)))
            for spec in config.inputs
            if spec.pad_value is not None
        }
        if not inputs:
            return None
        outputs: dict[str, Unpadded] = {}
        for spec in config.outputs:
            if spec.unpad is None:
                continue
            axes = tuple(a + 1 for a in variable_axes(spec.shape))
            source_axes = inputs[spec.unpad].axes[: len(axes)]
            outputs[spec.name] = Unpadded(spec.unpad, axes, source_axes)
        return cls(inputs, outputs, next(iter(inputs)))

    def key(self, request: InferenceRequest) -> ShapeKey:
        """The request's shape key with padded dimensions shown as -1."""
        parts = []
        for name, array in request.inputs.items():
            shape = array.shape[1:]
            padded = self.inputs.get(name)
            if padded is not None:
                shape = tuple(-1 if axis + 1 in padded.axes else d for axis, d in enumerate(shape))
            parts.append((name, shape))
        return tuple(parts)

    def cost(self, request: InferenceRequest, rows: int) -> RequestCost | None:
        """Length of each of the request's ``rows`` rows: the product of the length input's
        padded dimensions (every row of a request has the same shape), or None when the
        request does not carry that input (an optional input left out)."""
        array = request.inputs.get(self.length_input)
        if array is None:
            return None
        length = 1
        for axis in self.inputs[self.length_input].axes:
            length *= int(array.shape[axis])
        return RequestCost((length,) * rows)

    def stack(self, items: Sequence[Pending]) -> dict[str, np.ndarray]:
        """The batch's inputs: padded inputs padded to the largest size per axis, then every
        input concatenated along axis 0 in item order."""
        first = items[0].request.inputs
        if len(items) == 1:
            return first
        stacked: dict[str, np.ndarray] = {}
        for name in first:
            arrays = [item.request.inputs[name] for item in items]
            padded = self.inputs.get(name)
            if padded is not None:
                arrays = _pad_all(arrays, padded)
            stacked[name] = np.concatenate(arrays, axis=0)
        return stacked

    def unpad(self, item: Pending, outputs: Outputs) -> Outputs:
        """``outputs`` (one request's rows) with each unpadded output cut to the request's own
        sizes; other outputs unchanged. Views, not copies."""
        if not self.outputs:
            return outputs
        result = dict(outputs)
        for name, how in self.outputs.items():
            array = result.get(name)
            source = item.request.inputs.get(how.source)
            if array is None or source is None:
                continue
            index: list[slice] = [slice(None)] * array.ndim
            for axis, source_axis in zip(how.axes, how.source_axes, strict=True):
                index[axis] = slice(0, source.shape[source_axis])
            result[name] = array[tuple(index)]
        return result


def _pad_all(arrays: list[np.ndarray], padded: PaddedInput) -> list[np.ndarray]:
    """Each array padded at the end of ``padded.axes`` to the largest size among them."""
    target = {axis: max(a.shape[axis] for a in arrays) for axis in padded.axes}
    out = []
    for array in arrays:
        widths = [
            (0, target[axis] - d if axis in target else 0) for axis, d in enumerate(array.shape)
        ]
        if any(after for _, after in widths):
            array = np.pad(array, widths, mode="constant", constant_values=padded.value)
        out.append(array)
    return out
