"""``gpuserve bench`` when things go wrong (issue 19): a sweep whose first window fails every
request stops at once with a clear error and writes nothing; results never overwrite an
earlier run's unless asked; without matplotlib the PNG is skipped with one line naming the
``bench`` extra."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from gpuserve.bench.report import DEFAULT_OUTPUT_ROOT, output_folder
from gpuserve.cli.main import main
from tests.helpers import free_port

FAST = ["--warmup-s", "0.2", "--window-s", "0.3", "--max-windows", "2", "--stable-windows", "2"]
HIDE = Path(__file__).parents[1] / "fixtures" / "hide_modules"


def test_a_wrong_grpc_address_stops_after_the_first_window(server, tmp_path, capsys):
    out = tmp_path / "out"
    started = time.monotonic()
    code = main([
        "bench", "--url", server.url, "-m", "double4_fp32", "--protocol", "grpc",
        "--grpc-url", f"127.0.0.1:{free_port()}", "--concurrency", "1:64:x2",
        *FAST, "--output-dir", str(out), "--quiet",
    ])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1
    assert "every request to grpc" in err and "failed at concurrency 1" in err, err
    assert "nothing written" in err and not out.exists()
    assert time.monotonic() - started < 20  # one level, one window: not the whole sweep


def test_results_never_overwrite_an_earlier_run_unless_asked(server, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["bench", "--url", server.url, "-m", "double4_fp32", "--concurrency", "1", *FAST]
    assert main([*args, "--output-dir", str(out), "--quiet", "--no-plot"]) == 0
    first = (out / "bench.json").read_text()
    capsys.readouterr()
    assert main([*args, "--output-dir", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "holds the results of an earlier run" in err and "--overwrite" in err
    assert (out / "bench.json").read_text() == first
    assert main([*args, "--output-dir", str(out), "--quiet", "--no-plot", "--overwrite"]) == 0
    assert json.loads((out / "bench.json").read_text())["started"]


def test_default_folders_are_new_per_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    now = dt.datetime(2026, 12, 1, 12, 0, 0)
    first = output_folder(None, now=now)
    assert first == DEFAULT_OUTPUT_ROOT / "20261201-120000"
    first.mkdir(parents=True)
    assert output_folder(None, now=now) == DEFAULT_OUTPUT_ROOT / "20261201-120000-2"
    (tmp_path / "mine").mkdir()
    assert output_folder(tmp_path / "mine") == tmp_path / "mine"  # empty: fine


def test_without_matplotlib_the_png_is_skipped_with_the_extra_named(server, tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HIDE), os.environ.get("PYTHONPATH")])),
        "GPUSERVE_TEST_HIDE_MODULES": "matplotlib",
    }
    out = tmp_path / "out"
    result = subprocess.run(
        [
            sys.executable, "-m", "gpuserve", "bench", "--url", server.url, "-m",
            "double4_fp32", "--concurrency", "1", *FAST, "--output-dir", str(out), "--quiet",
        ],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "bench.png skipped" in result.stderr
    assert "pip install 'gpuserve[bench]'" in result.stderr
    assert (out / "bench.json").is_file() and not (out / "bench.png").exists()
