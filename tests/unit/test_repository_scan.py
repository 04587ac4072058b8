"""Repository scan: version folders that are incomplete, fingerprints, version policies, and
``validate_repository`` reporting every problem at once (no server, no sockets)."""

from __future__ import annotations

import os

import pytest

from gpuserve.config import ServerConfig
from gpuserve.repository.scan import (
    fingerprint,
    read_version_folder,
    scan_model,
    scan_repository,
    validate_repository,
)
from tests.fixtures.lifecycle_support import add_version, make_repository


def test_versions_policy_and_folders(tmp_path):
    repo = make_repository(tmp_path / "repo", "versioned")
    add_version(repo, 3)
    entry = scan_model(repo / "versioned")
    assert entry.available == [1, 2, 3] and entry.versions == [3] and entry.error is None
    assert all(entry.folders[v].problem is None for v in entry.available)


@pytest.mark.parametrize("marker", [".incomplete", "INCOMPLETE"])
def test_a_marked_version_folder_is_not_loadable(tmp_path, marker):
    repo = make_repository(tmp_path / "repo", "versioned")
    folder = add_version(repo, 3)
    (folder / marker).touch()
    entry = scan_model(repo / "versioned")
    assert entry.versions == [2]  # latest loadable, not 3
    assert "incomplete" in entry.folders[3].problem and marker in entry.folders[3].problem


def test_an_empty_version_folder_is_not_loadable(tmp_path):
    repo = make_repository(tmp_path / "repo", "versioned")
    (repo / "versioned" / "3").mkdir()
    entry = scan_model(repo / "versioned")
    assert entry.versions == [2] and "empty" in entry.folders[3].problem


def test_only_incomplete_versions_is_a_model_error(tmp_path):
    repo = make_repository(tmp_path / "repo", "versioned", versions={"versioned": [1]})
    (repo / "versioned" / "1" / ".incomplete").touch()
    entry = scan_model(repo / "versioned")
    assert entry.versions == [] and "incomplete" in entry.error


def test_fingerprint_sees_changes_but_not_pycache(tmp_path):
    folder = tmp_path / "1"
    folder.mkdir()
    (folder / "model.py").write_text("x = 1\n")
    before = fingerprint(folder)
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0" * 10)
    assert fingerprint(folder) == before
    (folder / "model.py").write_text("x = 22\n")
    assert fingerprint(folder) != before
    stat = (folder / "model.py").stat()
    os.utime(folder / "model.py", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert read_version_folder(folder).fingerprint != before


def test_validate_reports_every_problem_of_every_model(tmp_path):
    repo = make_repository(tmp_path / "repo", "versioned", "double_fp32")
    bad = repo / "bad_fields"
    (bad / "1").mkdir(parents=True)
    (bad / "1" / "model.py").write_text("")
    (bad / "config.yaml").write_text(
        "backend: python\nmax_batch_size: -1\ninputs: []\noutputs: []\nunknown_key: 1\n"
    )
    no_config = repo / "no_config"
    (no_config / "1").mkdir(parents=True)
    no_file = repo / "no_model_file"
    (no_file / "1").mkdir(parents=True)
    (no_file / "1" / "weights.bin").write_bytes(b"1")
    (no_file / "config.yaml").write_text((repo / "double_fp32" / "config.yaml").read_text())
    (repo / "versioned" / "2" / ".incomplete").touch()
    with (repo / "versioned" / "config.yaml").open("a") as config:
        config.write("canary: {version: 7, weight: 0.1}\n")

    problems = validate_repository(repo)
    text = "\n".join(problems)
    assert "max_batch_size" in text and "unknown_key" in text and "inputs" in text  # all fields
    assert "no_config" in text and "missing config.yaml" in text
    assert "no_model_file" in text and "model.py" in text
    assert "incomplete" in text
    assert "canary.version" in text and "7" in text
    assert not any("double_fp32" in p for p in problems)
    assert validate_repository(make_repository(tmp_path / "good", "versioned")) == []


def test_scan_repository_skips_hidden_folders(tmp_path):
    repo = make_repository(tmp_path / "repo", "versioned")
    (repo / ".versioned_tmp").mkdir()
    assert [e.name for e in scan_repository(repo)] == ["versioned"]


def test_server_config_lifecycle_settings(monkeypatch):
    monkeypatch.setenv("GPUSERVE_LOAD_MODEL", "a, b")
    monkeypatch.setenv("GPUSERVE_MANAGEMENT_TOKEN", "s3cret")
    monkeypatch.setenv("GPUSERVE_MODEL_CONTROL_MODE", "explicit")
    config = ServerConfig()
    assert config.load_model == ["a", "b"] and config.model_control_mode == "explicit"
    assert config.management_token is not None
    assert "s3cret" not in repr(config)  # never printed
    assert config.management_token.get_secret_value() == "s3cret"
    assert ServerConfig(load_model=["x"]).load_model == ["x"]
