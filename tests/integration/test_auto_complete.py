"""Auto-complete against the real server: a Triton Python model whose ``config.pbtxt`` names
only its backend serves with the tensors and batch size its ``auto_complete_config`` sets,
over HTTP and gRPC with Triton's clients; a load override (``{"max_batch_size": "16"}``, as
Triton's model-control examples send) is completed the same way; with
``--disable-auto-complete-config`` the same model fails to load and says why."""

from __future__ import annotations

import numpy as np
import pytest

from tests.fixtures.triton_examples import write_auto_complete_simple
from tests.helpers import InProcessServer

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")


@pytest.fixture
def repository(tmp_path):
    write_auto_complete_simple(tmp_path / "models" / "simple")
    return tmp_path / "models"


def _infer(client, module, batch: int) -> list[np.ndarray]:
    a = np.arange(16 * batch, dtype=np.int32).reshape(batch, 16)
    b = np.ones((batch, 16), dtype=np.int32)
    inputs = [module.InferInput("INPUT0", [batch, 16], "INT32")]
    inputs.append(module.InferInput("INPUT1", [batch, 16], "INT32"))
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    result = client.infer("simple", inputs)
    assert np.array_equal(result.as_numpy("OUTPUT0"), a + b)
    assert np.array_equal(result.as_numpy("OUTPUT1"), a - b)
    return [a, b]


def test_a_model_that_completes_its_config_serves_and_shows_it(repository):
    server = InProcessServer(repository, model_control_mode="explicit", load_model=["simple"])
    try:
        http = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        config = http.get_model_config("simple")
        assert config["max_batch_size"] == 8
        assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [
            ("INPUT0", "TYPE_INT32", [16]),
            ("INPUT1", "TYPE_INT32", [16]),
        ]
        assert [t["name"] for t in config["output"]] == ["OUTPUT0", "OUTPUT1"]
        _infer(http, httpclient, 8)
        _infer(grpc, grpcclient, 3)
        with pytest.raises(Exception, match="batch dimension 9 exceeds max_batch_size 8"):
            _infer(http, httpclient, 9)

        http.load_model("simple", config='{"max_batch_size": "16"}')
        assert http.get_model_config("simple")["max_batch_size"] == 16
        assert grpc.get_model_config("simple").config.max_batch_size == 16
        assert [t.name for t in grpc.get_model_config("simple").config.input] == [
            "INPUT0",
            "INPUT1",
        ]
        _infer(grpc, grpcclient, 16)
    finally:
        server.stop()


def test_with_auto_complete_disabled_the_model_fails_to_load_and_says_why(repository):
    server = InProcessServer(
        repository,
        model_control_mode="explicit",
        load_model=["simple"],
        disable_auto_complete_config=True,
    )
    try:
        http = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
        assert not http.is_model_ready("simple")
        index = {row["name"]: row for row in http.get_model_repository_index()}
        reason = index["simple"]["reason"]
        assert (
            "model 'simple' declares no inputs and no outputs, and auto-complete is off on "
            "this server (--disable-auto-complete-config)"
        ) in reason
    finally:
        server.stop()
