"""Triton's load with files: ``file:<path>`` parameters carry the model's files, which load in
place of the repository folder's, from a private temporary folder removed on unload.

Driven with Triton's own clients (``load_model(..., config=..., files=...)``) and httpx against
an in-process server in explicit mode serving :mod:`tests.fixtures.triton_examples`' ``simple``
(``OUTPUT0 = INPUT0 + INPUT1``); the files send a ``simple`` whose ``OUTPUT0`` is the product,
so which one answers shows where the model loaded from. The servers run with
``allow_model_upload_code`` (a ``model.py`` runs code; the upload policy itself is tested in
``test_upload_policy.py``).
"""

from __future__ import annotations

import base64
import json
import stat
import tempfile
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.fixtures.triton_examples import write_onnx_simple, write_triton_examples
from tests.helpers import InProcessServer

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

#: ``simple`` with OUTPUT0 = INPUT0 * INPUT1 (the repository's adds).
MUL_SUB = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            out.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", (a * b).astype(a.dtype)),
                pb_utils.Tensor("OUTPUT1", (a - b).astype(a.dtype)),
            ]))
        return out
"""

#: Triton's ModelConfig JSON of ``simple``.
CONFIG = json.dumps(
    {
        "name": "simple",
        "backend": "python",
        "max_batch_size": 8,
        "input": [
            {"name": "INPUT0", "data_type": "TYPE_INT32", "dims": [16]},
            {"name": "INPUT1", "data_type": "TYPE_INT32", "dims": [16]},
        ],
        "output": [
            {"name": "OUTPUT0", "data_type": "TYPE_INT32", "dims": [16]},
            {"name": "OUTPUT1", "data_type": "TYPE_INT32", "dims": [16]},
        ],
    }
)
FILES = {"file:1/model.py": MUL_SUB.encode()}
A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.full((1, 16), 3, dtype=np.int32)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = write_triton_examples(tmp_path_factory.mktemp("files") / "models", False)
    running = InProcessServer(
        root,
        model_control_mode="explicit",
        load_model=["simple"],
        metrics_port=-1,
        allow_model_upload_code=True,
    )
    yield running
    running.stop()


@pytest.fixture
def http(server):
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    yield client
    client.load_model("simple")  # back to the repository's for the next test
    client.close()


@pytest.fixture
def grpc(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    yield client
    client.close()


def _output0(client, module) -> np.ndarray:
    inputs = [
        module.InferInput("INPUT0", [1, 16], "INT32"),
        module.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_data_from_numpy(A)
    inputs[1].set_data_from_numpy(B)
    return client.infer("simple", inputs).as_numpy("OUTPUT0")


def _folders(server) -> dict[str, Path]:
    return dict(server.server.service.repository.loaded_files.folders)


def _temp_folders() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("gpuserve-load-*"))


def test_http_load_with_files_serves_them_and_unload_removes_the_folder(server, http):
    np.testing.assert_array_equal(_output0(http, httpclient), A + B)  # the repository's
    http.load_model("simple", config=CONFIG, files=FILES)
    np.testing.assert_array_equal(_output0(http, httpclient), A * B)  # the files'
    root = _folders(server)["simple"]
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert (root / "simple" / "1" / "model.py").read_bytes() == FILES["file:1/model.py"]
    assert http.get_model_config("simple")["max_batch_size"] == 8
    http.unload_model("simple")
    assert not http.is_model_ready("simple")
    assert not root.exists()
    assert "simple" not in _folders(server)
    http.load_model("simple")
    np.testing.assert_array_equal(_output0(http, httpclient), A + B)


def test_grpc_load_with_files_then_from_the_repository_removes_the_folder(server, http, grpc):
    grpc.load_model("simple", config=CONFIG, files=FILES)
    np.testing.assert_array_equal(_output0(grpc, grpcclient), A * B)
    first = _folders(server)["simple"]
    grpc.load_model("simple", config=CONFIG, files=FILES)  # again: a new folder, the old goes
    second = _folders(server)["simple"]
    assert second != first and second.exists() and not first.exists()
    grpc.load_model("simple")  # from the repository again
    np.testing.assert_array_equal(_output0(grpc, grpcclient), A + B)
    assert not second.exists() and "simple" not in _folders(server)


@pytest.mark.parametrize(
    "path",
    ["file:../outside.py", "file:1/../../outside.py", "file:/tmp/abs.py", "file:" + "A" * 256],
)
def test_bad_paths_answer_internal_and_the_server_stays(server, http, grpc, path):
    before = _temp_folders()
    with pytest.raises(InferenceServerException) as raised:
        grpc.load_model("simple", config="{}", files={path: b"a"})
    assert raised.value.status() == "StatusCode.INTERNAL"
    assert "failed to poll from model repository" in raised.value.message()
    body = {"parameters": {"config": CONFIG, path: base64.b64encode(b"a").decode()}}
    answer = httpx.post(f"{server.url}/v2/repository/models/simple/load", json=body)
    assert answer.status_code == 500, answer.text
    assert "failed to poll from model repository" in answer.json()["error"]
    assert grpc.is_server_live()
    np.testing.assert_array_equal(_output0(grpc, grpcclient), A + B)  # still the repository's
    assert "simple" not in _folders(server)
    assert _temp_folders() == before


def test_a_255_byte_component_is_fine(server, http):
    files = {"file:1/model.py": MUL_SUB.encode(), "file:1/" + "B" * 255: b"x"}
    http.load_model("simple", config=CONFIG, files=files)
    np.testing.assert_array_equal(_output0(http, httpclient), A * B)


def test_files_without_config_and_bad_base64_answer_400(server, http, grpc):
    url = f"{server.url}/v2/repository/models/simple/load"
    content = base64.b64encode(b"x").decode()
    answer = httpx.post(url, json={"parameters": {"file:1/model.py": content}})
    assert answer.status_code == 400, answer.text
    assert "'config' is required" in answer.json()["error"]
    answer = httpx.post(url, json={"parameters": {"config": CONFIG, "file:1/model.py": "%%"}})
    assert answer.status_code == 400, answer.text
    assert "'file:1/model.py'" in answer.json()["error"]
    assert "base64" in answer.json()["error"]
    with pytest.raises(InferenceServerException) as raised:
        grpc.load_model("simple", files=FILES)
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "failed to load 'simple'" in raised.value.message()
    assert "simple" not in _folders(server)


def test_a_failed_load_with_files_keeps_the_served_version_and_leaves_no_folder(server, http):
    before = _temp_folders()
    broken = {"file:1/model.py": b"raise RuntimeError('broken model')\n"}
    with pytest.raises(InferenceServerException) as raised:
        http.load_model("simple", config=CONFIG, files=broken)
    assert "failed to load 'simple'" in raised.value.message()
    np.testing.assert_array_equal(_output0(http, httpclient), A + B)
    assert "simple" not in _folders(server)
    assert _temp_folders() == before


def test_an_onnx_model_sent_as_files_with_a_partial_config(server, http, tmp_path):
    """The repository's ``simple`` is a Python model; the files send an ONNX one and a config
    naming only ``max_batch_size``: the backend and tensors come from the file (Triton's
    auto-complete)."""
    model = write_onnx_simple(tmp_path / "simple") / "1" / "model.onnx"
    files = {"file:1/model.onnx": model.read_bytes()}
    http.load_model("simple", config='{"max_batch_size": "16"}', files=files)
    config = http.get_model_config("simple")
    assert config["max_batch_size"] == 16
    assert "onnx" in (config.get("platform", "") + config.get("backend", "")), config
    assert [i["name"] for i in config["input"]] == ["INPUT0", "INPUT1"]
    np.testing.assert_array_equal(_output0(http, httpclient), A + B)
    root = _folders(server)["simple"]
    assert (root / "simple" / "1" / "model.onnx").is_file()
    http.unload_model("simple")
    assert not root.exists()


def test_shutdown_removes_the_folders(tmp_path):
    root = write_triton_examples(tmp_path / "models", False)
    running = InProcessServer(
        root,
        model_control_mode="explicit",
        load_model=["simple"],
        metrics_port=-1,
        allow_model_upload_code=True,
    )
    try:
        client = grpcclient.InferenceServerClient(running.grpc_url)
        client.load_model("simple", config=CONFIG, files=FILES)
        client.close()
        folder = _folders(running)["simple"]
        assert folder.exists()
    finally:
        running.stop()
    assert not folder.exists()
