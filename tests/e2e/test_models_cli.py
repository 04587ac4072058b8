"""``gpuserve models`` as a subprocess: validate and list a repository; list, roll back,
unload and load against a running ``gpuserve serve`` (explicit mode), which then exits 0 on
SIGTERM."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from tests.fixtures.lifecycle_support import infer_body, make_repository, version_of
from tests.helpers import SubprocessServer

pytestmark = pytest.mark.timeout(180)


def gpuserve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpuserve", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_validate_reports_every_error_at_once_and_list_reads_the_repository(tmp_path):
    repo = make_repository(tmp_path / "repo", "versioned", "double_fp32")
    (repo / "double_fp32" / "config.yaml").write_text(
        "backend: python\nmax_batch_size: -2\nprecision: fp64\ninputs: []\noutputs: []\n"
    )
    (repo / "versioned" / "2" / ".incomplete").touch()
    result = gpuserve("models", "validate", "--model-repository", str(repo))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "max_batch_size" in result.stdout and "precision" in result.stdout  # both fields
    assert "incomplete" in result.stdout
    assert "problem(s) in 2 model(s)" in result.stderr

    listing = gpuserve("models", "list", "--model-repository", str(repo))
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert any("versioned" in line and "SELECTED" in line for line in lines)
    assert any("double_fp32" in line and "INVALID" in line for line in lines)

    good = gpuserve("models", "validate", "--model-repository", str(tmp_path / "nope"))
    assert good.returncode == 1 and "not a folder" in good.stderr


def test_cli_manages_a_running_server(tmp_path):
    repo = make_repository(tmp_path / "repo", "versioned")
    server = SubprocessServer(
        "--model-repository",
        str(repo),
        "--model-control-mode",
        "explicit",
        "--load-model",
        "versioned",
        "--management-token",
        "t0ken",
    )
    env = {"GPUSERVE_MANAGEMENT_TOKEN": "t0ken"}
    try:
        listing = gpuserve("models", "list", "--url", server.url)
        assert listing.returncode == 0, listing.stderr
        assert any("versioned" in ln and "READY" in ln for ln in listing.stdout.splitlines())

        refused = gpuserve("models", "rollback", "versioned", "--url", server.url)
        assert refused.returncode == 1 and "401" in refused.stderr

        rolled = gpuserve("models", "rollback", "versioned", "--url", server.url, env=env)
        assert rolled.returncode == 0, rolled.stderr
        assert "serving version 1" in rolled.stdout
        response = httpx.post(f"{server.url}/v2/models/versioned/infer", json=infer_body())
        assert version_of(response) == 1

        unloaded = gpuserve("models", "unload", "versioned", "--url", server.url, env=env)
        assert unloaded.returncode == 0, unloaded.stderr
        response = httpx.post(f"{server.url}/v2/models/versioned/infer", json=infer_body())
        assert response.status_code == 503

        loaded = gpuserve("models", "load", "versioned", "--url", server.url, env=env)
        assert loaded.returncode == 0 and "serving version 2" in loaded.stdout, loaded.stderr
        response = httpx.post(f"{server.url}/v2/models/versioned/infer", json=infer_body())
        assert version_of(response) == 2
    finally:
        code = server.stop()
    assert code == 0, server.output()
