"""The paged KV-cache block manager: allocation, ref counts, prefix caching, LRU eviction."""

from __future__ import annotations

import pytest

from gpuserve.engine.generate.blocks import BlockManager
from gpuserve.engine.generate.sequence import Sequence


def seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", list(tokens), max_tokens=4, arrival_s=0.0)


def admit(blocks: BlockManager, s: Sequence) -> int:
    """Allocate ``s`` with its prefix match and its whole uncached prompt; return cached tokens."""
    match = blocks.match_prefix(s.all_ids)
    assert blocks.allocate(s, match, s.num_tokens - match.num_tokens)
    return match.num_tokens


def compute(blocks: BlockManager, s: Sequence) -> None:
    """Mark every known token of ``s`` computed and register its full blocks."""
    s.num_computed = s.num_tokens
    blocks.register_computed(s)


def test_allocate_and_free_count_blocks_and_refs():
    blocks = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(10)))
    assert admit(blocks, a) == 0
    assert len(a.block_table) == 3 and len(set(a.block_table)) == 3
    assert blocks.num_free == 5 and blocks.usage == pytest.approx(3 / 8)
    assert all(blocks.ref_count(b) == 1 for b in a.block_table)
    held = list(a.block_table)
    blocks.free(a)
    assert a.block_table == [] and blocks.num_free == 8 and blocks.usage == 0.0
    assert all(blocks.ref_count(b) == 0 for b in held)


def test_allocate_without_room_changes_nothing():
    blocks = BlockManager(num_blocks=2, block_size=4)
    a = seq(list(range(9)))  # 3 blocks
    assert not blocks.can_allocate(3)
    assert not blocks.allocate(a, blocks.match_prefix(a.all_ids), 9)
    assert a.block_table == [] and blocks.num_free == 2


def test_append_slots_grows_by_whole_blocks_and_refuses_when_full():
    blocks = BlockManager(num_blocks=3, block_size=4)
    a = seq(list(range(4)))
    admit(blocks, a)
    compute(blocks, a)
    assert blocks.append_slots(a, 1) and len(a.block_table) == 2
    a.num_computed = 5
    assert blocks.append_slots(a, 3) and len(a.block_table) == 2  # positions 5..7: same block
    assert not blocks.append_slots(a, 8)  # positions 5..12 need 2 more blocks, 1 is free
    assert len(a.block_table) == 2 and blocks.num_free == 1


def test_prefix_hit_shares_full_blocks_and_skips_their_tokens():
    blocks = BlockManager(num_blocks=10, block_size=4)
    a = seq(list(range(10)))
    admit(blocks, a)
    compute(blocks, a)
    assert blocks.is_cached(a.block_table[0]) and blocks.is_cached(a.block_table[1])
    assert not blocks.is_cached(a.block_table[2])  # partial block: never cached
    b = seq([*range(8), 99, 98], seq_id=1)
    assert admit(blocks, b) == 8
    assert b.num_computed == 8 and b.num_cached_prompt == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert blocks.ref_count(a.block_table[0]) == 2 and blocks.ref_count(a.block_table[2]) == 1
    assert blocks.prefix_queries_tokens == 20 and blocks.prefix_hit_tokens == 8
    # a different first block breaks the chain: the second block's tokens alone do not match
    c = seq([42, 1, 2, 3, 4, 5, 6, 7, 8], seq_id=2)
    assert blocks.match_prefix(c.all_ids).num_tokens == 0


def test_the_block_of_the_last_prompt_token_is_never_reused():
    blocks = BlockManager(num_blocks=10, block_size=4)
    a = seq(list(range(8)))
    admit(blocks, a)
    compute(blocks, a)
    assert all(blocks.is_cached(b) for b in a.block_table)
    same = seq(list(range(8)), seq_id=1)  # identical: only 7 tokens may come from the cache
    match = blocks.match_prefix(same.all_ids)
    assert match.num_tokens == 4 and match.block_ids == a.block_table[:1]
    assert blocks.match_prefix(list(range(9))).num_tokens == 8
    assert blocks.match_prefix([0]).num_tokens == 0


def test_freed_cached_blocks_count_as_free_and_revive_on_a_hit():
    blocks = BlockManager(num_blocks=4, block_size=4)
    a = seq(list(range(9)))
    admit(blocks, a)
    compute(blocks, a)
    first_two = a.block_table[:2]
    blocks.free(a)
    assert blocks.num_free == 4 and blocks.num_cached == 2
    b = seq(list(range(9)), seq_id=1)
    assert admit(blocks, b) == 8
    assert b.block_table[:2] == first_two
    assert blocks.num_free == 1 and blocks.ref_count(first_two[0]) == 1


def test_uncached_blocks_go_first_then_cached_ones_least_recently_freed_first():
    blocks = BlockManager(num_blocks=6, block_size=2)
    a = seq([1, 2, 3, 4, 5])  # blocks: [1 2] [3 4] [5]
    admit(blocks, a)
    compute(blocks, a)
    c = seq([7, 8, 9, 10, 11], seq_id=1)
    admit(blocks, c)
    compute(blocks, c)
    blocks.free(a)  # freed first: least recently used
    blocks.free(c)
    assert blocks.num_cached == 4
    # 2 fresh blocks: the two uncached partial blocks go first, nothing is evicted
    d = seq([20, 21, 22], seq_id=2)
    admit(blocks, d)
    assert blocks.num_cached == 4
    # 1 more: evicts a's tail block [3 4] (a was freed before c; a tail before its head)
    blocks.free(d)
    e = seq([30, 31, 32, 33, 34], seq_id=3)
    assert admit(blocks, e) == 0
    assert blocks.num_cached == 3
    assert blocks.match_prefix([1, 2, 3, 4, 5]).num_tokens == 2
    assert blocks.match_prefix([7, 8, 9, 10, 11]).num_tokens == 4


def test_equal_content_computed_twice_is_cached_once_and_frees_cleanly():
    blocks = BlockManager(num_blocks=6, block_size=2)
    a, b = seq([1, 2, 3], 0), seq([1, 2, 3], 1)
    admit(blocks, a)
    admit(blocks, b)  # both admitted before either was computed: no sharing
    compute(blocks, a)
    compute(blocks, b)
    assert a.block_table[0] != b.block_table[0] and blocks.num_cached == 1
    assert blocks.is_cached(a.block_table[0]) and not blocks.is_cached(b.block_table[0])
    blocks.free(a)
    blocks.free(b)
    assert blocks.num_free == 6 and blocks.match_prefix([1, 2, 3]).num_tokens == 2


def test_prefix_caching_off_never_matches():
    blocks = BlockManager(num_blocks=6, block_size=2, prefix_caching=False)
    a = seq([1, 2, 3, 4, 5])
    admit(blocks, a)
    compute(blocks, a)
    assert blocks.num_cached == 0 and blocks.match_prefix([1, 2, 3, 4, 5]).num_tokens == 0


def test_a_stale_match_is_refused():
    blocks = BlockManager(num_blocks=2, block_size=2)
    a = seq([1, 2, 3])
    admit(blocks, a)
    compute(blocks, a)
    blocks.free(a)
    match = blocks.match_prefix([1, 2, 3])
    other = seq([9, 9, 9, 9], seq_id=1)
    admit(blocks, other)  # takes both blocks: the cached one is evicted
    blocks.free(other)
    with pytest.raises(ValueError, match="stale"):
        blocks.allocate(seq([1, 2, 3], seq_id=2), match, 1)
