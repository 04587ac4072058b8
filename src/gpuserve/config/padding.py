"""Padding of variable-length tensor inputs, as declared in a model's config.

An input whose shape has variable dimensions (``-1``) may declare ``pad_value``: requests of
different sizes along those dimensions then share a batch, each padded with ``pad_value`` up to
the batch's largest size (the model must treat the padding as such, e.g. an attention mask
padded with 0). An output with variable dimensions may declare ``unpad: <input>``: each request
gets it cut back to its own sizes of that input's variable dimensions (the i-th variable
dimension of the output follows the i-th of the input)::

    inputs:
      - {name: input_ids, datatype: INT64, shape: [-1], pad_value: 0}
      - {name: attention_mask, datatype: INT64, shape: [-1], pad_value: 0}
    outputs:
      - {name: token_embeddings, datatype: FP32, shape: [-1, 384], unpad: input_ids}
      - {name: sentence_embedding, datatype: FP32, shape: [384]}

A request's length for length-aware batching is the product of its first padded input's
variable dimensions (tokens for a token-id input). This is gpuserve's counterpart of Triton's
ragged batching, done by padding rather than by handing the model flattened tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuserve.config.model import ModelConfig


def variable_axes(shape: list[int]) -> tuple[int, ...]:
    """Positions of the ``-1`` dimensions of a declared (non-batch) shape."""
    return tuple(index for index, dim in enumerate(shape) if dim == -1)


def padding_problem(config: ModelConfig) -> str | None:
    """What is wrong with the ``pad_value`` / ``unpad`` declarations of ``config``, or None."""
    padded: dict[str, int] = {}
    for spec in config.inputs:
        if spec.unpad is not None:
            return f"input {spec.name!r}: 'unpad' is for outputs (inputs declare pad_value)"
        if spec.pad_value is None:
            continue
        where = f"input {spec.name!r}: pad_value"
        if spec.datatype == "BYTES":
            return f"{where}: BYTES inputs cannot be padded (tokenise in the model instead)"
        axes = variable_axes(spec.shape)
        if not axes:
            return f"{where}: the shape {spec.shape} has no variable dimension (-1) to pad"
        if config.max_batch_size == 0:
            return f"{where}: needs max_batch_size > 0 (padding serves batching)"
        padded[spec.name] = len(axes)
    for spec in config.outputs:
        if spec.pad_value is not None:
            return f"output {spec.name!r}: 'pad_value' is for inputs (outputs declare unpad)"
        if spec.unpad is None:
            continue
        where = f"output {spec.name!r}: unpad"
        if spec.unpad not in padded:
            return (
                f"{where}: {spec.unpad!r} is not an input with pad_value "
                f"(padded inputs: {sorted(padded)})"
            )
        axes = variable_axes(spec.shape)
        if not axes or len(axes) > padded[spec.unpad]:
            return (
                f"{where}: the shape {spec.shape} must have 1 to {padded[spec.unpad]} variable "
                f"dimension(s) (-1), one per variable dimension of input {spec.unpad!r} to cut"
            )
    return None
