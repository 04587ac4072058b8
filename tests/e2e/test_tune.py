"""The real ``gpuserve tune`` CLI: two candidates of a fast fixture model, a second or so each.

double_fp32 ships with a 50 ms queue delay; with early dispatch off (so that every batch waits
it out) its p99 at concurrency 1 and 4 is above a 30 ms budget, and the only other candidate
(no delay) is well within it. The tuner must pick it, write it as config.yaml and explain why
in the report.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.conftest import FIXTURE_REPOSITORY

pytestmark = pytest.mark.slow


def test_tune_picks_the_candidate_within_budget_and_reports_why(tmp_path):
    repository = tmp_path / "repository"
    shutil.copytree(FIXTURE_REPOSITORY / "double_fp32", repository / "double_fp32")
    config_path = repository / "double_fp32" / "config.yaml"
    config = yaml.safe_load(config_path.read_text())
    config["dynamic_batching"]["early_dispatch"] = False
    config_path.write_text(yaml.safe_dump(config))
    out = tmp_path / "tuned"
    command = [
        sys.executable, "-m", "gpuserve", "tune",
        "--model-repository", str(repository), "--model", "double_fp32",
        "--latency-budget-ms", "30", "--budget-s", "120",
        "--max-batch-sizes", "8", "--queue-delays-us", "0,50000", "--instance-counts", "1",
        "--precisions", "fp32", "--preferred", "none", "--no-adaptive", "--confirm", "0",
        "--concurrency", "1,4", "--warmup-s", "0.2", "--window-s", "0.3",
        "--stable-windows", "2", "--max-windows", "2",
        "--output", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    chosen = yaml.safe_load((out / "config.yaml").read_text())
    assert chosen["dynamic_batching"]["max_queue_delay_us"] == 0
    assert chosen["max_batch_size"] == 8 and chosen["inputs"][0]["name"] == "INPUT0"
    report = (out / "report.md").read_text()
    assert "Why the winner won" in report and "delay=0us" in report and "over budget" in report
    document = json.loads((out / "report.json").read_text())
    assert [e["status"] for e in document["evaluations"]] == ["over budget", "ok"]
    assert document["evaluations"][1]["levels"][0]["latency_ms"]["p99"] < 30
    for name in ("candidates.png", "curves.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert "max_queue_delay_us 50000 → 0" in done.stdout
