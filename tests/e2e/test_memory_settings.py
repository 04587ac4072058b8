"""The memory settings of ``gpuserve serve`` (issue 20, README "Memory"): the server starts and
serves with them on (the defaults: ``mallopt`` at start, ``malloc_trim`` once it goes quiet)
and with them switched off (glibc's defaults, no trim)."""

from __future__ import annotations

import httpx
import pytest

from gpuserve.server.memory import GlibcMalloc
from tests.conftest import FIXTURE_REPOSITORY
from tests.helpers import SubprocessServer, wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(GlibcMalloc.load() is None, reason="glibc malloc only"),
]

OFF = ("--malloc-arena-max", "0", "--malloc-mmap-threshold-bytes", "0")
OFF += ("--memory-trim-interval-s", "0")


def double(server: SubprocessServer) -> None:
    tensor = {"name": "INPUT0", "shape": [2, 16], "datatype": "FP32", "data": [1.5] * 32}
    body = {"inputs": [tensor]}
    response = httpx.post(f"{server.url}/v2/models/double_fp32/infer", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == [3.0] * 32


def test_by_default_the_server_trims_when_quiet_and_a_threshold_can_be_set():
    server = SubprocessServer(
        "--model-repository",
        str(FIXTURE_REPOSITORY),
        "--log-level",
        "debug",
        "--malloc-mmap-threshold-bytes",
        str(2**20),
    )
    try:
        double(server)
        output = server.output
        assert "memory: M_MMAP_THRESHOLD=1048576; malloc_trim when idle" in output()
        # the load and the request were work; once quiet the driver trims (a debug line)
        wait_until(lambda: "malloc_trim: " in output(), 60, "a malloc_trim after the work")
        double(server)
    finally:
        assert server.stop() == 0, server.output()


def test_the_defaults_keep_glibcs_allocator_settings_and_trim_when_idle():
    server = SubprocessServer("--model-repository", str(FIXTURE_REPOSITORY), "--log-level", "debug")
    try:
        double(server)
        assert "memory: glibc malloc defaults; malloc_trim when idle" in server.output()
    finally:
        assert server.stop() == 0, server.output()


def test_switched_off_the_server_keeps_glibc_defaults_and_never_trims():
    server = SubprocessServer(
        "--model-repository", str(FIXTURE_REPOSITORY), "--log-level", "debug", *OFF
    )
    try:
        double(server)
        assert "memory: glibc malloc defaults; malloc_trim off" in server.output()
    finally:
        assert server.stop() == 0, server.output()
    assert "malloc_trim: " not in server.output()
