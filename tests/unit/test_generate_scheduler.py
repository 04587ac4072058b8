"""The continuous-batching scheduler as a pure state machine, on a fake clock."""

from __future__ import annotations

import math
import random

import pytest

from gpuserve.engine.generate.blocks import BlockManager
from gpuserve.engine.generate.scheduler import GenerationScheduler, StepPlan
from gpuserve.engine.generate.sequence import Sequence, SequenceStatus
from gpuserve.engine.generate.step_cost import PrefillAllowance
from gpuserve.errors import InvalidInputError


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def token_for(seq_id: int, index: int) -> int:
    """The 'model': output ``index`` of sequence ``seq_id`` depends on nothing else."""
    return 1000 + 37 * seq_id + index


def make(
    seq_id: int,
    prompt: int | list[int],
    max_tokens: int = 4,
    arrival_s: float | None = None,
    deadline_s: float | None = None,
) -> Sequence:
    ids = list(range(100 * seq_id, 100 * seq_id + prompt)) if isinstance(prompt, int) else prompt
    arrival = float(seq_id) if arrival_s is None else arrival_s
    return Sequence(seq_id, f"r{seq_id}", ids, max_tokens, arrival, deadline_s)


def scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_running: int = 8,
    budget: int = 64,
    prefix_caching: bool = True,
) -> tuple[GenerationScheduler, FakeClock]:
    clock = FakeClock()
    blocks = BlockManager(num_blocks, block_size, prefix_caching)
    return GenerationScheduler(blocks, max_running, budget, clock), clock


def step(s: GenerationScheduler) -> StepPlan | None:
    """Schedule, then :func:`run` the plan."""
    plan = s.schedule()
    if plan is not None:
        run(s, plan)
    return plan


def run(s: GenerationScheduler, plan: StepPlan) -> None:
    """'Run the model', complete, and finish the sequences that reached max_tokens."""
    assert plan.num_tokens == sum(len(c.token_ids) for c in plan.chunks)
    assert plan.num_tokens <= s.max_tokens_per_step
    sampled = {
        c.seq.seq_id: token_for(c.seq.seq_id, len(c.seq.output_ids))
        for c in plan.chunks
        if c.samples
    }
    s.complete(plan, sampled)
    for c in plan.chunks:
        if c.samples and len(c.seq.output_ids) >= c.seq.max_tokens:
            s.finish(c.seq.seq_id, "length")


def chunk_of(plan: StepPlan, seq_id: int) -> list[int] | None:
    for c in plan.chunks:
        if c.seq.seq_id == seq_id:
            return c.token_ids
    return None


def test_nothing_to_do_is_none():
    s, _ = scheduler()
    assert s.schedule() is None and not s.has_work()


def test_a_sequence_prefills_then_decodes_one_token_per_step_until_finished():
    s, clock = scheduler()
    a = make(0, 6, max_tokens=3)
    s.add(a)
    clock.now = 2.5
    plan = step(s)
    assert plan is not None and plan.chunks[0].start == 0 and plan.chunks[0].samples
    assert chunk_of(plan, 0) == a.prompt_ids and a.first_token_s == 2.5
    plan = step(s)
    assert plan is not None and chunk_of(plan, 0) == [token_for(0, 0)]
    assert plan.chunks[0].start == 6
    step(s)
    assert a.status is SequenceStatus.FINISHED and a.finish_reason == "length"
    assert a.output_ids == [token_for(0, i) for i in range(3)]
    assert s.blocks.num_free == s.blocks.num_blocks and s.schedule() is None


def test_a_long_prompt_alone_takes_ceil_n_over_budget_steps():
    s, _ = scheduler(num_blocks=300, block_size=16, budget=512)
    a = make(0, 1030, max_tokens=2)
    s.add(a)
    sizes, samples = [], []
    while a.first_token_s is None:
        plan = step(s)
        assert plan is not None
        sizes.append(len(plan.chunks[0].token_ids))
        samples.append(plan.chunks[0].samples)
    assert sizes == [512, 512, 6] and samples == [False, False, True]


