"""The accuracy measurement against fp32, the precision_check gate's verdicts, the CPU-feature
probe behind bf16, and the accuracy budget's parsing."""

from __future__ import annotations

import numpy as np
import pytest

from gpuserve.backends import cpu_features
from gpuserve.backends.precision_gate import (
    HELDOUT_RESOURCE,
    REFERENCE_RESOURCE,
    builtin_texts,
    compare,
    gate_problem,
)
from gpuserve.bench.tune_accuracy import AccuracyBudget, parse_accuracy_budget
from gpuserve.config.precision import PrecisionCheckConfig


def unit_rows(rng: np.random.Generator, n: int, h: int) -> np.ndarray:
    rows = rng.standard_normal((n, h))
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


def test_identical_embeddings_measure_perfect():
    rows = unit_rows(np.random.default_rng(0), 40, 16)
    report = compare("bf16", rows, rows.copy())
    assert report.cosine_min == pytest.approx(1.0) and report.cosine_mean == pytest.approx(1.0)
    assert report.max_abs_error == 0.0
    assert report.recall_at_k == 1.0 and report.k == 10 and report.texts == 40


def test_measured_values_follow_the_perturbation():
    rng = np.random.default_rng(1)
    reference = unit_rows(rng, 50, 32)
    candidate = reference.copy()
    candidate[7] = -candidate[7]  # one text's embedding flipped: cosine -1, error up to 2|x|
    report = compare("int8", candidate, reference, k=5)
    assert report.cosine_min == pytest.approx(-1.0, abs=1e-6)
    assert report.cosine_mean == pytest.approx((49 - 1) / 50, abs=1e-6)
    assert report.max_abs_error == pytest.approx(2 * np.abs(reference[7]).max(), rel=1e-6)
    assert report.recall_at_k < 1.0
    shuffled = unit_rows(rng, 50, 32)  # unrelated embeddings: neighbours mostly disagree
    assert compare("int8", shuffled, reference, k=5).recall_at_k < 0.5


def test_k_is_capped_by_the_set_and_shapes_must_match():
    rows = unit_rows(np.random.default_rng(2), 4, 8)
    assert compare("fp16", rows, rows).k == 3
    with pytest.raises(ValueError, match="cannot be compared"):
        compare("fp16", rows, rows[:3])
    with pytest.raises(ValueError, match="at least 2 texts"):
        compare("fp16", rows[:1], rows[:1])


def test_gate_names_every_broken_bound_with_measured_value():
    rng = np.random.default_rng(3)
    reference = unit_rows(rng, 30, 16)
    noisy = reference + 0.2 * rng.standard_normal(reference.shape).astype(np.float32)
    report = compare("int8", noisy, reference)
    bounds = PrecisionCheckConfig(min_cosine=0.99, max_abs_error=0.05, min_neighbour_recall=0.99)
    problem = gate_problem(report, bounds)
    assert problem is not None
    assert problem.startswith("precision int8 fails precision_check against fp32 on 30")
    assert f"min cosine {report.cosine_min:.6f} < min_cosine 0.99" in problem
    assert f"max abs error {report.max_abs_error:.6f} > max_abs_error 0.05" in problem
    assert f"recall@10 {report.recall_at_k:.4f} < min_neighbour_recall 0.99" in problem
    close = compare("bf16", reference + 1e-2 * unit_rows(rng, 30, 16), reference)
    tight = gate_problem(close, PrecisionCheckConfig(min_cosine=0.9999999))
    assert tight is not None and "< min_cosine 0.9999999" in tight  # never rounded to "1"
    loose = PrecisionCheckConfig(min_cosine=-1.0, max_abs_error=10.0, min_neighbour_recall=0.0)
    assert gate_problem(report, loose) is None


def test_precision_check_fields_are_described_and_bounded():
    for name, info in PrecisionCheckConfig.model_fields.items():
        assert info.description, name
    with pytest.raises(ValueError, match="min_cosine"):
        PrecisionCheckConfig(min_cosine=1.5)
    with pytest.raises(ValueError, match="extra"):
        PrecisionCheckConfig.model_validate({"min_cosin": 0.9})


def test_builtin_texts_are_real_sentences_and_disjoint():
    reference, heldout = builtin_texts(REFERENCE_RESOURCE), builtin_texts(HELDOUT_RESOURCE)
    assert len(reference) >= 32 and len(heldout) >= 300
    assert not set(reference) & set(heldout)
    assert all(len(t.split()) >= 4 and not t.startswith("#") for t in reference + heldout)


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu_features.cpu_flags(info) == {"fpu", "sse2", "avx512f", "avx512_bf16"}
    assert cpu_features.cpu_flags(tmp_path / "missing") == frozenset()


def test_bf16_refused_naming_the_missing_instruction_set():
    without = lambda: frozenset({"avx2", "avx512f", "avx512_vnni"})  # noqa: E731
    with pytest.raises(ValueError, match="AVX-512 BF16 or AMX-BF16") as err:
        cpu_features.require_cpu_precision("bf16", without)
    assert "avx512_bf16" in str(err.value) and "amx_bf16" in str(err.value)
    cpu_features.require_cpu_precision("bf16", lambda: frozenset({"avx512_bf16"}))
    cpu_features.require_cpu_precision("bf16", lambda: frozenset({"amx_bf16"}))
    cpu_features.require_cpu_precision("fp32", frozenset)


def test_int8_without_int8_products_loads_with_a_warning(caplog):
    """int8 runs on a core without VNNI or AMX (it is refused nowhere), but says it may be
    slower than fp32 there, naming the instruction sets it lacks."""
    caplog.set_level("WARNING", logger="gpuserve.backends.cpu_features")
    cpu_features.require_cpu_precision("int8", lambda: frozenset({"avx2", "fma"}))
    [record] = caplog.records
    assert "without int8 dot products" in record.message
    assert all(flag in record.message for flag in ("avx512_vnni", "avx_vnni", "amx_int8"))
    assert "slower than fp32" in record.message
    caplog.clear()
    for flags in ({"avx512_vnni"}, {"avx_vnni"}, {"amx_int8"}):
        cpu_features.require_cpu_precision("int8", lambda f=flags: frozenset(f))
    cpu_features.require_cpu_precision("fp32", lambda: frozenset({"avx2"}))
    assert caplog.records == []


def test_accuracy_budget_parsing_and_verdicts():
    budget = parse_accuracy_budget("cosine=0.99, recall=0.95")
    assert budget == AccuracyBudget(min_cosine=0.99, min_recall=0.95)
    assert budget.precision_check() == {"min_cosine": 0.99, "min_neighbour_recall": 0.95}
    assert parse_accuracy_budget("abs=0.01").max_abs_error == 0.01
    for bad, match in (
        ("cos=0.9", "expected cosine=X"),
        ("cosine=high", "not a number"),
        ("recall=2", r"\[-1, 1\]"),
        ("abs=-1", ">= 0"),
        ("", "no bound"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_accuracy_budget(bad)
    rows = unit_rows(np.random.default_rng(4), 20, 8)
    exact = compare("bf16", rows, rows)
    assert budget.problem(exact) is None
    flipped = rows.copy()
    flipped[0] = -flipped[0]
    assert "min cosine -1.000000 < 0.99" in (budget.problem(compare("int8", flipped, rows)) or "")
