"""The checks and the layout of model files sent with a load request
(:mod:`gpuserve.service.model_files`)."""

from __future__ import annotations

import asyncio
import shutil
import stat

import pytest

from gpuserve.errors import InvalidInputError, RepositoryPollError
from gpuserve.server.status import grpc_code, http_status
from gpuserve.service.model_files import (
    LoadedFiles,
    check_file_path,
    check_files,
    with_detected_backend,
    write_model_folder,
)


def test_relative_paths_split_into_components():
    assert check_file_path("1/model.onnx") == ("1", "model.onnx")
    assert check_file_path("A" * 255) == ("A" * 255,)
    assert check_file_path("1/" + "é" * 127) == ("1", "é" * 127)  # 254 bytes


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("", "empty"),
        ("/etc/passwd", "absolute"),
        ("../x", "'..'"),
        ("1/../../x", "'..'"),
        ("1/./x", "'.'"),
        ("1//x", "''"),
        ("1/x/", "''"),
        ("1\\x", "backslash"),
        ("1/x\0", "NUL"),
        ("A" * 256, "256 bytes"),
        ("1/" + "é" * 128, "256 bytes"),
    ],
)
def test_bad_paths_are_refused_as_triton_does(path, why):
    with pytest.raises(RepositoryPollError) as raised:
        check_file_path(path)
    message = raised.value.message
    assert message.startswith("failed to poll from model repository")
    assert f"'file:{path}'" in message and why in message
    assert (http_status(raised.value), grpc_code(raised.value)) == (500, "INTERNAL")


def test_the_total_size_is_bounded():
    assert check_files({"1/a": b"x" * 600, "1/b": b"y" * 400}, 1000) == {
        ("1", "a"): b"x" * 600,
        ("1", "b"): b"y" * 400,
    }
    with pytest.raises(InvalidInputError, match=r"1001 bytes.*1000.*max_request_body_bytes"):
        check_files({"1/a": b"x" * 600, "1/b": b"y" * 401}, 1000)


def test_files_land_in_a_private_folder_under_the_model_name():
    folder = write_model_folder("simple", {("1", "model.py"): b"code", ("labels.txt",): b"a"})
    try:
        assert folder.name == "simple"
        assert stat.S_IMODE(folder.parent.stat().st_mode) == 0o700
        assert (folder / "1" / "model.py").read_bytes() == b"code"
        assert stat.S_IMODE((folder / "1" / "model.py").stat().st_mode) == 0o600
        assert (folder / "labels.txt").read_bytes() == b"a"
    finally:
        shutil.rmtree(folder.parent)


def test_colliding_paths_are_refused_and_leave_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with pytest.raises(RepositoryPollError, match="cannot be written"):
        write_model_folder("simple", {("1",): b"a file", ("1", "model.py"): b"code"})
    assert list(tmp_path.iterdir()) == []


def test_loaded_files_remove_the_previous_folder(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    loaded = LoadedFiles()

    async def run():
        await loaded.replace("m", first)
        await loaded.replace("m", second)
        assert not first.exists() and second.exists()
        await loaded.replace("m", None)
        assert not second.exists() and loaded.folders == {}

    asyncio.run(run())


def test_the_backend_comes_from_the_model_file_when_the_config_names_none(tmp_path):
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.onnx").write_bytes(b"onnx")
    assert with_detected_backend({"max_batch_size": 16}, tmp_path) == {
        "max_batch_size": 16,
        "backend": "onnx",
    }
    triton = {"input": [], "max_batch_size": 16}
    assert with_detected_backend(triton, tmp_path)["backend"] == "onnxruntime"
    named = {"backend": "python"}
    assert with_detected_backend(named, tmp_path) is named
    assert with_detected_backend({}, tmp_path / "missing") == {}