def test_chunked_prefill_keeps_running_decodes_flowing():
    s, _ = scheduler(num_blocks=300, block_size=16, budget=512)
    d = make(0, 10, max_tokens=100)
    s.add(d)
    step(s)  # d prefilled, now decoding
    long = make(1, 4000, max_tokens=2)
    s.add(long)
    steps = 0
    while long.first_token_s is None:
        plan = step(s)
        assert plan is not None
        steps += 1
        assert plan.chunks[0].seq is d and len(plan.chunks[0].token_ids) == 1
        assert plan.chunks[0].samples
        assert plan.num_tokens == 512 or long.first_token_s is not None
    assert steps == math.ceil(4000 / 511) == 8
    assert len(d.output_ids) == 1 + steps


def test_admissions_share_what_is_left_of_the_budget_fifo():
    s, _ = scheduler(budget=10)
    a, b, c = make(0, 6), make(1, 6), make(2, 6)
    for x in (a, b, c):
        s.add(x)
    plan = step(s)
    assert plan is not None
    assert [(ch.seq.seq_id, len(ch.token_ids)) for ch in plan.chunks] == [(0, 6), (1, 4)]
    assert plan.num_tokens == 10 and s.num_waiting == 1
    plan = step(s)  # a decodes (1), b finishes its prompt (2), c's whole prompt fits (6)
    assert plan is not None
    assert [(ch.seq.seq_id, len(ch.token_ids)) for ch in plan.chunks] == [(0, 1), (1, 2), (2, 6)]
    assert [ch.samples for ch in plan.chunks] == [True, True, True]


def test_max_running_is_respected():
    s, _ = scheduler(max_running=2)
    seqs = [make(i, 3, max_tokens=2) for i in range(5)]
    for x in seqs:
        s.add(x)
    plan = step(s)
    assert plan is not None and {c.seq.seq_id for c in plan.chunks} == {0, 1}
    assert s.num_running == 2 and s.num_waiting == 3
    step(s)  # 0 and 1 finish
    plan = step(s)
    assert plan is not None and {c.seq.seq_id for c in plan.chunks} == {2, 3}
    while step(s) is not None:
        assert s.num_running <= 2
    assert all(len(x.output_ids) == 2 for x in seqs)


def test_a_cached_prefix_is_not_recomputed():
    s, _ = scheduler(block_size=16)
    shared = list(range(40))
    a = make(0, shared, max_tokens=1)
    s.add(a)
    step(s)
    b = make(1, [*shared], max_tokens=1)
    s.add(b)
    plan = s.schedule()
    assert plan is not None
    (chunk,) = plan.chunks
    assert chunk.start == 32 and chunk.token_ids == shared[32:] and chunk.samples
    assert b.num_cached_prompt == 32
    assert s.stats().prefix_hit_tokens == 32 and s.stats().prefix_queries_tokens == 80


def test_preemption_takes_the_newest_puts_it_first_and_it_completes_the_same():
    # 4 blocks of 4 tokens; a and b need 3 blocks each at the end: they cannot both fit
    s, _ = scheduler(num_blocks=4, block_size=4, max_running=2, prefix_caching=False)
    a, b, c = make(0, 4, max_tokens=8), make(1, 4, max_tokens=8), make(2, 2, max_tokens=2)
    for x in (a, b, c):
        s.add(x)
    preempted: list[Sequence] = []
    while not preempted:
        plan = s.schedule()
        assert plan is not None
        if plan.preempted:
            preempted = plan.preempted
            outputs_then = list(b.output_ids)
            assert [x.seq_id for x in s.waiting] == [1, 2]  # b in front of c, which came later
            assert b.block_table == [] and b.num_computed == 0
            assert b.status is SequenceStatus.WAITING and b.output_ids == outputs_then != []
            assert chunk_of(plan, 0) is not None and chunk_of(plan, 2) is None
        run(s, plan)
    assert preempted == [b] and b.preemptions == 1 and s.num_preemptions >= 1
    recompute = None
    while (plan := step(s)) is not None:
        if recompute is None:
            recompute = next((x for x in plan.chunks if x.seq is b), None)
    # readmitted, b recomputes its prompt and the outputs it had, then samples the next one
    assert recompute is not None and recompute.start == 0 and recompute.samples
    assert recompute.token_ids == b.prompt_ids + outputs_then
    for x in (a, b, c):
        assert x.output_ids == [token_for(x.seq_id, i) for i in range(x.max_tokens)]
    assert s.blocks.num_free == 4


