"""A Python model completing its own configuration at load: Triton's ``auto_complete_config``
on ``pb_utils.ModelConfig`` with Triton's rules, gpuserve's ``Model.complete_config``, and the
switches that turn it off (``--disable-auto-complete-config``, ``--strict-model-config``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuserve.backends.triton_python import utils as pb_utils
from gpuserve.backends.triton_python.backend import PythonModelBackend
from gpuserve.cli.main import build_parser
from gpuserve.config import parse_model_config
from gpuserve.errors import ConfigError
from gpuserve.repository.triton.config import load_triton_config


def _config(**fields):
    base = {"name": "m", "max_batch_size": 0, "input": [], "output": []}
    return pb_utils.ModelConfig({**base, **fields})


INT32_16 = {"data_type": "TYPE_INT32", "dims": [16]}


# -- pb_utils.ModelConfig: what the hook may and may not do --------------------------------


def test_model_config_adds_tensors_and_sets_batching():
    config = _config()
    config.add_input({"name": "INPUT0", **INT32_16, "optional": True})
    config.add_output({"name": "OUTPUT0", **INT32_16})
    config.set_max_batch_size(8)
    config.set_dynamic_batching()
    config.set_model_transaction_policy({"decoupled": True})
    data = config.as_dict()
    assert data["input"] == [{"name": "INPUT0", **INT32_16, "optional": True}]
    assert data["output"] == [{"name": "OUTPUT0", **INT32_16}]
    assert data["max_batch_size"] == 8
    assert data["dynamic_batching"] == {}
    assert data["model_transaction_policy"] == {"decoupled": True}


def test_model_config_accepts_json_text_as_triton_passes_it():
    config = pb_utils.ModelConfig('{"name": "m", "max_batch_size": 4}')
    assert config.as_dict() == {"name": "m", "max_batch_size": 4, "input": [], "output": []}


def test_a_declared_input_with_another_datatype_is_refused():
    config = _config(input=[{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [16]}])
    with pytest.raises(ValueError) as info:
        config.add_input({"name": "INPUT0", **INT32_16})
    assert str(info.value) == (
        "unable to load model 'm', configuration expects datatype TYPE_FP32 for input "
        "'INPUT0', model provides TYPE_INT32"
    )


def test_a_declared_output_with_other_dims_is_refused():
    config = _config(output=[{"name": "OUTPUT0", "data_type": "TYPE_INT32", "dims": [8]}])
    with pytest.raises(ValueError) as info:
        config.add_output({"name": "OUTPUT0", **INT32_16})
    assert str(info.value) == (
        "model 'm', tensor 'OUTPUT0': the model expects dims [16] but the model "
        "configuration specifies dims [8]"
    )


def test_a_declared_tensor_without_dims_gets_them():
    config = _config(input=[{"name": "INPUT0", "data_type": "TYPE_INT32", "dims": []}])
    config.add_input({"name": "INPUT0", **INT32_16})
    assert config.as_dict()["input"] == [{"name": "INPUT0", **INT32_16}]


def test_optional_cannot_be_flipped():
    config = _config(input=[{"name": "I", **INT32_16, "optional": False}])
    with pytest.raises(ValueError, match="the model expects optional True but the model"):
        config.add_input({"name": "I", **INT32_16, "optional": True})


@pytest.mark.parametrize(
    ("tensor", "text"),
    [
        (
            {"name": "I", "dims": [1]},
            "input 'I' in auto-complete-config function for model 'm' "
            "is missing 'data_type' property.",
        ),
        (
            {"data_type": "TYPE_INT32", "dims": [1]},
            "input in auto-complete-config function for model 'm' is missing 'name' property.",
        ),
        ({"name": "I", **INT32_16, "format": "FORMAT_NCHW"}, "contains property other than"),
    ],
)
def test_incomplete_or_unknown_tensor_properties_are_refused(tensor, text):
    with pytest.raises(ValueError) as info:
        _config().add_input(tensor)
    assert text in str(info.value)


def test_max_batch_size_cannot_go_below_the_configured_one():
    config = _config(max_batch_size=16)
    with pytest.raises(ValueError) as info:
        config.set_max_batch_size(8)
    assert str(info.value) == (
        "configuration specified max_batch_size 16, but in auto-complete-config function for "
        "model 'm' specified max_batch_size 8"
    )
    config.set_max_batch_size(32)
    assert config.as_dict()["max_batch_size"] == 32


def test_dynamic_batching_is_refused_beside_the_sequence_batcher():
    with pytest.raises(ValueError, match="scheduling_choice as 'sequence_batching'"):
        _config(sequence_batching={}).set_dynamic_batching()


def test_transaction_policy_takes_decoupled_only_and_never_flips_it():
    with pytest.raises(ValueError, match="contains property other than 'decoupled'"):
        _config().set_model_transaction_policy({"streaming": True})
    config = _config(model_transaction_policy={"decoupled": True})
    with pytest.raises(ValueError, match="which is already set to 'True'"):
        config.set_model_transaction_policy({"decoupled": False})


# -- the backend runs the hook at load -----------------------------------------------------

TRITON_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        {body}
        return auto_complete_model_config

    def execute(self, requests):
        return []
"""

