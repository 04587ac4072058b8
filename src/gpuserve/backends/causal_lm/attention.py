"""Attention over a paged KV cache.

The cache of one layer is two tensors ``[num_blocks, block_size, kv_heads, head_dim]``; a
sequence's keys live in the blocks its block table lists, in order. Each step first writes
the step's K/V at ``slot_mapping`` (:func:`write_kv`), then attends every query token to the
keys ``0..position`` of its own sequence.

Two implementations of one call (:class:`PagedAttention`), chosen once when the cache is
allocated (:func:`select_attention`):

* :class:`SdpaAttention` (any device): decode chunks together in one
  ``scaled_dot_product_attention`` call over their block tables gathered into a padded
  ``[N, kv_heads, max_keys, head_dim]`` with a key mask; each prefill chunk in its own call
  (plain causal over its own K/V when it starts the sequence, else an offset causal mask over
  the keys gathered from its blocks). Decodes of widely different context lengths attend in
  one call per bucket of similar lengths (``DecodeGroup.buckets``). Grouped-query attention
  never copies K/V per query head: a decode folds each group's query heads into the query
  axis, a prefill uses SDPA's ``enable_gqa``.
* :class:`FlashAttention` (CUDA with ``flash_attn`` installed, half precision, blocks a
  multiple of 256 tokens, which its paged kernels require): ``flash_attn_varlen_func`` and
  ``flash_attn_with_kvcache`` read the blocks in place.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from gpuserve.backends.causal_lm.step import StepBatch

logger = logging.getLogger(__name__)

#: flash-attn 2's paged kernels take blocks of a multiple of this many tokens.
FLASH_BLOCK_MULTIPLE = 256


def write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store this step's ``keys``/``values`` (``[T, kv_heads, head_dim]``) in the caches
    (``[num_blocks, block_size, kv_heads, head_dim]``) at ``slot_mapping`` (int64 ``[T]``)."""
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slot_mapping, keys)
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slot_mapping, values)


class PagedAttention(Protocol):
    """One attention implementation over the paged cache."""

    name: str

    def __call__(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        batch: StepBatch,
    ) -> torch.Tensor:
        """Attend each query token to its sequence's keys ``0..position``.

        Args:
            query: ``[T, heads, head_dim]``, RoPE applied.
            keys: ``[T, kv_heads, head_dim]``, this step's keys, already in ``key_cache``.
            values: ``[T, kv_heads, head_dim]``, already in ``value_cache``.
            key_cache: ``[num_blocks, block_size, kv_heads, head_dim]``.
            value_cache: Same shape.
            batch: The step (chunk spans, block tables, masks).

        Returns:
            ``[T, heads, head_dim]`` in the query's dtype.
        """
        ...


