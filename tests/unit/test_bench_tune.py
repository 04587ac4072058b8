"""The tuner's search and report, with the measurement replaced by a synthetic model."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpuserve.bench.loadgen import LevelResult
from gpuserve.bench.stats import WindowStats
from gpuserve.bench.tune import Candidate, SearchSpace, Tuner, TuneSettings
from gpuserve.bench.tune_report import why, write_config, write_report
from gpuserve.config import parse_model_config

CONFIG = {
    "backend": "python",
    "max_batch_size": 8,
    "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [16]}],
    "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [16]}],
    "dynamic_batching": {"max_queue_delay_us": 2000},
    "parameters": {"keep": "me"},
}


def level(conc: float, throughput: float, p99_ms: float, errors=None) -> LevelResult:
    stats = WindowStats(
        1.0,
        100,
        100,
        errors or {},
        throughput,
        {50: p99_ms / 2, 90: p99_ms, 95: p99_ms, 99: p99_ms},
        p99_ms / 2,
        p99_ms,
    )
    return LevelResult("concurrency", conc, stats, [stats], True)


def synthetic(candidate: Candidate) -> list[LevelResult]:
    """Throughput peaks at mbs=32 and 2 instances; fp16 is faster; delay costs latency."""
    speed = 1000 - 10 * abs(candidate.max_batch_size - 32) - 100 * abs(candidate.instance_count - 2)
    speed *= 1.2 if candidate.precision == "fp16" else 1.0
    levels = []
    for conc in (1, 2, 4, 8):
        p99 = 1000 * conc / speed * 8 + candidate.max_queue_delay_us / 1000
        levels.append(level(conc, speed * min(1.0, conc / 4), p99))
    return levels


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "repo" / "toy"
    (folder / "1").mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    return folder


def make_tuner(model_dir: Path, monkeypatch, measure=synthetic, **settings) -> Tuner:
    space = SearchSpace(
        max_batch_size=[8, 16, 32, 64],
        max_queue_delay_us=[0, 2000, 10000],
        instance_count=[1, 2, 4],
        preferred=["none", "max"],
        precision=["fp32", "fp16"],
        adaptive=[None],
    )
    tuner = Tuner(
        model_dir,
        space,
        TuneSettings(latency_budget_ms=40, confirm=0, **settings),
        log=lambda line: None,
    )
    calls = []

    def fake(candidate):
        calls.append(candidate)
        return measure(candidate), "ok", ""

    monkeypatch.setattr(tuner, "measure", fake)
    tuner.calls = calls  # type: ignore[attr-defined]
    return tuner


def test_coordinate_descent_finds_the_best_without_a_grid(model_dir, monkeypatch):
    tuner = make_tuner(model_dir, monkeypatch)
    result = tuner.run()
    best = result.winner.candidate
    assert (best.max_batch_size, best.instance_count, best.precision) == (32, 2, "fp16")
    grid = 4 * 3 * 3 * 2 * 2
    assert len(tuner.calls) < grid / 4
    assert len(set(tuner.calls)) == len(tuner.calls)  # nothing measured twice
    assert result.baseline.phase == "baseline" and result.evaluations[0] is result.baseline


def test_score_is_best_throughput_within_budget(model_dir, monkeypatch):
    tuner = make_tuner(model_dir, monkeypatch)
    evaluation = tuner.evaluate(Candidate(8, 2000, 1, "none", "fp32"), "probe")
    # speed 660: p99 at c=4 = 4000/660*8 + 2 = 50 ms > 40; c=2: 26 ms within
    assert evaluation.best is not None and evaluation.best.level == 2
    assert evaluation.score == pytest.approx(330)


def test_errors_or_latency_over_budget_do_not_score(model_dir, monkeypatch):
    def bad(candidate):
        if candidate.precision == "fp16":
            return [level(1, 5000, 1, errors={"500": 3})]
        return [level(1, 10, 90)]

    tuner = make_tuner(model_dir, monkeypatch, measure=bad)
    over = tuner.evaluate(Candidate(8, 0, 1, "none", "fp32"), "probe")
    erred = tuner.evaluate(Candidate(8, 0, 1, "none", "fp16"), "probe")
    assert over.status == "over budget" and over.score == 0 and "90.0" in over.detail
    assert erred.status == "over budget" and erred.best is None
    result = tuner.run()
    assert result.winner is result.baseline and result.winner.best is None
    assert "No candidate kept p99" in why(result)[0]


def test_the_time_budget_stops_the_search(model_dir, monkeypatch):
    tuner = make_tuner(model_dir, monkeypatch, budget_s=0.0)
    result = tuner.run()
    assert result.stopped_by_budget and len(result.evaluations) == 1


def test_confirmation_keeps_the_current_config_unless_beaten(model_dir, monkeypatch):
    runs = {"n": 0}

    def noisy(candidate):
        runs["n"] += 1
        if candidate.max_queue_delay_us == 2000 and candidate.max_batch_size == 8:
            return [level(1, 500, 10)]  # the current config
        # a lucky first measurement, then the truth
        return [level(1, 600 if runs["n"] < 3 else 300, 10)]

    tuner = make_tuner(model_dir, monkeypatch, measure=noisy, max_passes=1)
    tuner.settings.confirm = 3
    tuner.space = SearchSpace(
        max_batch_size=[8, 16],
        max_queue_delay_us=[2000],
        instance_count=[1],
        preferred=["none"],
        precision=["fp32"],
        adaptive=[None],
    )
    result = tuner.run()
    assert result.winner is result.baseline


def test_failed_candidates_are_reported_not_fatal(model_dir, monkeypatch):
    tuner = make_tuner(model_dir, monkeypatch)
    monkeypatch.setattr(tuner, "measure", lambda c: ([], "failed", "RuntimeError: boom"))
    evaluation = tuner.evaluate(Candidate(8, 0, 1, "none", "fp32"), "probe")
    assert evaluation.status == "failed" and "boom" in evaluation.detail


def test_candidates_write_valid_configs(model_dir):
    config = parse_model_config(CONFIG, model_dir / "config.yaml", "toy")
    base = Candidate.from_config(config)
    assert base == Candidate(8, 2000, 1, "none", "fp32", None)
    cand = Candidate(16, 500, 2, "half", "bf16", 80.0)
    data = cand.apply(CONFIG)
    parsed = parse_model_config(data, model_dir / "config.yaml", "toy")
    assert parsed.max_batch_size == 16 and parsed.instance_group[0].count == 2
    assert parsed.dynamic_batching.preferred_batch_sizes == [8, 16]
    assert parsed.dynamic_batching.adaptive.target_p99_ms == 80.0
    assert parsed.parameters == {"keep": "me"} and parsed.precision == "bf16"
    assert Candidate.from_config(parsed) == cand
    assert CONFIG["max_batch_size"] == 8  # the original mapping is untouched
    assert Candidate(1, 0, 1, "half", "fp32").preferred_sizes() == []
    assert SearchSpace(max_batch_size=[4, 16]).values("max_batch_size", 8) == [4, 8, 16]


def test_report_and_config_files(model_dir, monkeypatch, tmp_path):
    result = make_tuner(model_dir, monkeypatch).run()
    out = tmp_path / "out"
    write_config(result, out / "config.yaml")
    paths = write_report(result, out, out / "config.yaml")
    chosen = yaml.safe_load((out / "config.yaml").read_text())
    assert chosen["max_batch_size"] == 32 and chosen["parameters"] == {"keep": "me"}
    assert (out / "config.yaml").read_text().startswith("# Chosen by gpuserve tune")
    report = paths["report"].read_text()
    assert "## Why the winner won" in report and "**winner**" in report
    assert report.count("\n| ") == len(result.evaluations) + 1
    for key in ("candidates_plot", "curves_plot"):
        assert paths[key].read_bytes()[:4] == b"\x89PNG"
