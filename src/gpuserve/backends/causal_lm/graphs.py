"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step of a small model is hundreds of short kernels; on a GPU their launch time, not
the arithmetic, sets the step time. A CUDA graph records the launches of one step once and
replays them with one call. A graph replays fixed addresses and shapes, so:

* every input of the step lives in a **static buffer** (token ids, positions, K/V slots,
  block tables, key mask, context lengths), sized for the largest bucket; a step copies its
  values in and replays;
* a step of ``n`` decodes runs the graph of the smallest bucket ``b >= n`` (1, 2, 4, 8, then
  multiples of 8 up to ``max_batch``); rows ``n..b-1`` are **padding**: token 0 at position
  0, writing its K/V to a scratch block that no sequence owns (the cache is allocated one
  block larger), attending to that one key;
* block tables are padded with the scratch block (masked out) to a **width bucket**: with
  FlashAttention's paged kernels, which read the blocks in place up to each sequence's
  length, one width (the longest context, ``ceil(context_length / block_size)`` blocks);
  with SDPA, which gathers every listed block, powers of two up to it, so a step of short
  sequences gathers no more than twice their blocks. One graph per (batch, width) bucket.

Only steps of decodes alone take a graph (a step holding a prefill chunk runs eagerly). The
same static path runs without capture on any device (``capture=False``), which is how it is
tested on a CPU: the padded static step must give the same logits as the eager one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpuserve.backends.causal_lm.step import DecodeGroup, StepBatch

logger = logging.getLogger(__name__)

#: Largest decode batch captured when the config sets none.
DEFAULT_MAX_BATCH = 256


def width_buckets(max_blocks: int, in_place: bool) -> tuple[int, ...]:
    """Block-table widths recorded: ``(max_blocks,)`` for an attention that reads blocks in
    place, else powers of two below ``max_blocks``, and ``max_blocks``."""
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be at least 1, got {max_blocks}")
    if in_place:
        return (max_blocks,)
    widths = [1 << k for k in range(max_blocks.bit_length()) if (1 << k) < max_blocks]
    return (*widths, max_blocks)


def bucket_sizes(max_batch: int) -> tuple[int, ...]:
    """The captured batch sizes: 1, 2, 4, 8, then every multiple of 8 up to ``max_batch``
    (``max_batch`` itself always included)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    sizes = [s for s in (1, 2, 4) if s < max_batch]
    sizes += range(8, max_batch, 8)
    sizes.append(max_batch)
    return tuple(sorted(set(sizes)))


@dataclass(slots=True)
class _Buffers:
    """The static inputs of every bucket's step (views ``[:b]`` of these), on the device."""

    token_ids: torch.Tensor  # int64 [B]
    positions: torch.Tensor  # int64 [B]
    slot_mapping: torch.Tensor  # int64 [B]
    rows: torch.Tensor  # int64 [B], 0..B-1 (never written)
    block_tables: torch.Tensor  # int64 [B, W]
    key_mask: torch.Tensor  # bool [B, 1, 1, W * block_size]
    context_lens: torch.Tensor  # int32 [B]


