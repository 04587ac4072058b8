"""The residency policy (issue 18): which model to evict under the count and memory limits,
pinned and busy models, idle unload on a fake clock. Pure: no sockets, no loop."""

from __future__ import annotations

import pytest

from gpuserve.repository.ondemand.residency import (
    IDLE,
    LRU,
    MEMORY,
    Limits,
    Resident,
    expected_memory,
    idle_due,
    make_room,
    next_idle_check,
    over_budget,
)

MB = 1024 * 1024


def r(name: str, used: float, **kw) -> Resident:
    kw.setdefault("memory_bytes", {"cpu": 40 * MB})
    return Resident(name, used, **kw)


def test_no_limit_evicts_nothing():
    room = make_room([r("a", 1), r("b", 2)], "c", {"cpu": 40 * MB}, Limits())
    assert room.evict == () and room.blocked is None


def test_count_limit_evicts_least_recently_used():
    residents = [r("a", 5), r("b", 1), r("c", 3)]
    room = make_room(residents, "d", {}, Limits(max_models=3))
    assert room.evict == ("b",) and room.reason == LRU and room.blocked is None


def test_count_limit_evicts_as_many_as_needed():
    residents = [r("a", 5), r("b", 1), r("c", 3), r("d", 4)]
    assert make_room(residents, "e", {}, Limits(max_models=2)).evict == ("b", "c", "d")


def test_the_incoming_model_is_not_counted_against_itself():
    residents = [r("a", 5), r("b", 1), r("d", 9)]
    assert make_room(residents, "d", {}, Limits(max_models=3)).evict == ()


@pytest.mark.parametrize("flag", ["pinned", "busy"])
def test_pinned_and_busy_models_are_skipped(flag):
    residents = [r("a", 1, **{flag: True}), r("b", 2), r("c", 3)]
    assert make_room(residents, "d", {}, Limits(max_models=3)).evict == ("b",)


def test_nothing_evictable_is_blocked_with_the_reason():
    residents = [r("a", 1, pinned=True), r("b", 2, busy=True)]
    room = make_room(residents, "c", {}, Limits(max_models=2))
    assert room.evict == ()
    assert room.blocked == (
        "model 'c' cannot be loaded: the limit of 2 loaded models is reached and no loaded "
        "model can be unloaded now (pinned: a; busy: b)"
    )


def test_memory_limit_evicts_until_the_new_model_fits():
    residents = [r("a", 3), r("b", 1), r("c", 2)]
    room = make_room(residents, "d", {"cpu": 40 * MB}, Limits(memory_bytes=100 * MB))
    assert room.evict == ("b", "c") and room.reason == MEMORY


def test_memory_is_per_device():
    residents = [
        r("a", 1, memory_bytes={"cuda:0": 60 * MB}),
        r("b", 2, memory_bytes={"cuda:1": 60 * MB}),
    ]
    room = make_room(residents, "c", {"cuda:1": 60 * MB}, Limits(memory_bytes=100 * MB))
    assert room.evict == ("b",)


def test_a_model_larger_than_the_budget_is_served_alone_with_a_warning():
    limits = Limits(memory_bytes=100 * MB)
    room = make_room([], "a", {"cpu": 200 * MB}, limits)
    assert room.blocked is None and room.evict == ()
    assert "more than the whole loaded models memory limit" in room.alone
    assert "104857600 B" in room.alone and "served alone" in room.alone
    # every other model holding memory on that device goes first; one on another stays
    residents = [r("b", 1), r("c", 2), r("g", 3, memory_bytes={"cuda:0": 10 * MB})]
    room = make_room(residents, "a", {"cpu": 200 * MB}, limits)
    assert room.evict == ("b", "c") and room.blocked is None and room.alone
    # a model within the budget gets no warning
    assert make_room([], "a", {"cpu": 50 * MB}, limits).alone == ""


def test_a_later_model_evicts_the_large_one_served_alone():
    residents = [r("big", 5, memory_bytes={"cpu": 400 * MB})]
    room = make_room(residents, "small", {"cpu": 20 * MB}, Limits(memory_bytes=200 * MB))
    assert room.evict == ("big",) and room.blocked is None and room.reason == MEMORY


