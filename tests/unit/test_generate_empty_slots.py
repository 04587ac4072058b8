"""BlockManager.empty_slots: token slots in held blocks that hold no computed token."""

from __future__ import annotations

from gpuserve.engine.generate.blocks import BlockManager
from gpuserve.engine.generate.sequence import Sequence


def seq(tokens: list[int], seq_id: int) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", list(tokens), max_tokens=8, arrival_s=0.0)


def test_empty_slots_follow_a_scripted_allocate_append_free_sequence() -> None:
    blocks = BlockManager(num_blocks=16, block_size=4)
    assert blocks.empty_slots == 0

    a = seq(list(range(10)), 1)  # 10 prompt tokens: 3 blocks, 12 slots
    assert blocks.allocate(a, blocks.match_prefix(a.all_ids), 10)
    assert blocks.empty_slots == 12  # allocated, nothing computed yet
    a.num_computed = 10
    blocks.register_computed(a)
    assert blocks.empty_slots == 2

    a.output_ids.append(100)  # decode: the sampled token's slot is in the tail block
    assert blocks.append_slots(a, 1) and len(a.block_table) == 3
    a.num_computed = 11
    assert blocks.empty_slots == 1
    a.output_ids.append(101)
    a.num_computed = 12  # the tail block is full
    assert blocks.empty_slots == 0
    a.output_ids.append(102)
    assert blocks.append_slots(a, 1) and len(a.block_table) == 4
    assert blocks.empty_slots == 4  # a fresh block, its slot not yet computed
    a.num_computed = 13
    assert blocks.empty_slots == 3

    # b shares a's two full prompt blocks (8 tokens): they are full, so only b's own tail counts
    b = seq([*range(8), 50, 51, 52], 2)
    match = blocks.match_prefix(b.all_ids)
    assert match.num_tokens == 8
    assert blocks.allocate(b, match, 3)
    assert blocks.ref_count(b.block_table[0]) == 2
    assert blocks.empty_slots == 3 + 4
    b.num_computed = 11
    assert blocks.empty_slots == 3 + 1

    blocks.free(a)  # a's private blocks go; the shared ones stay with b
    assert blocks.empty_slots == 1
    blocks.free(b)
    assert blocks.empty_slots == 0 and blocks.usage == 0.0


def test_a_refused_allocation_or_a_preemption_leaves_no_empty_slots_behind() -> None:
    blocks = BlockManager(num_blocks=2, block_size=4)
    big = seq(list(range(9)), 1)  # 3 blocks: more than there are
    assert not blocks.allocate(big, blocks.match_prefix(big.all_ids), 9)
    assert blocks.empty_slots == 0
    small = seq(list(range(5)), 2)
    assert blocks.allocate(small, blocks.match_prefix(small.all_ids), 5)
    small.num_computed = 5
    assert blocks.empty_slots == 3
    blocks.free(small)  # preempted: its KV freed, recomputed later
    small.num_computed = 0
    assert blocks.empty_slots == 0
    assert blocks.allocate(small, blocks.match_prefix(small.all_ids), 5)
    assert blocks.empty_slots == 8
