"""``perf_analyzer --collect-metrics`` reads gpuserve's ``nv_gpu_*`` series.

perf_analyzer (PyPI's ``perf-analyzer`` wheel, ``perf_analyzer/bin/perf_analyzer``) collects
only GPU series. On a machine without a GPU the server has none, so the server here reads a
fake NVML (two boards) put in the place of ``pynvml``: the exposition is the real one, only
the readings are made up. Point ``GPUSERVE_PERF_ANALYZER`` at the binary (skipped otherwise);
where it needs a newer glibc than the system's, ``GPUSERVE_PERF_ANALYZER_LOADER`` names that
glibc's ``ld-linux-x86-64.so.2`` and ``GPUSERVE_PERF_ANALYZER_LIBRARY_PATH`` its folders (see
``benchmarks/triton_perf_analyzer.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.fixtures.triton_examples import write_triton_examples
from tests.helpers import InProcessServer
from tests.unit.test_metrics_gpu import FakeNvml

BINARY = os.environ.get("GPUSERVE_PERF_ANALYZER")
if not BINARY:
    pytest.skip(
        "GPUSERVE_PERF_ANALYZER is not set: point it at perf_analyzer (pip download "
        "perf-analyzer; perf_analyzer/bin/perf_analyzer in the wheel)",
        allow_module_level=True,
    )


@pytest.fixture()
def server(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    running = InProcessServer(write_triton_examples(tmp_path / "models", with_classifier=False))
    yield running
    running.stop()


def test_collect_metrics_reads_the_nv_gpu_series(server, tmp_path):
    loader = os.environ.get("GPUSERVE_PERF_ANALYZER_LOADER")
    prefix = [str(BINARY)]
    if loader:
        library_path = os.environ.get("GPUSERVE_PERF_ANALYZER_LIBRARY_PATH", "")
        prefix = [loader, "--library-path", library_path, *prefix]
    metrics_port = server.server.metrics_server.port
    csv = tmp_path / "pa.csv"
    done = subprocess.run(
        [
            *prefix,
            "-m",
            "simple",
            "-u",
            server.url.removeprefix("http://"),
            "--concurrency-range",
            "2",
            "--measurement-interval",
            "1500",
            "--stability-percentage",
            "80",
            "--collect-metrics",
            "--metrics-url",
            f"127.0.0.1:{metrics_port}/metrics",
            "--metrics-interval",
            "200",
            "--verbose-csv",
            "-f",
            str(csv),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    text = done.stdout + done.stderr
    assert done.returncode == 0, text
    assert "Unable to parse" not in text, text
    # perf_analyzer's summary of the fake boards: utilisation 37 % and 100 %, 312.5 W on
    # board 0 (board 1 reads no power), 1 GiB and 2 GiB used of 80 GiB and 160 GiB
    assert "GPU-0000-0 : 37%" in text and "GPU-0000-1 : 100%" in text, text
    assert "GPU-0000-0 : 312.5 watts" in text, text
    assert f"GPU-0000-0 : {2**30} bytes" in text and f"GPU-0000-1 : {2 * 2**30} bytes" in text
    assert f"GPU-0000-0 : {80 * 2**30} bytes" in text, text
    header, row = csv.read_text().splitlines()[:2]
    assert "Avg GPU Utilization" in header
    columns = dict(zip(header.split(","), row.split(","), strict=False))
    assert "GPU-0000-0:0.37" in columns["Avg GPU Utilization"], columns
