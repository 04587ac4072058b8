"""``benchmarks/mixed_length.py`` runs end to end (a tiny run), so the script cannot rot.

It is a benchmark, not a timed test: nothing here judges speed, only that every part ran and
the report holds real measurements. Peers whose venvs are absent must be skipped with a clear
line rather than fail the run.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "mixed_length.py"


def run(tmp_path: Path, *args: str, env: dict[str, str] | None = None):
    import os

    return subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out-dir", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **(env or {})},
    )


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_tiny_run_measures_in_process_and_served_gpuserve(tmp_path):
    proc = run(
        tmp_path,
        "--base-port",
        str(free_port()),
        "--servers",
        "gpuserve",
        "--mix",
        "short",
        "--short-count",
        "40",
        "--conc",
        "2",
        "--inprocess-modes",
        "batch1,sorted8",
        "--inprocess-seconds",
        "0.5",
        "--duration",
        "0.9",
        "--tag",
        "smoke",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [report] = tmp_path.glob("mixed-length-smoke-*.md")
    doc = json.loads(report.with_suffix(".json").read_text())
    executions = ["torch", "onnxruntime"] if importlib.util.find_spec("onnxruntime") else ["torch"]
    assert [r["mode"] for r in doc["inprocess"]] == [
        f"{e} {m}" for e in executions for m in ("batch1", "sorted8")
    ]
    assert all(
        r["texts_per_s"] > 0 and r["tokens_per_s"] > r["texts_per_s"] for r in doc["inprocess"]
    )
    [served] = doc["servers"]
    assert "error" not in served and served["cosine"]["short"] > 0.999
    [point] = served["points"]
    assert point["server"] == "gpuserve" and point["concurrency"] == 2
    assert point["ok"] > 0 and not point["errors"]
    assert point["tokens_per_s"] > point["rps"] > 0
    text = report.read_text()
    assert "| gpuserve | short |" in text and "## Issue 20 targets" in text
    assert proc.stdout.strip() == text.strip()


def test_servers_that_cannot_run_here_are_skipped_with_a_clear_line(tmp_path):
    proc = run(
        tmp_path,
        "--servers",
        "gpuserve-base,infinity",
        "--mix",
        "short",
        "--short-count",
        "20",
        "--skip-inprocess",
        env={"INFINITY_VENV": str(tmp_path / "no-venv"), "GPUSERVE_BASE_SRC": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"SKIPPING infinity: {tmp_path / 'no-venv'}/bin/infinity_emb missing" in proc.stderr
    assert "SKIPPING gpuserve-base: GPUSERVE_BASE_SRC not set" in proc.stderr
    assert "Skipped infinity:" in proc.stdout and "Skipped gpuserve-base:" in proc.stdout
