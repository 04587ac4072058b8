"""``gpuserve tune --accuracy-budget``: precisions are measured against fp32 first and only
those within the budget are searched. Serving is replaced by a synthetic speed model (int8
fastest, bf16 next) and the accuracy probe by fixed measurements, so the search runs in
milliseconds; the selection logic, report and config are the real ones."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from gpuserve.backends.precision_gate import AccuracyReport
from gpuserve.bench.tune import Candidate, SearchSpace, Tuner, TuneSettings
from gpuserve.bench.tune_accuracy import AccuracyBudget
from gpuserve.bench.tune_report import speed_accuracy, why, write_config, write_report
from gpuserve.config import parse_model_config
from tests.unit.test_bench_tune import CONFIG, level

SPEED = {"fp32": 400.0, "bf16": 800.0, "int8": 1000.0}
ACCURACY = {
    "bf16": AccuracyReport("bf16", 300, 0.9999, 1.0, 0.002, 0.99, 10),
    "int8": AccuracyReport("int8", 300, 0.983, 0.993, 0.034, 0.90, 10),
}


def synthetic(candidate: Candidate):
    speed = SPEED[candidate.precision] - 5 * abs(candidate.max_batch_size - 16)
    return [level(c, speed * min(1.0, c / 4), 1000 * c / speed * 4) for c in (1, 2, 4, 8)]


def make(tmp_path: Path, budget: AccuracyBudget | None):
    folder = tmp_path / "repo" / "toy"
    (folder / "1").mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    asked: list[list[str]] = []

    def probe(precisions):
        asked.append(list(precisions))
        return [ACCURACY[p] for p in precisions]

    tuner = Tuner(
        folder,
        SearchSpace(
            max_batch_size=[8, 16],
            max_queue_delay_us=[2000],
            instance_count=[1],
            preferred=["none"],
            precision=["fp32", "bf16", "int8"],
            adaptive=[None],
        ),
        TuneSettings(latency_budget_ms=40, confirm=0),
        log=lambda line: None,
        accuracy_budget=budget,
        accuracy=probe,
    )
    tuner.measure = lambda c: (synthetic(c), "ok", "")  # type: ignore[method-assign]
    return tuner, asked


def test_loose_budget_picks_the_fastest_lower_precision(tmp_path):
    tuner, asked = make(tmp_path, AccuracyBudget(min_cosine=0.95, min_recall=0.85))
    result = tuner.run()
    assert asked == [["bf16", "int8"]]  # fp32 is the reference: never measured
    assert result.winner.candidate.precision == "int8"
    assert result.excluded == {}
    # the tuned config carries the budget as its load-time gate, and is a valid config
    assert result.config["precision_check"] == {"min_cosine": 0.95, "min_neighbour_recall": 0.85}
    parse_model_config(result.config, tmp_path / "config.yaml", "toy")


def test_a_precision_that_does_not_load_is_excluded_alone(tmp_path):
    """bf16 refused at load (a CPU without bf16 products): excluded with the reason; int8
    is still measured, and chosen under a loose budget."""
    tuner, asked = make(tmp_path, AccuracyBudget(min_cosine=0.95, min_recall=0.85))
    measured = tuner._probe

    def refusing(precisions):
        if "bf16" in precisions:
            asked.append(list(precisions))
            raise ValueError("precision bf16 on a CPU needs the AVX-512 BF16 instruction set")
        return measured(precisions)

    tuner._probe = refusing
    result = tuner.run()
    assert asked == [["bf16", "int8"], ["bf16"], ["int8"]]
    assert list(result.excluded) == ["bf16"]
    assert "accuracy not measured: ValueError" in result.excluded["bf16"]
    assert "AVX-512 BF16" in result.excluded["bf16"]
    assert result.winner.candidate.precision == "int8"


def test_tight_budget_keeps_fp32(tmp_path):
    tuner, _ = make(tmp_path, AccuracyBudget(min_cosine=0.99999, min_recall=0.999))
    result = tuner.run()
    assert result.winner.candidate.precision == "fp32"
    assert set(result.excluded) == {"bf16", "int8"}
    assert "min cosine 0.999900 < 0.99999" in result.excluded["bf16"]
    assert all(e.candidate.precision == "fp32" for e in result.evaluations)


def test_middle_budget_excludes_int8_and_report_shows_speed_against_accuracy(tmp_path):
    tuner, _ = make(tmp_path, AccuracyBudget(min_cosine=0.99, min_recall=0.95))
    result = tuner.run()
    assert result.winner.candidate.precision == "bf16"
    assert "recall@10 0.9000 < 0.95" in result.excluded["int8"]
    rows = {r["precision"]: r for r in speed_accuracy(result)}
    assert rows["fp32"]["rows_per_s"] > 0 and rows["fp32"]["cosine_min"] == 1.0
    assert rows["bf16"]["rows_per_s"] > 1.5 * rows["fp32"]["rows_per_s"]
    assert rows["int8"]["rows_per_s"] == 0.0 and rows["int8"]["status"].startswith("outside")
    config_path = tmp_path / "out" / "config.yaml"
    write_config(result, config_path)
    paths = write_report(result, tmp_path / "out", config_path)
    report = paths["report"].read_text()
    assert "## Speed against accuracy" in report
    assert "| int8 | 0.0 | 0.9830 | 0.9930 | 0.0340 | 0.900 | outside the accuracy budget" in report
    data = json.loads(paths["json"].read_text())
    assert data["accuracy_budget"] == "cosine>=0.99,recall@10>=0.95"
    assert [r["precision"] for r in data["speed_accuracy"]] == ["fp32", "bf16", "int8"]
    assert any("bf16 is within it" in line for line in why(result))


def test_without_a_budget_nothing_is_measured(tmp_path):
    tuner, asked = make(tmp_path, None)
    result = tuner.run()
    assert asked == [] and result.accuracy == {}
    assert result.winner.candidate.precision == "int8"  # speed only
    assert any("gpuserve models accuracy" in line for line in why(result))