def test_a_sequence_that_can_never_fit_is_refused():
    s, _ = scheduler(num_blocks=4, block_size=4)
    with pytest.raises(InvalidInputError, match=r"needs 17 tokens.*16 tokens"):
        s.add(make(0, 10, max_tokens=7))
    s.add(make(1, 10, max_tokens=6))
    with pytest.raises(InvalidInputError):
        s.add(make(2, [], max_tokens=1))


def test_cancel_a_waiting_sequence_reports_it_in_the_next_plan():
    s, _ = scheduler(max_running=1)
    a, b = make(0, 5, max_tokens=9), make(1, 5)
    s.add(a)
    s.add(b)
    step(s)
    assert s.cancel(1) and s.num_waiting == 0
    assert b.status is SequenceStatus.FINISHED and b.finish_reason == "abort"
    plan = step(s)
    assert plan is not None and plan.aborted == [b]
    assert not s.cancel(1)


def test_cancel_a_running_sequence_frees_its_blocks_at_the_next_schedule():
    s, _ = scheduler()
    start = s.blocks.num_free
    a, b = make(0, 9, max_tokens=9), make(1, 5, max_tokens=9)
    s.add(a)
    s.add(b)
    plan = s.schedule()  # a step in flight ...
    assert plan is not None
    assert s.cancel(0)  # ... keeps a's blocks until it completes
    assert a.status is SequenceStatus.RUNNING and a.block_table
    s.complete(plan, {0: 5, 1: 6})
    plan = s.schedule()
    assert plan is not None and plan.aborted == [a] and chunk_of(plan, 0) is None
    assert a.finish_reason == "abort" and a.block_table == []
    s.complete(plan, {})
    s.cancel(1)
    assert s.schedule() is not None and s.schedule() is None
    assert s.blocks.num_free == start and s.num_running == 0


def test_deadlines_expire_waiting_and_running_sequences():
    s, clock = scheduler(max_running=1)
    a = make(0, 5, max_tokens=50, deadline_s=10.0)
    b = make(1, 5, max_tokens=50, deadline_s=5.0)
    c = make(2, 5, max_tokens=2)
    for x in (a, b, c):
        s.add(x)
    step(s)
    clock.now = 5.0
    plan = step(s)
    assert plan is not None and plan.expired == [b] and b.finish_reason == "timeout"
    assert chunk_of(plan, 0) is not None
    clock.now = 11.0
    plan = step(s)
    assert plan is not None and plan.expired == [a] and a.block_table == []
    assert chunk_of(plan, 2) is not None  # c got a's place
    while step(s) is not None:
        pass
    assert s.blocks.num_free == s.blocks.num_blocks and len(c.output_ids) == 2