def test_blocked_by_busy_models_waits_by_pinned_ones_is_permanent():
    limits = Limits(max_models=1)
    busy = make_room([r("a", 1, busy=True)], "b", {}, limits)
    assert busy.blocked is not None and not busy.permanent
    pinned = make_room([r("a", 1, pinned=True)], "b", {}, limits)
    assert pinned.blocked is not None and pinned.permanent
    # memory: a pinned model on the device leaves a larger-than-budget model no room ever
    memory = Limits(memory_bytes=100 * MB)
    room = make_room([r("p", 1, pinned=True)], "big", {"cpu": 300 * MB}, memory)
    assert room.blocked is not None and room.permanent and "memory limit" in room.blocked
    room = make_room([r("p", 1, busy=True)], "big", {"cpu": 300 * MB}, memory)
    assert room.blocked is not None and not room.permanent


def test_over_budget_after_a_load_keeps_the_loaded_model():
    residents = [r("a", 1), r("b", 2), r("new", 9, memory_bytes={"cpu": 70 * MB})]
    room = over_budget(residents, "new", Limits(memory_bytes=120 * MB))
    assert room.evict == ("a",) and room.reason == MEMORY
    assert over_budget(residents, "new", Limits(memory_bytes=200 * MB)).evict == ()


def test_over_budget_of_a_model_larger_than_the_budget_evicts_every_other():
    residents = [r("a", 1), r("b", 2), r("big", 9, memory_bytes={"cpu": 400 * MB})]
    room = over_budget(residents, "big", Limits(memory_bytes=200 * MB))
    assert room.evict == ("a", "b") and room.blocked is None and room.alone


def test_idle_due_on_a_fake_clock():
    residents = [
        r("a", 100.0, idle_unload_s=3.0),
        r("b", 100.0, idle_unload_s=3.0, busy=True),
        r("c", 100.0, idle_unload_s=3.0, pinned=True),
        r("d", 100.0),  # never
        r("e", 101.0, idle_unload_s=3.0),
    ]
    assert idle_due(residents, 102.9) == ()
    assert idle_due(residents, 103.0) == ("a",)
    assert idle_due(residents, 104.0) == ("a", "e")
    assert next_idle_check(residents, 101.0) == pytest.approx(2.0)
    assert next_idle_check(residents, 110.0) == 0.0
    assert next_idle_check([r("d", 1.0)], 5.0) is None
    assert IDLE == "idle"


def test_expected_memory_is_own_measurement_else_its_own_estimate_never_another_models():
    measured = {"a": {"cpu": 10}, "b": {"cpu": 30}}
    assert expected_memory("a", measured, {"cpu": 99}) == {"cpu": 10}
    assert expected_memory("z", measured) == {}  # not b's 30: another model says nothing
    assert expected_memory("z", measured, {"cpu": 5}) == {"cpu": 5}


def _model_folder(root, extra: str = "", weights_bytes: int = 0):
    from gpuserve.repository.scan import read_model

    folder = root / "m"
    (folder / "1").mkdir(parents=True)
    (folder / "config.yaml").write_text(
        "backend: python\nmax_batch_size: 1\n"
        "inputs: [{name: X, datatype: FP32, shape: [1]}]\n"
        "outputs: [{name: Y, datatype: FP32, shape: [1]}]\n" + extra
    )
    (folder / "1" / "model.py").write_text("# a model\n")
    (folder / "1" / "weights.bin").write_bytes(b"\0" * weights_bytes)
    return read_model(folder)


def test_estimate_from_its_own_files_precision_and_instances(tmp_path):
    from gpuserve.repository.ondemand.estimate import expected

    entry = _model_folder(tmp_path / "a", "instance_group: [{count: 2, kind: cpu}]\n", 10 * MB)
    files = 10 * MB + len("# a model\n")
    assert expected(entry) == {"cpu": 2 * files}  # two copies of its weights
    half = _model_folder(tmp_path / "b", "precision: fp16\n", 10 * MB)
    assert expected(half) == {"cpu": files // 2}
    gpu = _model_folder(tmp_path / "c", "instance_group: [{count: 1, kind: gpu, gpus: [1]}]\n")
    assert set(expected(gpu, gpus_visible=2)) == {"cuda:1"}


def test_a_configured_expected_memory_wins_over_the_files(tmp_path):
    from gpuserve.repository.ondemand.estimate import expected

    entry = _model_folder(tmp_path, "expected_memory_bytes: 123456\n", 10 * MB)
    assert expected(entry) == {"cpu": 123456}