class SdpaAttention:
    """Paged attention with ``torch.nn.functional.scaled_dot_product_attention``."""

    name = "sdpa"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5

    def __call__(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        batch: StepBatch,
    ) -> torch.Tensor:
        decode = batch.decode
        if decode is not None and not batch.prefills:
            # all decodes, one token each, in chunk order: rows are 0..T-1
            return self._decode(query, key_cache, value_cache, batch)
        out = torch.empty_like(query)
        gqa = self.group > 1
        for span in batch.prefills:
            rows = slice(span.offset, span.offset + span.length)
            q = query[rows].transpose(0, 1).unsqueeze(0)
            if span.mask is None:
                k = keys[rows].transpose(0, 1).unsqueeze(0)
                v = values[rows].transpose(0, 1).unsqueeze(0)
            else:
                k = _gather(key_cache, span.blocks, span.context_len).transpose(0, 1).unsqueeze(0)
                v = _gather(value_cache, span.blocks, span.context_len)
                v = v.transpose(0, 1).unsqueeze(0)
            attended = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=span.mask,
                is_causal=span.mask is None,
                scale=self.scale,
                enable_gqa=gqa,
            )
            out[rows] = attended[0].transpose(0, 1)
        if decode is not None:
            out[decode.rows] = self._decode(query[decode.rows], key_cache, value_cache, batch)
        return out

    def _decode(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        batch: StepBatch,
    ) -> torch.Tensor:
        decode = batch.decode
        assert decode is not None
        if not decode.buckets:
            return self._padded(query, key_cache, value_cache, decode.block_tables, decode.key_mask)
        out = torch.empty_like(query)
        for bucket in decode.buckets:  # contexts far apart: each padded to its own longest
            out[bucket.index] = self._padded(
                query[bucket.index], key_cache, value_cache, bucket.block_tables, bucket.key_mask
            )
        return out

    def _padded(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        tables: torch.Tensor,
        key_mask: torch.Tensor,
    ) -> torch.Tensor:
        """One padded call: ``query`` ``[n, heads, d]`` against the keys of ``tables``
        (int64 ``[n, width]``) where ``key_mask`` (bool ``[n, 1, 1, width * block]``) is set."""
        n, head_dim = query.shape[0], query.shape[-1]
        # [n, width, block, kv, d] -> [n, kv, width * block, d]; index_select over the
        # flattened tables: 2-3x faster on a CPU than advanced indexing with the 2-D table
        shape = (n, tables.shape[1] * key_cache.shape[1], *key_cache.shape[2:])
        flat = tables.reshape(-1)
        k = key_cache.index_select(0, flat).view(shape).transpose(1, 2)
        v = value_cache.index_select(0, flat).view(shape).transpose(1, 2)
        # the query heads sharing a kv head go on the query axis: [n, kv, group, d]
        q = query.view(n, self.num_kv_heads, self.group, head_dim)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=self.scale)
        return attended.reshape(n, self.num_heads, head_dim)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """``[length, kv_heads, head_dim]``: a sequence's first ``length`` cached keys/values."""
    return cache.index_select(0, blocks).flatten(0, 1)[:length]


class FlashAttention:
    """Paged attention with flash-attn's kernels (CUDA, fp16/bf16); reads blocks in place."""

    name = "flash_attn"

    def __init__(self, flash_attn: Any, head_dim: int) -> None:
        self.flash = flash_attn
        self.scale = head_dim**-0.5

    def __call__(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        batch: StepBatch,
    ) -> torch.Tensor:
        out = torch.empty_like(query)
        device = query.device
        for span in batch.prefills:
            rows = slice(span.offset, span.offset + span.length)
            # causal=True aligns the queries to the end of the keys: query i sees
            # keys 0..start+i
            out[rows] = self.flash.flash_attn_varlen_func(
                query[rows],
                key_cache,
                value_cache,
                torch.tensor([0, span.length], dtype=torch.int32, device=device),
                torch.tensor([0, span.context_len], dtype=torch.int32, device=device),
                span.length,
                span.context_len,
                softmax_scale=self.scale,
                causal=True,
                block_table=span.blocks.to(torch.int32).unsqueeze(0),
            )
        decode = batch.decode
        if decode is not None:
            attended = self.flash.flash_attn_with_kvcache(
                query[decode.rows].unsqueeze(1),
                key_cache,
                value_cache,
                cache_seqlens=decode.context_lens,
                block_table=decode.block_tables.to(torch.int32),
                softmax_scale=self.scale,
                causal=True,
            )
            out[decode.rows] = attended.squeeze(1)
        return out


def select_attention(
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> PagedAttention:
    """The attention implementation for a cache: flash-attn where it can run, else SDPA."""
    if (
        device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and block_size % FLASH_BLOCK_MULTIPLE == 0
    ):
        try:
            import flash_attn  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            logger.info("flash_attn is not installed: paged attention runs on SDPA")
        else:
            return FlashAttention(flash_attn, head_dim)
    return SdpaAttention(num_heads, num_kv_heads, head_dim)
