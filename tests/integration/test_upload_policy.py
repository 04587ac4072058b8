"""The upload policy for model code: a load request's ``file:`` parameters that carry files
which run code when the model loads (``model.py``, pickled or TorchScript files) need a token
guarding management, or ``--allow-model-upload-code``; files that run no code (an ONNX model)
need neither. Driven with Triton's own clients over HTTP and gRPC, then an inference shows
which model answers; plus the warning at start when management is open to other machines.
"""

from __future__ import annotations

import logging
import pickle
import threading

import numpy as np
import pytest

from gpuserve.config import ServerConfig
from gpuserve.server.security import is_loopback, open_management_warning
from gpuserve.service.model_files import code_files
from tests.fixtures.triton_examples import write_onnx_simple, write_triton_examples
from tests.helpers import InProcessServer
from tests.integration.test_load_with_files import CONFIG, FILES, A, B

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

pytestmark = pytest.mark.timeout(120)

TOKEN = "s3cret-management"


def start(tmp_path, **settings) -> InProcessServer:
    root = write_triton_examples(tmp_path / "models", False)
    return InProcessServer(
        root, model_control_mode="explicit", load_model=["simple"], metrics_port=-1, **settings
    )


def clients(server: InProcessServer, token: str | None = None):
    """Both of Triton's clients, each with its own headers (the HTTP client adds to the
    dict it is given)."""
    http_headers = {"Authorization": f"Bearer {token}"} if token else None
    grpc_headers = {"authorization": f"Bearer {token}"} if token else None
    http = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    return (
        (http, http_headers, "http"),
        (grpcclient.InferenceServerClient(server.grpc_url), grpc_headers, "grpc"),
    )


def output0(client, module, headers) -> np.ndarray:
    inputs = [
        module.InferInput("INPUT0", [1, 16], "INT32"),
        module.InferInput("INPUT1", [1, 16], "INT32"),
    ]
    inputs[0].set_data_from_numpy(A)
    inputs[1].set_data_from_numpy(B)
    return client.infer("simple", inputs, headers=headers).as_numpy("OUTPUT0")


def test_code_uploads_are_refused_without_a_token_or_the_flag(tmp_path):
    server = start(tmp_path)
    try:
        for client, _headers, kind in clients(server):
            with pytest.raises(InferenceServerException) as caught:
                client.load_model("simple", config=CONFIG, files=FILES)
            err = caught.value
            wanted = "403" if kind == "http" else "StatusCode.PERMISSION_DENIED"
            assert wanted in str(err.status()), (kind, err.status())
            message = err.message()
            assert "'file:1/model.py'" in message and "run code" in message, message
            assert "--management-token" in message and "--allow-model-upload-code" in message
            # nothing changed: the repository's simple (the sum) still answers
            np.testing.assert_array_equal(output0(client, _module(kind), None), A + B)
            client.close()
        # a pickle under a harmless name is code too (torch.load would run it)
        client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
        with pytest.raises(InferenceServerException) as caught:
            client.load_model(
                "simple", config=CONFIG, files={"file:1/weights.dat": pickle.dumps({"w": 1})}
            )
        assert "403" in str(caught.value.status()) and "1/weights.dat" in caught.value.message()
        client.close()
    finally:
        server.stop()


def test_files_that_run_no_code_load_without_a_token(tmp_path):
    server = start(tmp_path)
    try:
        model = write_onnx_simple(tmp_path / "onnx" / "simple") / "1" / "model.onnx"
        client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
        files = {"file:1/model.onnx": model.read_bytes()}
        client.load_model("simple", config='{"max_batch_size": 8}', files=files)
        assert client.is_model_ready("simple")
        np.testing.assert_array_equal(output0(client, httpclient, None), A + B)
        client.close()
    finally:
        server.stop()


