"""Weight-only quantisation of a causal LM's matrix products (``generate.weight_format``).

Decoding one token reads every weight once per step, so at small batches a step takes as
long as its weights take to stream from memory. Storing the weights of the linear layers
and of the output projection (``lm_head``) in fewer bits shortens that; activations, norms,
attention and the KV cache stay in the serving dtype (``precision``).

Two formats:

* ``int8``: one symmetric scale per output channel (row of ``[out, in]``):
  ``w = q * scale``, ``q`` in [-127, 127]. Products: ``torch._weight_int8pack_mm``.
* ``int4``: asymmetric groups of :data:`INT4_GROUP` input channels, one scale and one offset
  per group and output channel: ``w = (q - 8) * scale + zero``, ``q`` in [0, 15] (the layout
  of llama.cpp's Q4_1 blocks, so a Q4_1 GGUF is kept nearly as stored). Products:
  ``torch._weight_int4pack_mm_for_cpu``. The output projection stays int8, as llama.cpp's
  4-bit files keep theirs at 6 to 8 bits: 4 bits there cost the most accuracy.

Those kernels read the packed weights directly and win while the step has few rows (one
decode token per sequence); past :data:`PACKED_MAX_ROWS` rows (prefill chunks, large decode
batches) a matrix product is compute-bound and oneDNN's bf16 kernels (AMX) are several times
faster. Each :class:`QuantizedLinear` therefore also keeps its dequantised weights in the
serving dtype (``dense``) for those steps: both paths compute with the same quantised
values, so an answer does not depend on which ran (beyond the rounding order of the sums).
Where the packed kernel does not exist (a GPU without it, an activation dtype it does not
take) every product runs on ``dense``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

#: The weight formats of ``generate.weight_format``.
WeightFormat = Literal["int8", "int4"]
WEIGHT_FORMATS: tuple[str, ...] = ("int8", "int4")
#: Input channels per int4 group (one scale and one offset each), as llama.cpp's Q4_1.
INT4_GROUP = 32
#: Steps with at most this many rows use the packed kernels, larger ones ``dense``
#: (crossover measured on one Xeon core with AMX: ``benchmarks/generate_weights.py``).
PACKED_MAX_ROWS = 4


@dataclass(slots=True)
class QuantizedLinear:
    """One weight matrix ``[out, in]`` in a low-bit format.

    Attributes:
        format: ``int8`` or ``int4``.
        out_features: Rows of the matrix (output channels).
        in_features: Columns (input channels).
        packed: int8: int8 ``[out, in]``; int4: uint8 ``[out, in / 2]`` in the layout of
            ``_convert_weight_to_int4pack_for_cpu``.
        scales: int8: ``[out]`` in the serving dtype; int4: bf16 ``[in / 32, out, 2]``
            (scale, zero).
        dense: The dequantised matrix ``[out, in]`` in the serving dtype.
        use_packed: Whether the packed kernel runs on this device and dtype.
    """

    format: str
    out_features: int
    in_features: int
    packed: torch.Tensor
    scales: torch.Tensor
    dense: torch.Tensor
    use_packed: bool

    @property
    def shape(self) -> torch.Size:
        """``[out, in]``, as a dense weight's."""
        return self.dense.shape

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ w.T``: ``x`` ``[rows, in]`` in the serving dtype -> ``[rows, out]``."""
        if not self.use_packed or x.shape[0] > PACKED_MAX_ROWS:
            return F.linear(x, self.dense)
        if self.format == "int8":
            return torch._weight_int8pack_mm(x, self.packed, self.scales)
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scales)

    @property
    def packed_bytes(self) -> int:
        """Bytes of the packed weights and their scales."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales))


Weight = torch.Tensor | QuantizedLinear


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` over a dense or a :class:`QuantizedLinear` weight."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    out = weight.matmul(x)
    return out if bias is None else out + bias


def packed_kernel_available(fmt: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``fmt``'s packed kernel runs for ``dtype`` activations on ``device``.

    Both take bf16 activations on a CPU (with fp32 they run several times slower than an
    fp32 product there, so fp32 never uses them); elsewhere every product is dequantised.
    """
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    name = "_weight_int8pack_mm" if fmt == "int8" else "_weight_int4pack_mm_for_cpu"
    return hasattr(torch, name)


def quantize(
    weight: torch.Tensor, fmt: str, dtype: torch.dtype, use_packed: bool
) -> QuantizedLinear:
    """Quantise ``weight`` (float ``[out, in]``, any device) to ``fmt``.

    Args:
        weight: The full-precision matrix (read in float32).
        fmt: ``int8`` or ``int4``.
        dtype: Serving dtype of activations (the scales of int8 and ``dense``).
        use_packed: Keep the packed layout for the small-row kernels; False keeps only
            ``dense`` (``packed`` is then empty).

    Raises:
        ValueError: an unknown format, or int4 on a matrix whose input width is not a
            multiple of :data:`INT4_GROUP`.
    """
    w = weight.float()
    out_features, in_features = w.shape
    if fmt == "int8":
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        scale = scale.to(dtype)
        dense = (q.float() * scale.float()[:, None]).to(dtype)
        packed, scales = q, scale
    elif fmt == "int4":
        if in_features % INT4_GROUP:
            raise ValueError(
                f"int4 needs input widths that are multiples of {INT4_GROUP}, got {in_features}"
            )
        groups = w.view(out_features, in_features // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(dim=2), groups.amax(dim=2)
        step = ((high - low) / 15.0).clamp(min=1e-12)
        # scale and zero are stored in bf16: quantise against the rounded values
        step_b = step.to(torch.bfloat16)
        zero_b = (low + 8.0 * step).to(torch.bfloat16)
        start = zero_b.float() - 8.0 * step_b.float()
        q = torch.round((groups - start[..., None]) / step_b.float()[..., None]).clamp(0, 15)
        values = (q - 8.0) * step_b.float()[..., None] + zero_b.float()[..., None]
        dense = values.view(out_features, in_features).to(dtype)
        q_int = q.view(out_features, in_features).to(torch.int32)
        packed = (
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(q_int.cpu(), 1).to(w.device)
            if use_packed
            else q_int
        )
        # [groups, out, 2]: the kernel's layout of (scale, zero)
        scales = torch.stack((step_b, zero_b), dim=-1).transpose(0, 1).contiguous()
    else:
        raise ValueError(f"unknown weight format {fmt!r} (expected one of {WEIGHT_FORMATS})")
    if not use_packed:
        packed = torch.empty(0, dtype=torch.int8, device=w.device)
    return QuantizedLinear(
        format=fmt,
        out_features=out_features,
        in_features=in_features,
        packed=packed.contiguous(),
        scales=scales,
        dense=dense.contiguous(),
        use_packed=use_packed,
    )


__all__ = [
    "INT4_GROUP",
    "PACKED_MAX_ROWS",
    "WEIGHT_FORMATS",
    "QuantizedLinear",
    "Weight",
    "WeightFormat",
    "linear",
    "packed_kernel_available",
    "quantize",
]