def check_invariants(s: GenerationScheduler, plan: StepPlan) -> None:
    blocks = s.blocks
    size = blocks.block_size
    assert plan.num_tokens <= s.max_tokens_per_step and s.num_running <= s.max_running
    for chunk in plan.chunks:
        x = chunk.seq
        end = chunk.start + len(chunk.token_ids)
        assert chunk.start == x.num_computed and chunk.token_ids == x.all_ids[chunk.start : end]
        assert len(x.block_table) * size >= end and chunk.samples == (end == x.num_tokens)
    for x in s.waiting:
        assert x.block_table == []
    owners: dict[int, list[tuple[Sequence, int]]] = {}
    for x in s.running:
        for index, block in enumerate(x.block_table):
            owners.setdefault(block, []).append((x, index))
    for block, held in owners.items():
        assert blocks.ref_count(block) == len(held)
        if len(held) > 1:  # shared: a cached full block, the same prefix in every holder
            assert blocks.is_cached(block)
            index = held[0][1]
            contents = set()
            for x, i in held:
                assert i == index and (index + 1) * size <= x.num_computed
                contents.add(tuple(x.all_ids[: (index + 1) * size]))
            assert len(contents) == 1
    assert blocks.num_free == blocks.num_blocks - len(owners)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_runs_to_completion(seed: int):
    rng = random.Random(seed)
    s, clock = scheduler(num_blocks=24, block_size=4, max_running=6, budget=24)
    bases = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    pending = []
    for i in range(60):
        tail = [rng.randrange(50) for _ in range(rng.randint(1, 30))]
        prompt = rng.choice(bases)[: rng.randint(0, 12)] + tail if rng.random() < 0.6 else tail
        max_tokens = rng.randint(1, min(20, 96 - len(prompt)))
        pending.append(make(i, prompt, max_tokens=max_tokens, arrival_s=float(i)))
    added: list[Sequence] = []
    for _ in range(20_000):
        while pending and rng.random() < 0.5:
            added.append(pending.pop(0))
            s.add(added[-1])
        clock.now += 1.0
        plan = s.schedule()
        if plan is None:
            if not pending:
                break
            continue
        check_invariants(s, plan)
        run(s, plan)
    assert not pending and len(added) == 60
    for x in added:
        assert x.status is SequenceStatus.FINISHED and x.finish_reason == "length"
        assert x.output_ids == [token_for(x.seq_id, i) for i in range(x.max_tokens)]
    assert s.blocks.num_free == s.blocks.num_blocks and s.blocks.usage == 0.0
    assert s.num_preemptions > 0  # the cache was small enough to exercise preemption
    assert s.blocks.prefix_hit_tokens > 0  # and the shared prefixes were found


class _Cap:
    """A prefill limit of ``tokens`` prompt tokens a step (1 s a token, plus
    ``per_position_s`` for each position), recording the decodes it was asked for."""

    def __init__(self, tokens: int, per_position_s: float = 0.0) -> None:
        self.tokens = tokens
        self.per_position_s = per_position_s
        self.asked: list[int] = []

    def allowance(self, decodes: int) -> PrefillAllowance:
        self.asked.append(decodes)
        return PrefillAllowance(float(self.tokens), 1.0, self.per_position_s, 0.0, floor=0)


def test_a_prefill_limit_holds_prompt_chunks_while_sequences_decode():
    s, _ = scheduler(budget=64)
    s.add(make(1, 3, max_tokens=50))
    step(s)  # seq 1's prompt: it decodes from now on
    s.add(make(2, 40, max_tokens=2))
    s.add(make(3, 40, max_tokens=2))
    cap = _Cap(10)
    plan = s.schedule(cap)
    assert cap.asked == [1]
    assert chunk_of(plan, 1) is not None and len(chunk_of(plan, 1)) == 1  # its decode
    assert len(chunk_of(plan, 2)) == 10 and chunk_of(plan, 3) is None  # 10 prompt tokens in all
    run(s, plan)
    plan = s.schedule(cap)  # seq 2 goes on; seq 3 is admitted with what is left
    assert len(chunk_of(plan, 2)) == 10 and chunk_of(plan, 3) is None
    run(s, plan)
    assert s.schedule(None).num_tokens == 1 + 20 + 40  # no limit: the budget rules


def test_a_chunk_deeper_in_its_prompt_gets_fewer_tokens():
    s, _ = scheduler(budget=64)
    s.add(make(1, 3, max_tokens=50))
    step(s)
    s.add(make(2, 60, max_tokens=2))
    cap = _Cap(20, per_position_s=0.05)  # a token at position p costs 1 + p / 20 s
    lengths = []
    for _ in range(3):
        plan = s.schedule(cap)
        lengths.append(len(chunk_of(plan, 2)))
        run(s, plan)
    # 20 s each: 14 tokens from 0 (18.55 s), 10 from 14 (19.25 s), 8 from 24 (19 s)
    assert lengths == [14, 10, 8]


def test_without_decodes_a_prefill_limit_does_not_apply():
    s, _ = scheduler(budget=64)
    s.add(make(1, 40, max_tokens=2))
    cap = _Cap(10)
    plan = s.schedule(cap)
    assert len(chunk_of(plan, 1)) == 40  # nothing decodes: nobody to hold back
    assert cap.asked == []
