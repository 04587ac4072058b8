"""``gpuserve bench`` against the real server (in-process, real sockets on free ports)."""

from __future__ import annotations

import csv
import importlib.util
import json

import pytest

from gpuserve.bench.benchmark import BenchConfig, run_benchmark
from gpuserve.bench.inputs import ModelInfo, TensorInfo
from gpuserve.bench.loadgen import LoadSettings
from gpuserve.cli.main import main

FAST = LoadSettings(warmup_s=0.2, window_s=0.3, stable_windows=2, tolerance=0.5, max_windows=3)


def test_closed_loop_sweep_reports_latency_throughput_and_the_server_split(server):
    config = BenchConfig(url=server.url, model="double4_fp32", levels=[1, 4], settings=FAST)
    result = run_benchmark(config)
    assert [r.level for r in result.levels] == [1, 4]
    for level in result.levels:
        s = level.summary
        assert s.ok > 10 and not s.errors and s.throughput > 0
        assert 0 < s.latency_ms[50] <= s.latency_ms[90] <= s.latency_ms[99] <= s.max_ms
        assert level.queue_ms is not None and level.compute_ms is not None  # timing headers
        assert level.server is not None and level.server["rows_per_batch"] >= 1
        assert level.client_cpu is not None and level.client_cpu > 0
    document = json.loads(json.dumps(result.as_dict()))
    assert document["model"] == "double4_fp32"
    assert document["levels"][1]["latency_ms"]["p99"] > 0
    assert document["levels"][0]["timing_source"] == "headers"


def test_binary_tensors_and_bytes_inputs(server):
    config = BenchConfig(
        url=server.url, model="echo_bytes", binary=True, batch_size=2, levels=[2], settings=FAST
    )
    [level] = run_benchmark(config).levels
    assert level.summary.ok > 0 and not level.summary.errors
    assert level.as_dict()["throughput_rows_per_s"] == pytest.approx(2 * level.throughput)


def test_variable_dims_take_their_shape_from_the_command_line(server):
    config = BenchConfig(
        url=server.url, model="tokens_int64", shapes={"input_ids": [7]}, levels=[1], settings=FAST
    )
    [level] = run_benchmark(config).levels
    assert level.summary.ok > 0 and not level.summary.errors


def test_open_loop_sends_at_the_requested_rate(server):
    settings = LoadSettings(
        warmup_s=0.2,
        window_s=0.5,
        stable_windows=2,
        tolerance=0.5,
        max_windows=2,
        arrival="poisson",
    )
    config = BenchConfig(
        url=server.url, model="double4_fp32", mode="rate", levels=[150.0], settings=settings
    )
    [level] = run_benchmark(config).levels
    assert level.mode == "rate" and not level.summary.errors
    assert level.sent_rate == pytest.approx(150, rel=0.35)
    assert level.throughput == pytest.approx(150, rel=0.35)


def test_errors_are_counted_by_status(server):
    wrong = ModelInfo(
        "double4_fp32",
        None,
        [TensorInfo("INPUT0", "FP64", [-1, 4])],
        [TensorInfo("OUTPUT0", "FP32", [-1, 4])],
        batching=True,
    )
    config = BenchConfig(url=server.url, model="double4_fp32", levels=[2], settings=FAST)
    [level] = run_benchmark(config, info=wrong).levels
    assert level.summary.ok == 0 and set(level.summary.errors) == {"400"}


def test_unreachable_server_is_a_clear_error(capsys):
    code = main(["bench", "--url", "http://127.0.0.1:9", "-m", "x", "--quiet"])
    assert code == 2 and "127.0.0.1:9" in capsys.readouterr().err


def test_cli_writes_table_json_csv_and_plot(server, tmp_path, capsys):
    out = tmp_path / "bench"
    code = main([
        "bench", "--url", server.url, "-m", "double4_fp32", "--concurrency", "1:4:x4",
        "--warmup-s", "0.2", "--window-s", "0.3", "--max-windows", "2", "--stable-windows", "2",
        "--output-dir", str(out), "--quiet",
    ])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0
    assert "p99" in printed and "infer/s" in printed
    document = json.loads((out / "bench.json").read_text())
    assert [level["level"] for level in document["levels"]] == [1, 4]
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert len(rows) == 2 and float(rows[1]["throughput_infer_per_s"]) > 0
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_a_sweep_shows_a_line_per_level_as_it_ends_without_a_terminal(server, tmp_path, capsys):
    """Not a terminal (a log, a CI job, a pipe): no progress bar, but never silent for the
    minutes a sweep takes; a line says what runs, then one per level as it ends."""
    code = main([
        "bench", "--url", server.url, "-m", "double4_fp32", "--concurrency", "1,2,4",
        "--warmup-s", "0.1", "--window-s", "0.2", "--max-windows", "2", "--stable-windows", "1",
        "--output-dir", str(tmp_path / "bench"), "--no-plot",
    ])  # fmt: skip
    assert code == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines[0].startswith("gpuserve bench: double4_fp32 at http://"), lines
    assert "concurrency 1, 2, 4" in lines[0]
    levels = [line for line in lines if "infer/s" in line]
    assert len(levels) == 3, lines
    for done, (line, level) in enumerate(zip(levels, (1, 2, 4), strict=True), 1):
        assert line.startswith(f"gpuserve bench: [{done}/3] concurrency {level}: "), line
        assert " p50 " in line and " p99 " in line and "windows" in line


@pytest.mark.skipif(
    importlib.util.find_spec("gpuserve.server.grpc") is None,
    reason="the gRPC front end (gpuserve.server.grpc) is not in this tree",
)
def test_grpc_mode(server):
    if not getattr(server, "grpc_port", None):
        pytest.skip("the test server has no gRPC listener")
    for binary in (True, False):
        config = BenchConfig(
            url=server.url,
            model="double4_fp32",
            protocol="grpc",
            grpc_url=server.grpc_url,
            binary=binary,
            levels=[2],
            settings=FAST,
        )
        [level] = run_benchmark(config).levels
        assert level.summary.ok > 0 and not level.summary.errors, level.summary.errors
        assert level.queue_ms is not None  # trailing metadata or the statistics extension