def test_code_uploads_are_accepted_with_the_management_token(tmp_path):
    server = start(tmp_path, management_token=TOKEN)
    try:
        for client, headers, kind in clients(server, TOKEN):
            client.load_model("simple", config=CONFIG, files=FILES, headers=headers)
            # the uploaded simple (the product) answers
            np.testing.assert_array_equal(output0(client, _module(kind), headers), A * B)
            client.load_model("simple", headers=headers)  # back to the repository's
            client.close()
        # the token is still needed to call the endpoint at all (401, not 403)
        client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
        with pytest.raises(InferenceServerException) as caught:
            client.load_model("simple", config=CONFIG, files=FILES)
        assert "401" in str(caught.value.status())
        client.close()
    finally:
        server.stop()


def test_code_uploads_are_accepted_with_the_flag(tmp_path):
    server = start(tmp_path, allow_model_upload_code=True)
    try:
        for client, _headers, kind in clients(server):
            client.load_model("simple", config=CONFIG, files=FILES)
            np.testing.assert_array_equal(output0(client, _module(kind), None), A * B)
            client.load_model("simple")
            client.close()
    finally:
        server.stop()


def _module(kind: str):
    return httpclient if kind == "http" else grpcclient


def test_code_files_by_name_and_by_first_bytes():
    files = {
        ("1", "model.py"): b"print(1)",
        ("1", "model.PT"): b"x",
        ("1", "model.onnx"): b"\x08\x07",
        ("1", "weights.safetensors"): b"{}",
        ("1", "data"): pickle.dumps([1]),
        ("1", "archive"): b"PK\x03\x04rest",
        ("1", "libop.so"): b"\x7fELF",
        ("warmup", "in0.bin"): b"\x00\x00\x80\x3f",  # raw warm-up tensor data
        ("1", "pytorch_model.bin"): b"PK\x03\x04torch",  # a torch.save archive
    }
    assert code_files(files) == [
        "1/archive",
        "1/data",
        "1/libop.so",
        "1/model.PT",
        "1/model.py",
        "1/pytorch_model.bin",
    ]


@pytest.mark.parametrize(
    ("settings", "warned"),
    [
        ({"host": "0.0.0.0", "model_control_mode": "explicit"}, True),
        ({"host": "10.1.2.3", "enable_management": True}, True),
        ({"host": "0.0.0.0"}, False),  # none mode: management is off
        ({"host": "127.0.0.1", "model_control_mode": "explicit"}, False),
        ({"host": "::1", "model_control_mode": "poll"}, False),
        ({"host": "0.0.0.0", "model_control_mode": "explicit", "management_token": "t"}, False),
        ({"host": "0.0.0.0", "model_control_mode": "explicit", "api_token": "t"}, False),
        (
            {"host": "0.0.0.0", "model_control_mode": "explicit", "disable_management": True},
            False,
        ),
    ],
)
def test_the_start_warning_for_open_management(tmp_path, settings, warned):
    config = ServerConfig(model_repository=tmp_path, **settings)
    warning = open_management_warning(config)
    assert (warning is not None) == warned, warning
    if warning:
        assert settings["host"] in warning and "--management-token" in warning


def test_loopback_addresses():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert is_loopback("127.5.0.1") and is_loopback("[::1]")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.com")


def test_the_server_logs_the_warning_at_start(tmp_path, caplog):
    """An in-process server bound on all addresses, in explicit mode, with no token."""
    root = write_triton_examples(tmp_path / "models", False)
    from gpuserve.server.runner import GpuServer

    config = ServerConfig(
        model_repository=root,
        host="0.0.0.0",
        http_port=0,
        grpc_port=-1,
        metrics_port=-1,
        model_control_mode="explicit",
    )
    with caplog.at_level(logging.WARNING, logger="gpuserve.server.runner"):
        server = GpuServer(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            assert server.started.wait(60)
        finally:
            server.stop()
            thread.join(60)
    assert "with no --management-token" in caplog.text, caplog.text
