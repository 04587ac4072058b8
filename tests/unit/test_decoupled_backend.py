"""Decoupled models below the server: the configuration (config.yaml and config.pbtxt), and
the two model APIs driven straight through the backend (a generator ``Model.generate``;
Triton's response sender) into a recording sink."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from gpuserve.backends import create_backend
from gpuserve.backends.base import LoadContext
from gpuserve.backends.triton_python import utils as pb_utils
from gpuserve.config import ModelConfig
from gpuserve.errors import BackendError, InvalidInputError
from gpuserve.repository.triton.config import load_triton_config

FIXTURES = Path(__file__).parents[1] / "fixtures" / "decoupled"

IO = {
    "inputs": [{"name": "IN", "datatype": "INT32", "shape": [-1]}],
    "outputs": [{"name": "OUT", "datatype": "INT32", "shape": [1]}],
}


def test_config_yaml_decoupled_policy_and_its_buffer():
    config = ModelConfig(**IO, model_transaction_policy={"decoupled": True})
    assert config.model_transaction_policy.decoupled
    assert config.model_transaction_policy.max_buffered_responses == 16
    assert not ModelConfig(**IO).model_transaction_policy.decoupled


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ({"decoupled": True, "max_buffered_responses": 0}, "greater than or equal to 1"),
        ({"decoupled": True, "buffer": 4}, "buffer"),
    ],
)
def test_bad_policy_values_are_refused_naming_the_field(policy, message):
    with pytest.raises(ValidationError, match=message):
        ModelConfig(**IO, model_transaction_policy=policy)


def test_decoupled_needs_the_python_backend():
    with pytest.raises(ValidationError, match="decoupled needs backend 'python'"):
        ModelConfig(backend="onnx", model_transaction_policy={"decoupled": True})


def test_config_pbtxt_decoupled_maps_onto_the_policy():
    config = load_triton_config(FIXTURES / "repeat_int32" / "config.pbtxt")
    assert config.model_transaction_policy.decoupled
    assert config.max_batch_size == 0
    assert [t.name for t in config.inputs] == ["IN", "DELAY", "WAIT"]


class Sink:
    """Records what a backend sends (thread-safe enough for the tests' single producer)."""

    def __init__(self, cancel_after: int | None = None) -> None:
        self.sent: list[tuple] = []
        self.cancel_after = cancel_after
        self.done = threading.Event()
        self.request_id = "r1"
        self.parameters = {"p": 1}

    def send(self, outputs, *, final=False, error=None) -> bool:
        if self.is_cancelled():
            return False
        self.sent.append((outputs, final, error))
        if final:
            self.done.set()
        return True

    def is_cancelled(self) -> bool:
        return self.cancel_after is not None and len(self.sent) >= self.cancel_after


def decoupled_config() -> ModelConfig:
    return ModelConfig(
        name="m", **IO, max_batch_size=0, model_transaction_policy={"decoupled": True}
    )


def loaded(tmp_path: Path, source: str, config: ModelConfig):
    folder = tmp_path / "m" / "1"
    folder.mkdir(parents=True)
    (folder / "model.py").write_text(source)
    backend = create_backend("python")
    backend.load(LoadContext(config=config, version_path=folder, version=1))
    return backend


GENERATOR = """
import numpy as np
from gpuserve import PythonModel

class Model(PythonModel):
    def generate(self, inputs):
        for value in inputs["IN"]:
            yield {"OUT": np.array([value], dtype=np.int32)}
"""


def test_a_generator_model_streams_through_the_backend(tmp_path):
    config = decoupled_config()
    backend = loaded(tmp_path, GENERATOR, config)
    sink = Sink()
    backend.stream({"IN": np.array([5, 6, 7], dtype=np.int32)}, sink)
    assert [o["OUT"].tolist() for o, _, _ in sink.sent[:3]] == [[5], [6], [7]]
    assert sink.sent[3] == (None, True, None)


TRITON_DECOUPLED = """
import json
import threading
import numpy as np
import triton_python_backend_utils as pb_utils

SEEN = {}


class TritonPythonModel:
    def initialize(self, args):
        SEEN["decoupled"] = pb_utils.using_decoupled_model_transaction_policy(
            json.loads(args["model_config"])
        )

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            SEEN["id"] = request.request_id()
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if values.size and values[0] < 0:
                error = pb_utils.TritonError("negative", pb_utils.TritonError.INVALID_ARG)
                sender.send(
                    pb_utils.InferenceResponse(error=error),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
                continue
            def respond(sender=sender, values=values):
                for value in values:
                    if sender.is_cancelled():
                        break
                    out = pb_utils.Tensor("OUT", np.array([value], dtype=np.int32))
                    sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                try:
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                except pb_utils.TritonError as err:
                    SEEN["twice"] = err.message()
            threading.Thread(target=respond).start()
        return None
"""


def test_a_triton_model_sends_from_its_own_thread_through_the_response_sender(tmp_path):
    config = decoupled_config()
    backend = loaded(tmp_path, TRITON_DECOUPLED, config)
    sink = Sink()
    backend.stream({"IN": np.array([1, 2], dtype=np.int32)}, sink)  # returns at once
    assert sink.done.wait(10)
    assert [o["OUT"].tolist() for o, _, _ in sink.sent[:2]] == [[1], [2]]
    assert sink.sent[2] == (None, True, None)
    seen = type(backend.model).execute.__globals__["SEEN"]
    assert seen["decoupled"] is True and seen["id"] == "r1"
    assert "already sent" in _wait_for(seen, "twice")


def _wait_for(table: dict, key: str) -> str:
    from tests.helpers import wait_until

    wait_until(lambda: key in table, 10.0, f"{key} recorded")
    return table[key]


def test_a_triton_error_response_maps_to_its_status(tmp_path):
    config = decoupled_config()
    backend = loaded(tmp_path, TRITON_DECOUPLED, config)
    sink = Sink()
    backend.stream({"IN": np.array([-1], dtype=np.int32)}, sink)
    ((outputs, final, error),) = sink.sent
    assert outputs is None and final and isinstance(error, InvalidInputError)
    assert error.message == "negative"


def test_a_triton_sender_reports_cancellation(tmp_path):
    sink = Sink(cancel_after=1)
    sender = pb_utils.InferenceResponseSender(sink)
    out = pb_utils.Tensor("OUT", np.array([1], dtype=np.int32))
    assert not sender.is_cancelled()
    sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
    assert sender.is_cancelled()
    sender.send(pb_utils.InferenceResponse(output_tensors=[out]))  # dropped, no error
    assert len(sink.sent) == 1


def test_execute_returning_responses_in_decoupled_mode_fails_clearly(tmp_path):
    source = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse() for _ in requests]
"""
    config = decoupled_config()
    backend = loaded(tmp_path, source, config)
    with pytest.raises(BackendError, match="must return None"):
        backend.stream({"IN": np.array([1], dtype=np.int32)}, Sink())


def test_a_model_that_is_not_decoupled_has_no_response_sender():
    request = pb_utils.InferenceRequest([])
    with pytest.raises(pb_utils.TritonError, match="not decoupled"):
        request.get_response_sender()
    assert request.is_cancelled() is False
    assert pb_utils.using_decoupled_model_transaction_policy(json.loads("{}")) is False
