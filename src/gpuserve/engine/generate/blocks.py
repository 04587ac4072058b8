"""The paged KV cache's block manager: fixed-size blocks, ref counts and a prefix cache.

The KV cache is ``num_blocks`` blocks of ``block_size`` token slots each (ids
``0..num_blocks-1``). A sequence's :attr:`~gpuserve.engine.generate.sequence.Sequence.block_table`
lists the blocks holding its tokens in order. This module only counts and hands out ids; the
engine owns the tensors they index.

Prefix caching: once a *full* block of a sequence is computed, it is registered under the chain
hash ``hash((parent_hash, tuple(its token ids)))`` (``parent_hash`` is the previous block's
hash, None for the first block), so an equal hash means an equal whole prefix up to and
including that block. A new sequence whose prompt starts with registered blocks shares them
(ref count + 1) and skips computing them; the block holding its last known token is never
shared, so at least one token is computed and its logits exist.

A block whose ref count drops to 0 goes back to the free list but keeps its cached content:
such a block counts as free, is evicted (its hash forgotten) only when it is handed out for
something else, least recently freed first, and a prefix match before that revives it. Blocks
that hold no cached content are handed out before any cached one.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from gpuserve.engine.generate.sequence import Sequence

__all__ = ["BlockManager", "PrefixMatch"]


@dataclass(slots=True)
class PrefixMatch:
    """The cached leading blocks of a token sequence (:meth:`BlockManager.match_prefix`).

    Attributes:
        block_ids: Ids of the cached blocks, in order (may be empty).
        block_hashes: Their chain hashes, in the same order.
        num_tokens: Tokens they hold: ``len(block_ids) * block_size``.
        num_queried: Tokens looked up (the length of the token sequence).
    """

    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_tokens: int = 0
    num_queried: int = 0


@dataclass(slots=True)
class _Block:
    """One block's bookkeeping: how many sequences hold it and the content it caches."""

    ref_count: int = 0
    #: Its chain hash while it is registered in the prefix cache; None otherwise.
    hash: int | None = None


