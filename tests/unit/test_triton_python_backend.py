"""Triton's Python backend API: a ``model.py`` written against ``triton_python_backend_utils``
runs on the ``python`` backend unchanged (initialize/execute/finalize, tensors, per-request
errors, ``args``), beside gpuserve's own ``Model`` classes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from gpuserve.backends import create_backend
from gpuserve.backends.base import LoadContext, RowErrors
from gpuserve.backends.triton_python import utils as pb_utils
from gpuserve.config import ModelConfig
from gpuserve.errors import BackendError, ConfigError, InvalidInputError

TRITON_MODEL = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils

EVENTS = []


class TritonPythonModel:
    def initialize(self, args):
        self.args = args
        config = json.loads(args["model_config"])
        out = pb_utils.get_output_config_by_name(config, "OUTPUT0")
        self.dtype = pb_utils.triton_string_to_numpy(out["data_type"])
        EVENTS.append(("initialize", args["model_name"], args["model_version"]))

    def execute(self, requests):
        EVENTS.append(("execute", len(requests)))
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            if (x < 0).any():
                error = pb_utils.TritonError("negative input", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            if (x > 100).any():
                responses.append(pb_utils.InferenceResponse(error="too large"))
                continue
            out = pb_utils.Tensor("OUTPUT0", (x * 2).astype(self.dtype))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses

    def finalize(self):
        EVENTS.append(("finalize",))
"""


def config(max_batch_size: int = 8) -> ModelConfig:
    return ModelConfig(
        name="doubler",
        backend="python",
        max_batch_size=max_batch_size,
        inputs=[{"name": "INPUT0", "datatype": "FP32", "shape": [2]}],
        outputs=[{"name": "OUTPUT0", "datatype": "FP32", "shape": [2]}],
    )


def loaded(tmp_path: Path, source: str, max_batch_size: int = 8):
    version = tmp_path / "doubler" / "1"
    version.mkdir(parents=True, exist_ok=True)
    (version / "model.py").write_text(source)
    backend = create_backend("python")
    backend.load(LoadContext(config(max_batch_size), version, 1))
    return backend


def run(backend, inputs):
    return backend.postprocess(backend.forward(backend.preprocess(inputs)))


def events(backend) -> list:
    return sys.modules[type(backend.impl.model).__module__].EVENTS


def test_a_triton_model_runs_per_request_and_finalizes(tmp_path):
    backend = loaded(tmp_path, TRITON_MODEL)
    assert events(backend) == [("initialize", "doubler", "1")]
    args = backend.impl.model.args
    assert args["model_instance_kind"] == "CPU" and args["model_instance_device_id"] == "0"
    assert args["model_repository"] == str(tmp_path / "doubler")
    model_config = json.loads(args["model_config"])
    assert model_config["max_batch_size"] == 8
    assert model_config["input"][0] == {
        "name": "INPUT0",
        "data_type": "TYPE_FP32",
        "format": "FORMAT_NONE",
        "dims": [2],
        "optional": False,
    }
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    outputs = run(backend, {"INPUT0": x})
    assert not isinstance(outputs, RowErrors)
    np.testing.assert_array_equal(outputs["OUTPUT0"], x * 2)
    assert events(backend)[-1] == ("execute", 3)  # one InferenceRequest per row
    module_events = events(backend)
    backend.unload()
    assert module_events[-1] == ("finalize",)


def test_a_response_with_an_error_fails_only_its_request(tmp_path):
    backend = loaded(tmp_path, TRITON_MODEL)
    x = np.array([[1, 2], [-1, 0], [3, 4], [101, 0]], dtype=np.float32)
    outputs = run(backend, {"INPUT0": x})
    assert isinstance(outputs, RowErrors)
    assert sorted(outputs.errors) == [1, 3]
    assert isinstance(outputs.errors[1], InvalidInputError)
    assert outputs.errors[1].message == "negative input"
    assert isinstance(outputs.errors[3], BackendError) and outputs.errors[3].message == "too large"
    np.testing.assert_array_equal(outputs["OUTPUT0"][[0, 2]], x[[0, 2]] * 2)


def test_without_batching_execute_gets_the_request_whole(tmp_path):
    backend = loaded(tmp_path, TRITON_MODEL, max_batch_size=0)
    x = np.array([1, 2], dtype=np.float32)
    np.testing.assert_array_equal(run(backend, {"INPUT0": x})["OUTPUT0"], x * 2)
    assert events(backend)[-1] == ("execute", 1)


def test_a_wrong_number_of_responses_fails_the_batch(tmp_path):
    source = TRITON_MODEL.replace("return responses", "return responses[:1]")
    backend = loaded(tmp_path, source)
    with pytest.raises(BackendError, match="got 1 for 2 request"):
        backend.forward(backend.preprocess({"INPUT0": np.ones((2, 2), np.float32)}))


def test_a_gpuserve_model_class_still_runs(tmp_path):
    source = (
        "from gpuserve.backends.python import PythonModel\n"
        "class Model(PythonModel):\n"
        "    def forward(self, batch):\n"
        "        return {'OUTPUT0': batch['INPUT0'] + 1}\n"
    )
    backend = loaded(tmp_path, source)
    x = np.zeros((2, 2), np.float32)
    np.testing.assert_array_equal(run(backend, {"INPUT0": x})["OUTPUT0"], x + 1)


def test_a_model_py_with_neither_class_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no class named 'Model' \\(or Triton's"):
        loaded(tmp_path, "x = 1\n")


def test_tensors_dlpack_and_types():
    array = np.arange(4, dtype=np.float32)
    tensor = pb_utils.Tensor("t", array)
    back = pb_utils.Tensor.from_dlpack("u", tensor.to_dlpack())
    np.testing.assert_array_equal(back.as_numpy(), array)
    import torch

    from_torch = pb_utils.Tensor.from_dlpack("v", torch.arange(3))
    assert from_torch.as_numpy().tolist() == [0, 1, 2]
    with pytest.raises(pb_utils.TritonError):
        pb_utils.Tensor("s", np.array([b"a"], dtype=object)).to_dlpack()
    assert pb_utils.triton_string_to_numpy("TYPE_STRING") is np.object_
    assert pb_utils.numpy_to_triton_type(np.int64) == "TYPE_INT64"
    request = pb_utils.InferenceRequest([tensor], requested_output_names=["x"])
    assert pb_utils.get_input_tensor_by_name(request, "t") is tensor
    assert pb_utils.get_input_tensor_by_name(request, "nope") is None
    outside = request.exec()  # BLS outside a served model: an error response, not a raise
    assert outside.has_error() and "no model caller" in outside.error().message()
    response = pb_utils.InferenceResponse([tensor])
    assert pb_utils.get_output_tensor_by_name(response, "t") is tensor
    assert not response.has_error()