COMPLETES = """config = auto_complete_model_config
        int32 = {"data_type": "TYPE_INT32", "dims": [16]}
        for name in ("INPUT0", "INPUT1"):
            config.add_input({"name": name, **int32})
        config.add_output({"name": "OUTPUT0", **int32})
        if config.as_dict()["max_batch_size"] == 0:
            config.set_max_batch_size(8)"""


def _triton_model(root: Path, pbtxt: str, body: str = COMPLETES) -> tuple[Path, object]:
    folder = root / "m"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(pbtxt)
    (folder / "1" / "model.py").write_text(TRITON_MODEL.format(body=body))
    return folder / "1", load_triton_config(folder / "config.pbtxt")


def test_a_config_naming_only_the_backend_is_completed_by_the_model(tmp_path):
    version, config = _triton_model(tmp_path, 'backend: "python"\n')
    done = PythonModelBackend.complete_config(config, version)
    assert [(t.name, t.datatype, t.shape) for t in done.inputs] == [
        ("INPUT0", "INT32", [16]),
        ("INPUT1", "INT32", [16]),
    ]
    assert [(t.name, t.datatype, t.shape) for t in done.outputs] == [("OUTPUT0", "INT32", [16])]
    assert done.max_batch_size == 8 and done.name == "m"


def test_a_configured_max_batch_size_stays_and_declared_tensors_keep_their_settings(tmp_path):
    pbtxt = (
        'backend: "python"\nmax_batch_size: 16\n'
        'input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] optional: true } ]\n'
        "instance_group [ { kind: KIND_CPU count: 2 } ]\n"
    )
    version, config = _triton_model(tmp_path, pbtxt)
    done = PythonModelBackend.complete_config(config, version)
    assert done.max_batch_size == 16
    assert done.inputs[0].optional is True and [t.name for t in done.inputs] == ["INPUT0", "INPUT1"]
    assert done.instance_group[0].count == 2 and done.instance_group[0].kind == "cpu"


def test_a_declared_input_the_model_contradicts_fails_the_load(tmp_path):
    pbtxt = 'backend: "python"\ninput [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]\n'
    version, config = _triton_model(tmp_path, pbtxt)
    with pytest.raises(ConfigError) as info:
        PythonModelBackend.complete_config(config, version)
    assert (
        "auto_complete_config failed: unable to load model 'm', configuration expects "
        "datatype TYPE_FP32 for input 'INPUT0', model provides TYPE_INT32"
    ) in info.value.message


def test_a_completed_config_still_without_outputs_is_refused(tmp_path):
    body = 'auto_complete_model_config.add_input({"name": "I", **%r})' % {
        "data_type": "TYPE_FP32",
        "dims": [1],
    }
    version, config = _triton_model(tmp_path, 'backend: "python"\n', body)
    with pytest.raises(ConfigError) as info:
        PythonModelBackend.complete_config(config, version)
    assert "model 'm' has no outputs after auto_complete_config" in info.value.message


def test_the_hook_must_return_the_config_object(tmp_path):
    version, config = _triton_model(tmp_path, 'backend: "python"\n', "return None")
    with pytest.raises(ConfigError, match="must return the pb_utils.ModelConfig it was given"):
        PythonModelBackend.complete_config(config, version)


def test_a_completed_config_is_validated_again(tmp_path):
    body = """config = auto_complete_model_config
        config.add_input({"name": "I", "data_type": "TYPE_FP32", "dims": [0]})
        config.add_output({"name": "O", "data_type": "TYPE_FP32", "dims": [1]})"""
    version, config = _triton_model(tmp_path, 'backend: "python"\n', body)
    with pytest.raises(ConfigError, match="inputs"):
        PythonModelBackend.complete_config(config, version)