class DecodeGraphs:
    """Decode steps of one model on static buffers, replayed from CUDA graphs.

    Args:
        forward: The model's forward pass (``StepBatch`` -> float32 ``[R, vocab]``).
        device: The model's device.
        block_size: Tokens per cache block.
        max_blocks: Blocks of the longest sequence (``ceil(context_length / block_size)``).
        scratch_block: A cache block no sequence is ever given (padding rows write there).
        max_batch: The largest bucket.
        capture: Record CUDA graphs (CUDA only); False runs the static step eagerly.
        in_place: The attention reads blocks in place up to each context length
            (FlashAttention): one table width; else width buckets (:func:`width_buckets`).
    """

    def __init__(
        self,
        forward: Callable[[StepBatch], torch.Tensor],
        device: torch.device,
        block_size: int,
        max_blocks: int,
        scratch_block: int,
        max_batch: int,
        capture: bool,
        in_place: bool = False,
    ) -> None:
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {device}")
        self.forward = forward
        self.device = device
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.scratch_block = scratch_block
        self.buckets = bucket_sizes(max_batch)
        self.widths = width_buckets(max_blocks, in_place)
        self.capture = capture
        size = self.buckets[-1]
        keys = max_blocks * block_size

        def make(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self._buffers = _Buffers(
            token_ids=make((size,), torch.int64),
            positions=make((size,), torch.int64),
            slot_mapping=make((size,), torch.int64),
            rows=torch.arange(size, dtype=torch.int64, device=device),
            block_tables=make((size, max_blocks), torch.int64),
            key_mask=make((size, 1, 1, keys), torch.bool),
            context_lens=make((size,), torch.int32),
        )
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.replays = 0

    def bucket(self, n: int) -> int | None:
        """The smallest bucket holding ``n`` decodes, or None past the largest."""
        return next((size for size in self.buckets if size >= n), None)

    def width(self, blocks: int) -> int | None:
        """The narrowest width bucket holding ``blocks`` blocks, or None past the widest."""
        return next((width for width in self.widths if width >= blocks), None)

    def takes(self, batch: StepBatch) -> bool:
        """Whether ``batch`` runs on a graph: decodes alone, each sampled, within the
        largest bucket and the table width."""
        decode = batch.decode
        if decode is None or batch.prefills:
            return False
        n = batch.num_tokens
        return (
            int(batch.logits_rows.shape[0]) == n
            and n <= self.buckets[-1]
            and int(decode.block_tables.shape[1]) <= self.max_blocks
        )

    def static_batch(self, size: int, width: int) -> StepBatch:
        """The step of bucket ``(size, width)`` on the static buffers (what a graph
        records)."""
        b = self._buffers
        keys = width * self.block_size
        return StepBatch(
            token_ids=b.token_ids[:size],
            positions=b.positions[:size],
            slot_mapping=b.slot_mapping[:size],
            query_starts=list(range(size)),
            query_lens=[1] * size,
            context_lens=[keys] * size,
            block_tables=[],
            logits_rows=b.rows[:size],
            block_size=self.block_size,
            prefills=[],
            decode=DecodeGroup(
                rows=b.rows[:size],
                block_tables=b.block_tables[:size, :width],
                key_mask=b.key_mask[:size, :, :, :keys],
                context_lens=b.context_lens[:size],
                max_context_len=keys,
            ),
        )

    def capture_all(self) -> None:
        """Record every bucket's graph (largest first, sharing one memory pool), after a
        warm-up run of each on a side stream, as CUDA graph capture requires."""
        if not self.capture:
            return
        self._pad(0, self.buckets[-1])
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        keys = [(size, width) for size in self.buckets for width in self.widths]
        with torch.cuda.stream(stream):
            for size, width in keys:
                self.forward(self.static_batch(size, width))
        torch.cuda.current_stream(self.device).wait_stream(stream)
        for key in reversed(keys):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[key] = self.forward(self.static_batch(*key))
            self._graphs[key] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d CUDA graphs of decode steps: batch sizes %s, table widths %s",
            len(keys),
            self.buckets,
            self.widths,
        )

    def run(self, batch: StepBatch) -> torch.Tensor:
        """The logits of a step :meth:`takes` (float32 ``[n, vocab]``), from its bucket's
        graph (or the static step run eagerly)."""
        decode = batch.decode
        assert decode is not None
        n = batch.num_tokens
        size = self.bucket(n)
        width = int(decode.block_tables.shape[1])
        padded = self.width(width)
        assert size is not None and padded is not None
        b = self._buffers
        b.token_ids[:n].copy_(batch.token_ids, non_blocking=True)
        b.positions[:n].copy_(batch.positions, non_blocking=True)
        b.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
        b.block_tables[:n, :width].copy_(decode.block_tables, non_blocking=True)
        b.block_tables[:n, width:padded] = self.scratch_block
        keys, end = width * self.block_size, padded * self.block_size
        b.key_mask[:n, :, :, :keys].copy_(decode.key_mask, non_blocking=True)
        b.key_mask[:n, :, :, keys:end] = False
        b.context_lens[:n].copy_(decode.context_lens, non_blocking=True)
        self._pad(n, size)
        self.replays += 1
        graph = self._graphs.get((size, padded))
        if graph is None:
            return self.forward(self.static_batch(size, padded))[:n]
        graph.replay()
        return self._outputs[size, padded][:n].clone()

    def _pad(self, start: int, end: int) -> None:
        """Rows ``start..end-1`` as padding: token 0 at position 0 in the scratch block,
        attending to that one key."""
        if start >= end:
            return
        b = self._buffers
        b.token_ids[start:end] = 0
        b.positions[start:end] = 0
        b.slot_mapping[start:end] = self.scratch_block * self.block_size
        b.block_tables[start:end] = self.scratch_block
        b.key_mask[start:end] = False
        b.key_mask[start:end, :, :, 0] = True
        b.context_lens[start:end] = 1


__all__ = ["DEFAULT_MAX_BATCH", "DecodeGraphs", "bucket_sizes", "width_buckets"]
