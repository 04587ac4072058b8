"""The step costs the generation engine learns, and the prefill cap they give
(gpuserve.engine.generate.step_cost)."""

from __future__ import annotations

import pytest

from gpuserve.engine.generate.step_cost import StepCost


def test_no_cap_until_both_costs_are_known():
    cost = StepCost()
    assert cost.prefill_cap(2.0, 16) is None
    cost.observe(decodes=8, prefill_tokens=0, seconds=0.05)
    assert cost.prefill_cap(2.0, 16) is None  # no prefill seen yet
    cost.observe(decodes=8, prefill_tokens=4, seconds=0.5)  # too few tokens to learn from
    assert cost.prefill_cap(2.0, 16) is None


def test_the_cap_keeps_a_step_within_the_slowdown():
    cost = StepCost()
    cost.observe(decodes=8, prefill_tokens=0, seconds=0.050)
    cost.observe(decodes=8, prefill_tokens=200, seconds=0.050 + 200 * 0.0025)
    assert cost.decode_step_s == pytest.approx(0.050)
    assert cost.prefill_token_s == pytest.approx(0.0025)
    assert cost.prefill_cap(2.0, 16) == 20  # 0.050 s more = 20 tokens at 2.5 ms
    assert cost.prefill_cap(3.0, 16) == 40
    assert cost.prefill_cap(1.1, 16) == 16  # never below the floor: prompts progress


def test_a_prefill_only_step_is_all_prefill_and_means_move_slowly():
    cost = StepCost()
    cost.observe(decodes=4, prefill_tokens=0, seconds=0.040)
    cost.observe(decodes=0, prefill_tokens=100, seconds=0.300)
    assert cost.prefill_token_s == pytest.approx(0.003)
    cost.observe(decodes=4, prefill_tokens=0, seconds=0.140)  # one slow step
    assert cost.decode_step_s == pytest.approx(0.040 + 0.2 * 0.100)