def test_with_auto_complete_off_the_hook_does_not_run(tmp_path):
    version, config = _triton_model(tmp_path, 'backend: "python"\n')
    with pytest.raises(ConfigError) as info:
        PythonModelBackend.complete_config(config, version, auto_complete=False)
    assert (
        "model 'm' declares no inputs and no outputs, and auto-complete is off on this "
        "server (--disable-auto-complete-config)" in info.value.message
    )


# -- gpuserve's Model.complete_config ------------------------------------------------------

GPUSERVE_MODEL = """
from gpuserve.backends.python import PythonModel
from gpuserve.config import TensorSpec


class Model(PythonModel):
    @classmethod
    def complete_config(cls, config):
        {body}

    def forward(self, batch):
        return batch
"""


def _gpuserve_model(root: Path, data: dict, body: str):
    version = root / "m" / "1"
    version.mkdir(parents=True)
    (version / "model.py").write_text(GPUSERVE_MODEL.format(body=body))
    return version, parse_model_config(data, root / "m" / "config.yaml", "m")


ADD_TENSORS = """return config.model_copy(update={
            "inputs": [*config.inputs, TensorSpec(name="X", datatype="FP32", shape=[4])],
            "outputs": [TensorSpec(name="Y", datatype="FP32", shape=[4])],
            "max_batch_size": 4,
        })"""


def test_a_gpuserve_model_completes_its_config(tmp_path):
    version, config = _gpuserve_model(tmp_path, {"backend": "python"}, ADD_TENSORS)
    done = PythonModelBackend.complete_config(config, version)
    assert [t.name for t in done.inputs] == ["X"] and [t.name for t in done.outputs] == ["Y"]
    assert done.max_batch_size == 4


def test_a_gpuserve_model_may_not_lower_a_configured_batch_size(tmp_path):
    version, config = _gpuserve_model(
        tmp_path, {"backend": "python", "max_batch_size": 16}, ADD_TENSORS
    )
    with pytest.raises(ConfigError, match="below the configured max_batch_size 16"):
        PythonModelBackend.complete_config(config, version)


def test_a_gpuserve_model_may_not_change_a_declared_tensor(tmp_path):
    data = {
        "backend": "python",
        "inputs": [{"name": "X", "datatype": "INT32", "shape": [4]}],
        "outputs": [{"name": "Y", "datatype": "FP32", "shape": [4]}],
    }
    body = """return config.model_copy(update={
            "inputs": [TensorSpec(name="X", datatype="FP32", shape=[4])]})"""
    version, config = _gpuserve_model(tmp_path, data, body)
    with pytest.raises(ConfigError) as info:
        PythonModelBackend.complete_config(config, version)
    assert (
        "Model.complete_config changed input 'X': the configuration declares INT32 [4], "
        "the model gives FP32 [4]"
    ) in info.value.message


def test_a_gpuserve_model_whose_hook_raises_fails_the_load_with_the_cause(tmp_path):
    body = 'raise ValueError("no tensors today")'
    version, config = _gpuserve_model(tmp_path, {"backend": "python"}, body)
    with pytest.raises(ConfigError, match="Model.complete_config failed: no tensors today"):
        PythonModelBackend.complete_config(config, version)


def test_a_gpuserve_model_may_not_change_other_fields(tmp_path):
    body = 'return config.model_copy(update={"precision": "fp16"})'
    version, config = _gpuserve_model(tmp_path, {"backend": "python"}, body)
    with pytest.raises(ConfigError, match="may only change .*; it changed precision"):
        PythonModelBackend.complete_config(config, version)


# -- the switches ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "disabled"),
    [
        ([], None),
        (["--disable-auto-complete-config"], True),
        (["--strict-model-config=true"], True),
        (["--strict-model-config", "false"], False),
        (["--strict-model-config=false", "--disable-auto-complete-config"], True),
    ],
)
def test_serve_flags_turn_auto_complete_off_as_in_triton(flags, disabled, monkeypatch):
    from gpuserve.cli import serve

    seen = {}

    def fake_server_config(**overrides):
        seen.update(overrides)
        raise SystemExit(0)

    monkeypatch.setattr("gpuserve.config.ServerConfig", fake_server_config)
    args = build_parser().parse_args(["serve", *flags])
    with pytest.raises(SystemExit):
        serve.run(args)
    assert seen.get("disable_auto_complete_config") == disabled


def test_strict_model_config_takes_a_boolean():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--strict-model-config=maybe"])
