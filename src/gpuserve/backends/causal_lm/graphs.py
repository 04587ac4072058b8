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
* block tables are as wide as the longest context (``ceil(context_length / block_size)``
  blocks), padded with the scratch block and masked out.

Only steps of decodes alone take a graph (a step holding a prefill chunk runs eagerly), and
only where the attention reads blocks in place with per-sequence lengths (FlashAttention's
``flash_attn_with_kvcache``): SDPA would gather every sequence's whole-width table each step.
The same static path runs without capture on any device (``capture=False``), which is how it
is tested on a CPU: the padded static step must give the same logits as the eager one.
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
    ) -> None:
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {device}")
        self.forward = forward
        self.device = device
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.scratch_block = scratch_block
        self.buckets = bucket_sizes(max_batch)
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
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.replays = 0

    def bucket(self, n: int) -> int | None:
        """The smallest bucket holding ``n`` decodes, or None past the largest."""
        for size in self.buckets:
            if size >= n:
                return size
        return None

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

    def static_batch(self, size: int) -> StepBatch:
        """The step of bucket ``size`` on the static buffers (what a graph records)."""
        b = self._buffers
        keys = self.max_blocks * self.block_size
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
                block_tables=b.block_tables[:size],
                key_mask=b.key_mask[:size],
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
        with torch.cuda.stream(stream):
            for size in self.buckets:
                self.forward(self.static_batch(size))
        torch.cuda.current_stream(self.device).wait_stream(stream)
        for size in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = self.forward(self.static_batch(size))
            self._graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured CUDA graphs of decode steps for batch sizes %s", self.buckets)

    def run(self, batch: StepBatch) -> torch.Tensor:
        """The logits of a step :meth:`takes` (float32 ``[n, vocab]``), from its bucket's
        graph (or the static step run eagerly)."""
        decode = batch.decode
        assert decode is not None
        n = batch.num_tokens
        size = self.bucket(n)
        assert size is not None
        b = self._buffers
        b.token_ids[:n].copy_(batch.token_ids, non_blocking=True)
        b.positions[:n].copy_(batch.positions, non_blocking=True)
        b.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
        width = int(decode.block_tables.shape[1])
        b.block_tables[:n, :width].copy_(decode.block_tables, non_blocking=True)
        b.block_tables[:n, width:] = self.scratch_block
        keys = width * self.block_size
        b.key_mask[:n, :, :, :keys].copy_(decode.key_mask, non_blocking=True)
        b.key_mask[:n, :, :, keys:] = False
        b.context_lens[:n].copy_(decode.context_lens, non_blocking=True)
        self._pad(n, size)
        self.replays += 1
        graph = self._graphs.get(size)
        if graph is None:
            return self.forward(self.static_batch(size))[:n]
        graph.replay()
        return self._outputs[size][:n].clone()

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


__all__ = ["DEFAULT_MAX_BATCH", "DecodeGraphs", "bucket_sizes"]
