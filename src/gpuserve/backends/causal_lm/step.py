"""The batch of one engine step: every sequence's tokens for this step, flattened.

The engine hands the model a list of :class:`ChunkInput` (primitive data: token ids, a start
position, a block table); :meth:`StepBatch.build` turns it into the flat tensors the forward
pass runs on, once per step, so that no layer rebuilds an index or a mask:

* the linear layers see all ``T`` tokens of the step as one ``[T, hidden]`` matrix;
* each token's K/V goes to cache slot ``block_table[p // block_size] * block_size +
  p % block_size`` (``slot_mapping``);
* decode chunks (one query token) attend together in one padded call
  (:class:`DecodeGroup`), prefill chunks one call each (:class:`PrefillSpan`). Decodes whose
  contexts differ widely (one at 2,000 keys beside short chats) attend in one call per
  :class:`DecodeBucket` instead, so that no short sequence is padded to the longest one's
  keys: on a CPU the padded call would gather and attend ``N x longest`` keys per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ChunkInput:
    """One sequence's tokens computed in this step.

    Attributes:
        token_ids: The tokens computed this step: a prefill chunk, or one token for a decode.
        start: Position of ``token_ids[0]`` in the sequence (the number of tokens whose K/V
            are already in the cache).
        block_table: Ids of the cache blocks holding positions ``0..`` of the sequence, in
            order; already long enough for ``start + len(token_ids)`` positions.
        sample: Whether the logits of the last token are wanted (the last chunk of a prompt,
            or a decode); a middle chunk of a long prompt only fills the cache.
    """

    token_ids: list[int]
    start: int
    block_table: list[int]
    sample: bool


@dataclass(slots=True)
class PrefillSpan:
    """One chunk of more than one query token (attended on its own).

    Attributes:
        offset: Index of the chunk's first token in the step's flat token tensor.
        length: Query tokens in the chunk.
        start: Position of its first token in the sequence.
        context_len: ``start + length``: the keys the last query token sees.
        blocks: int64 ``[ceil(context_len / block_size)]``, the block ids holding the keys.
        mask: bool ``[length, context_len]`` (True: may attend), or None when the chunk starts
            the sequence (``start == 0``), where plain causal attention over the chunk's own
            K/V is the same thing.
    """

    offset: int
    length: int
    start: int
    context_len: int
    blocks: torch.Tensor
    mask: torch.Tensor | None


#: A decode joins a bucket when its block table is at most twice as long as the bucket's
#: shortest, or at most this many blocks longer (padding that little costs less than a call).
BUCKET_SPREAD_BLOCKS = 16


@dataclass(slots=True)
class DecodeBucket:
    """Decodes of similar context length, attended in one padded call.

    Attributes:
        index: int64 ``[n]``, the bucket's rows among the group's ``N`` decodes.
        block_tables: int64 ``[n, width]``, their block tables padded with block 0.
        key_mask: bool ``[n, 1, 1, width * block_size]``, True for each one's real keys.
    """

    index: torch.Tensor
    block_tables: torch.Tensor
    key_mask: torch.Tensor


@dataclass(slots=True)
class DecodeGroup:
    """All chunks of one query token, attended in one padded call.

    Attributes:
        rows: int64 ``[N]``, each chunk's token index in the flat token tensor.
        block_tables: int64 ``[N, max_blocks]``, block tables padded with block 0 (its keys
            are masked out).
        key_mask: bool ``[N, 1, 1, max_blocks * block_size]``, True for the keys
            ``0..context_len-1`` of each sequence.
        context_lens: int32 ``[N]``, keys per sequence (``start + 1``).
        max_context_len: The largest of ``context_lens``.
        buckets: When the contexts differ widely (:data:`BUCKET_SPREAD_BLOCKS`), the
            decodes split by context length, each bucket padded to its own longest; empty
            when one padded call over the whole group wastes little.
    """

    rows: torch.Tensor
    block_tables: torch.Tensor
    key_mask: torch.Tensor
    context_lens: torch.Tensor
    max_context_len: int
    buckets: tuple[DecodeBucket, ...] = ()


@dataclass(slots=True)
class StepBatch:
    """The flat tensors of one step (build it with :meth:`build`).

    Attributes:
        token_ids: int64 ``[T]``, every chunk's tokens, chunk after chunk.
        positions: int64 ``[T]``, each token's position in its sequence.
        slot_mapping: int64 ``[T]``, each token's K/V slot in the cache
            (``block * block_size + offset``).
        query_starts: Per chunk, the index of its first token in ``token_ids``.
        query_lens: Per chunk, its number of tokens.
        context_lens: Per chunk, ``start + query_len`` (the keys its last token sees).
        block_tables: Per chunk, its block table (as given).
        logits_rows: int64 ``[R]``, the index of the last token of each chunk with
            ``sample`` set, in chunk order: the rows of the logits the forward pass returns.
        block_size: Tokens per cache block.
        prefills: The chunks of more than one token, in chunk order.
        decode: The chunks of one token together, or None when there are none.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_starts: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    logits_rows: torch.Tensor
    block_size: int
    prefills: list[PrefillSpan]
    decode: DecodeGroup | None

    @property
    def num_tokens(self) -> int:
        """``T``, the tokens computed in this step."""
        return int(self.token_ids.shape[0])

    @classmethod
    def build(
        cls, chunks: list[ChunkInput], block_size: int, device: torch.device | str = "cpu"
    ) -> StepBatch:
        """Flatten ``chunks`` into the tensors of one step, on ``device``.

        Raises:
            ValueError: no chunks, an empty chunk, a negative start, or a block table too
                short for ``start + len(token_ids)`` positions.
        """
        if not chunks:
            raise ValueError("a step needs at least one chunk")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_starts: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        logits_rows: list[int] = []
        prefills: list[PrefillSpan] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        offset = 0
        for index, chunk in enumerate(chunks):
            length = len(chunk.token_ids)
            end = chunk.start + length
            if length == 0 or chunk.start < 0:
                raise ValueError(
                    f"chunk {index}: needs at least one token and start >= 0, got "
                    f"{length} tokens at start {chunk.start}"
                )
            if len(chunk.block_table) * block_size < end:
                raise ValueError(
                    f"chunk {index}: block table of {len(chunk.block_table)} blocks of "
                    f"{block_size} cannot hold {end} positions"
                )
            table = chunk.block_table
            token_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start, end))
            slots.extend(
                table[p // block_size] * block_size + p % block_size
                for p in range(chunk.start, end)
            )
            query_starts.append(offset)
            query_lens.append(length)
            context_lens.append(end)
            if chunk.sample:
                logits_rows.append(offset + length - 1)
            if length == 1:
                decode_rows.append(offset)
                decode_tables.append(table[: -(-end // block_size)])
                decode_lens.append(end)
            else:
                mask = None
                if chunk.start > 0:
                    keys = torch.arange(end, dtype=torch.int64)
                    queries = torch.arange(chunk.start, end, dtype=torch.int64)
                    mask = (keys[None, :] <= queries[:, None]).to(device)
                prefills.append(
                    PrefillSpan(
                        offset=offset,
                        length=length,
                        start=chunk.start,
                        context_len=end,
                        blocks=torch.tensor(table[: -(-end // block_size)], dtype=torch.int64).to(
                            device
                        ),
                        mask=mask,
                    )
                )
            offset += length
        return cls(
            token_ids=torch.tensor(token_ids, dtype=torch.int64).to(device),
            positions=torch.tensor(positions, dtype=torch.int64).to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device),
            query_starts=query_starts,
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=[chunk.block_table for chunk in chunks],
            logits_rows=torch.tensor(logits_rows, dtype=torch.int64).to(device),
            block_size=block_size,
            prefills=prefills,
            decode=_decode_group(decode_rows, decode_tables, decode_lens, block_size, device)
            if decode_rows
            else None,
        )


def _decode_group(
    rows: list[int],
    tables: list[list[int]],
    context_lens: list[int],
    block_size: int,
    device: torch.device | str,
) -> DecodeGroup:
    padded, key_mask = _padded(tables, context_lens, block_size)
    groups = _bucket_rows([len(table) for table in tables])
    buckets: tuple[DecodeBucket, ...] = ()
    if len(groups) > 1:
        buckets = tuple(
            DecodeBucket(
                torch.tensor(group, dtype=torch.int64).to(device),
                *(
                    t.to(device)
                    for t in _padded(
                        [tables[i] for i in group], [context_lens[i] for i in group], block_size
                    )
                ),
            )
            for group in groups
        )
    return DecodeGroup(
        rows=torch.tensor(rows, dtype=torch.int64).to(device),
        block_tables=padded.to(device),
        key_mask=key_mask.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32).to(device),
        max_context_len=max(context_lens),
        buckets=buckets,
    )


def _padded(
    tables: list[list[int]], context_lens: list[int], block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables padded with block 0 (int64 ``[n, width]``) and their key mask (bool
    ``[n, 1, 1, width * block_size]``)."""
    width = max(len(table) for table in tables)
    padded = torch.zeros((len(tables), width), dtype=torch.int64)
    for i, table in enumerate(tables):
        padded[i, : len(table)] = torch.tensor(table, dtype=torch.int64)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    keys = torch.arange(width * block_size, dtype=torch.int32)
    return padded, (keys[None, :] < lens[:, None]).view(len(tables), 1, 1, -1)


def _bucket_rows(widths: list[int]) -> list[list[int]]:
    """Rows (indices into ``widths``, block-table lengths) grouped shortest first: a row
    opens a new bucket when it is more than twice as long as the current bucket's shortest
    and more than :data:`BUCKET_SPREAD_BLOCKS` longer."""
    order = sorted(range(len(widths)), key=widths.__getitem__)
    groups = [[order[0]]]
    for i in order[1:]:
        shortest = widths[groups[-1][0]]
        if widths[i] > 2 * shortest and widths[i] - shortest > BUCKET_SPREAD_BLOCKS:
            groups.append([i])
        else:
            groups[-1].append(i)
    return groups