class BlockManager:
    """Hands out KV-cache blocks to sequences, shares cached prefix blocks, frees them.

    Every method is O(blocks touched); none of them blocks or raises for lack of space (those
    return False, and the scheduler preempts or waits).

    Args:
        num_blocks: Blocks in the cache (>= 1).
        block_size: Token slots per block (>= 1).
        prefix_caching: Whether computed full blocks are cached and shared by hash.

    Attributes:
        prefix_queries_tokens: Tokens looked up in the prefix cache by successful
            :meth:`allocate` calls since creation (counter).
        prefix_hit_tokens: Of those, tokens found cached and not recomputed (counter).
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.prefix_queries_tokens = 0
        self.prefix_hit_tokens = 0
        self._blocks = [_Block() for _ in range(num_blocks)]
        # Blocks with ref count 0 in eviction order: handed out from the front. Uncached blocks
        # are put at the front, cached ones at the back (least recently freed first).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # chain hash -> block id
        self._holders: dict[int, Sequence] = {}  # seq id -> a sequence holding blocks

    # -- read-only state ------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        """Token slots in the whole cache: ``num_blocks * block_size``."""
        return self.num_blocks * self.block_size

    @property
    def num_free(self) -> int:
        """Blocks free for allocation, including freed blocks that still cache content."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (held or free)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (ref count > 0), 0..1."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def empty_slots(self) -> int:
        """Token slots in held blocks that hold no computed token: each holding sequence's
        block table past its ``num_computed`` tokens. Only full blocks are shared, so every
        empty slot is one sequence's own and none is counted twice. O(sequences holding)."""
        size = self.block_size
        return sum(len(s.block_table) * size - s.num_computed for s in self._holders.values())

    def ref_count(self, block_id: int) -> int:
        """How many sequences hold block ``block_id``."""
        return self._blocks[block_id].ref_count

    def is_cached(self, block_id: int) -> bool:
        """Whether block ``block_id`` is registered in the prefix cache."""
        return self._blocks[block_id].hash is not None

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` blocks can be handed out now."""
        return num_blocks <= len(self._free)

    # -- prefix cache ----------------------------------------------------------------------

    def match_prefix(self, token_ids: list[int]) -> PrefixMatch:
        """The longest run of cached full blocks that starts ``token_ids``. Changes nothing.

        The match covers at most ``len(token_ids) - 1`` tokens, rounded down to whole blocks,
        so the block holding the last token is always computed.

        Args:
            token_ids: A sequence's known tokens (prompt, or prompt + outputs).

        Returns:
            The matching blocks (none when prefix caching is off).
        """
        match = PrefixMatch(num_queried=len(token_ids))
        if not self.prefix_caching:
            return match
        size = self.block_size
        parent: int | None = None
        for index in range((len(token_ids) - 1) // size):
            key = hash((parent, tuple(token_ids[index * size : (index + 1) * size])))
            block_id = self._cached.get(key)
            if block_id is None:
                break
            match.block_ids.append(block_id)
            match.block_hashes.append(key)
            parent = key
        match.num_tokens = len(match.block_ids) * size
        return match

    def register_computed(self, seq: Sequence) -> None:
        """Offer ``seq``'s newly computed full blocks to the prefix cache.

        Call after ``seq.num_computed`` advanced. A block whose hash is already cached (by
        another sequence that computed the same prefix) stays private to ``seq``.
        """
        if not self.prefix_caching:
            return
        size = self.block_size
        hashes = seq.block_hashes
        for index in range(len(hashes), seq.num_computed // size):
            parent = hashes[-1] if hashes else None
            key = hash((parent, tuple(seq.token_slice(index * size, (index + 1) * size))))
            hashes.append(key)
            block = self._blocks[seq.block_table[index]]
            if block.hash is None and key not in self._cached:
                block.hash = key
                self._cached[key] = seq.block_table[index]

    # -- allocation ------------------------------------------------------------------------

    def allocate(self, seq: Sequence, match: PrefixMatch, num_new_tokens: int) -> bool:
        """Give a sequence without blocks its cached prefix and room for its first chunk.

        On success ``seq.block_table`` holds the matched blocks (shared) followed by fresh
        blocks for ``num_new_tokens`` more tokens, ``seq.num_computed`` and
        ``seq.num_cached_prompt`` are ``match.num_tokens``, and the prefix counters grow.

        Args:
            seq: A sequence holding no blocks.
            match: ``match_prefix(seq.all_ids)``, taken with no change to the cache since.
            num_new_tokens: Tokens to compute after the matched prefix in its first chunk.

        Returns:
            False (and nothing changed) when there are not enough free blocks.
        """
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        for block_id, key in zip(match.block_ids, match.block_hashes, strict=True):
            if self._blocks[block_id].hash != key:
                raise ValueError("stale prefix match: the cache changed since match_prefix")
        revived = sum(1 for b in match.block_ids if self._blocks[b].ref_count == 0)
        fresh = self.blocks_for(match.num_tokens + num_new_tokens) - len(match.block_ids)
        if revived + fresh > len(self._free):
            return False
        for block_id in match.block_ids:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        seq.block_table = list(match.block_ids)
        seq.block_hashes = list(match.block_hashes)
        seq.block_table.extend(self._take() for _ in range(fresh))
        seq.num_computed = match.num_tokens
        seq.num_cached_prompt = match.num_tokens
        self._holders[seq.seq_id] = seq
        self.prefix_queries_tokens += match.num_queried
        self.prefix_hit_tokens += match.num_tokens
        return True

    def append_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow ``seq``'s block table to hold ``num_tokens`` tokens past ``seq.num_computed``.

        Returns:
            False (and nothing changed) when there are not enough free blocks.
        """
        needed = self.blocks_for(seq.num_computed + num_tokens) - len(seq.block_table)
        if needed > len(self._free):
            return False
        seq.block_table.extend(self._take() for _ in range(needed))
        return True

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks; empties its block table and block hashes.

        Blocks are released last first, so a sequence's tail is evicted before its prefix,
        which other sequences are likelier to share.
        """
        for block_id in reversed(seq.block_table):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.hash is None:
                    self._free.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.block_hashes = []
        self._holders.pop(seq.seq_id, None)

    def _take(self) -> int:
        """Hand out the first free block, evicting the content it cached."""
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        if block.hash is not None:
            del self._cached[block.hash]
            block.hash = None
        block.ref_count = 1
        return block_id
