"""Packed (unpadded) batches of token sequences: where each sequence lies, attention of each
sequence over its own tokens, and mean pooling, for encoders that run on real tokens only.

Used by gpuserve's own BERT (:mod:`gpuserve.models.bert`) and by the ``huggingface``
backend's packed execution (:mod:`gpuserve.backends.hf_packed`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class Packing:
    """Where each sequence lies in a packed (unpadded) batch of T tokens.

    Attributes:
        offsets: int64 [B + 1], on the tokens' device: sequence ``i`` is tokens
            ``offsets[i]:offsets[i+1]``.
        lengths: The B sequence lengths, tokens, on the host (for slicing without a sync).
        positions: int64 [T], each token's position within its sequence.
    """

    offsets: torch.Tensor
    lengths: tuple[int, ...]
    positions: torch.Tensor

    @classmethod
    def of(cls, lengths: list[int] | tuple[int, ...], device: torch.device | str) -> Packing:
        """The packing of sequences of ``lengths`` tokens (each >= 1)."""
        sizes = torch.tensor(list(lengths), dtype=torch.int64)
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        torch.cumsum(sizes, 0, out=offsets[1:])
        starts = torch.repeat_interleave(offsets[:-1], sizes)
        positions = torch.arange(int(offsets[-1]), dtype=torch.int64) - starts
        return cls(offsets.to(device), tuple(int(n) for n in lengths), positions.to(device))


def packed_attention(qkv: torch.Tensor, packing: Packing) -> torch.Tensor:
    """Self-attention of each sequence over its own tokens, without padding.

    Args:
        qkv: [T', 3, heads, head_size], the fused projections of the packed tokens; rows past
            the packing's T tokens (``T' >= T``: padding for the CPU kernels, see
            :func:`~gpuserve.backends.fused_linear.row_padded`) are ignored.
        packing: Where the sequences lie.

    Returns:
        [T', heads, head_size], zeros in the rows past T. On CUDA, one
        ``scaled_dot_product_attention`` call over jagged nested tensors (flash /
        memory-efficient varlen kernels); elsewhere (no CPU kernel takes jagged tensors) one
        call per sequence on its slice, as a batch of one: with 3-d inputs ([heads, L, d])
        torch's CPU attention leaves its fused kernel for a path ~4x slower (L = 185, one core),
        which made packed rows ~14% slower than alone.
    """
    extra = qkv.shape[0] - sum(packing.lengths)
    if qkv.device.type == "cuda":
        offsets = packing.offsets
        qkv = qkv[: qkv.shape[0] - extra] if extra else qkv
        q, k, v = (
            torch.nested.nested_tensor_from_jagged(qkv[:, i], offsets).transpose(1, 2)
            for i in range(3)
        )
        ctx = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).values()
        return F.pad(ctx, (0, 0, 0, 0, 0, extra)) if extra else ctx
    parts = []
    start = 0
    for length in packing.lengths:
        # [L, 3, heads, d] -> q, k, v [1, heads, L, d] (4-d: the fused CPU kernel)
        q, k, v = qkv[start : start + length].permute(1, 2, 0, 3).unsqueeze(1).unbind(0)
        parts.append(F.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1))
        start += length
    if extra:
        parts.append(qkv.new_zeros(extra, qkv.shape[2], qkv.shape[3]))
    return torch.cat(parts, dim=0)


def mean_pool_packed(
    hidden: torch.Tensor, packing: Packing, normalize: bool = True
) -> torch.Tensor:
    """Sentence embeddings of a packed batch: per-sequence mean, then (``normalize``) L2 norm.

    Args:
        hidden: [T, H], any float dtype (pooling runs in float32).
        packing: Where the sequences lie.
        normalize: Scale each row to unit L2 norm.

    Returns:
        float32 [B, H] on ``hidden``'s device.
    """
    hidden = hidden.float()
    batch = len(packing.lengths)
    lengths = torch.tensor(packing.lengths, dtype=torch.float32).to(hidden.device)
    index = torch.repeat_interleave(
        torch.arange(batch, device=hidden.device),
        lengths.to(torch.int64),
        output_size=hidden.shape[0],
    )
    summed = torch.zeros(batch, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    summed.index_add_(0, index, hidden)
    mean = summed / lengths[:, None]
    return F.normalize(mean, p=2, dim=1) if normalize else mean
