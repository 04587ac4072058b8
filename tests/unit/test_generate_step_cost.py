"""The step costs the generation engine learns, and the prompt tokens they allow a step
(gpuserve.engine.generate.step_cost). Times are made up: no clock is read."""

from __future__ import annotations

import math

import pytest

from gpuserve.engine.generate.step_cost import (
    PRIOR_DOUBLING_TOKENS,
    PrefillAllowance,
    StepCost,
)


def _granted(allowance: PrefillAllowance, start: int, wanted: int = 10_000) -> int:
    n = allowance.fit(start, wanted)
    allowance.spend(start, n)
    return n


def test_before_a_decode_step_is_timed_a_step_with_decodes_carries_no_prompt():
    cost = StepCost(slowdown=2.0, floor=16)
    assert cost.allowance(8).fit(0, 500) == 0  # the step runs decodes alone and is timed
    cost.observe(decodes=8, prefill=[], seconds=0.100)
    assert cost.allowance(8).fit(0, 500) == 16  # no prefill timed yet: one block
    cost.observe(decodes=8, prefill=[(0, 4)], seconds=0.5)  # too few tokens to learn from
    assert cost.allowance(8).fit(0, 500) == 16


def test_flat_costs_keep_a_step_within_the_slowdown():
    cost = StepCost(slowdown=2.0, floor=16)
    cost.observe(decodes=8, prefill=[], seconds=0.100)
    cost.observe(decodes=8, prefill=[(0, 200)], seconds=0.100 + 200 * 0.002)
    assert cost.decode_step_s == {8: pytest.approx(0.100)}
    a, b, _ = cost.token_costs() or (0.0, 0.0, 0.0)
    # one sample at mean position 99.5: the prior slope (doubling at 1,024) splits its cost
    assert a + b * 99.5 == pytest.approx(0.002)
    assert b == pytest.approx(a / PRIOR_DOUBLING_TOKENS)
    # 0.100 s of prefill at about 1.8 ms a token near position 0
    assert _granted(cost.allowance(8), 0) == 53
    untimed = StepCost(3.0, 16, {8: 0.1}).allowance(8)  # no prefill timed
    assert [_granted(untimed, 0), _granted(untimed, 0)] == [16, 0]
    tight = StepCost(1.1, 16)
    tight.observe(8, [], 0.100)
    tight.observe(8, [(0, 200)], 0.500)
    assert tight.allowance(8).fit(0, 500) == 16  # never below the floor: prompts progress


def test_a_token_deep_in_a_prompt_costs_more_and_its_chunk_is_cut_shorter():
    """Steps of 8 decodes (100 ms) and a 100-token chunk at positions 0..1,900, where a
    token costs 1 ms + 1 us per position: the fit finds both, and a step keeps its prefill
    to 100 ms wherever the chunk starts."""
    cost = StepCost(slowdown=2.0, floor=16)
    cost.observe(8, [], 0.100)
    for start in range(0, 2000, 100):
        seconds = 0.100 + 100 * (0.001 + 1e-6 * (start + 49.5))
        cost.observe(8, [(start, 100)], seconds)
    a, b, c = cost.token_costs() or (0.0, 0.0, 0.0)
    assert a == pytest.approx(0.001, rel=0.05) and b == pytest.approx(1e-6, rel=0.1)
    assert c == pytest.approx(0.0, abs=1e-3)
    early, late = cost.allowance(8), cost.allowance(8)
    n_early, n_late = _granted(early, 0), _granted(late, 1800)
    assert n_early > 90 and n_late < 40
    for start, n in ((0, n_early), (1800, n_late)):
        true = n * (0.001 + 1e-6 * (start + (n - 1) / 2))
        assert 0.090 < true <= 0.1005  # the step stays within 2 x its decodes


def test_decode_steps_are_timed_per_batch_size():
    cost = StepCost(slowdown=2.0, floor=16)
    cost.observe(decodes=2, prefill=[], seconds=0.050)
    cost.observe(decodes=8, prefill=[], seconds=0.130)
    assert cost.decode_s(2) == pytest.approx(0.050)
    assert cost.decode_s(8) == pytest.approx(0.130)
    assert cost.decode_s(5) == pytest.approx(0.050)  # unseen: the smaller step, cautious
    assert cost.decode_s(1) == pytest.approx(0.025)  # none smaller: scaled down
    cost.observe(decodes=2, prefill=[], seconds=0.150)  # one slow step moves the mean a fifth
    assert cost.decode_s(2) == pytest.approx(0.050 + 0.2 * 0.100)
    cost.observe(decodes=2, prefill=[(0, 100)], seconds=0.070 + 0.100)
    a, b, _ = cost.token_costs() or (0.0, 0.0, 0.0)
    assert a + b * 49.5 == pytest.approx(0.001)  # beyond the decodes of 2, per token


def test_chunks_share_a_step_and_the_first_always_gets_the_floor():
    allowance = PrefillAllowance(
        seconds=0.010, token_s=0.001, position_s=0.0, chunk_s=0.0, floor=16
    )
    assert allowance.fit(0, 5) == 5  # what is wanted, when less fits
    assert _granted(allowance, 0) == 16  # 10 fit; the first chunk gets the floor
    assert allowance.seconds == pytest.approx(-0.006)
    assert allowance.fit(0, 100) == 0  # the next gets nothing
    unlimited = PrefillAllowance(math.inf, 0.001, 0.0, 0.0, 16)
    assert unlimited.fit(7, 300) == 300
    shared = PrefillAllowance(seconds=0.030, token_s=0.001, position_s=0.0, chunk_s=0.0, floor=1)
    assert [_granted(shared, 0, 12), _granted(shared, 0)] == [12, 18]


def test_a_prefill_only_step_teaches_the_token_cost():
    cost = StepCost()
    cost.observe(decodes=0, prefill=[(0, 512)], seconds=0.512)
    a, b, _ = cost.token_costs() or (0.0, 0.0, 0.0)
    assert a + b * 255.5 == pytest.approx(0.001)
    cost.observe(decodes=0, prefill=[(0, 0)], seconds=1.0)  # nothing computed: ignored
    cost.observe(decodes=4, prefill=[], seconds=0.0)  # no time: ignored
    assert cost.decode_step_s == {}


def test_small_chunks_cost_more_per_token_and_the_fit_finds_the_chunk_cost():
    """A chunk costs 20 ms plus 1 ms a token (no growth with position): after chunks of 16
    to 200 tokens, a step's allowance is what fits beside one chunk's cost."""
    cost = StepCost(slowdown=2.0, floor=16)
    cost.observe(8, [], 0.100)
    for n in (16, 200, 40, 120, 16, 64, 200, 30) * 3:
        cost.observe(8, [(0, n)], 0.100 + 0.020 + 0.001 * n)
    a, _, c = cost.token_costs() or (0.0, 0.0, 0.0)
    assert a == pytest.approx(0.001, rel=0.1) and c == pytest.approx(0.020, rel=0.15)
    n = _granted(cost.allowance(8), 0)
    assert 70 <= n <= 82  # 0.100 s = 20 ms + 80 tokens
    two = cost.allowance(8)  # a chunk of 30 (about 50 ms), then one of 30 beside its cost
    assert _granted(two, 0, 30) == 30 and 26 <= _granted(two, 0) <= 36
