"""The torch backend's torch.export support: reading a program's signature, loading model.pt2."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpuserve.backends.base import LoadContext
from gpuserve.backends.torch_backend import TorchBackend, exported_signature
from gpuserve.config import parse_model_config
from gpuserve.errors import ConfigError


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(6, 3)

    def forward(self, features, ids):
        return {"scores": self.proj(features), "count": (ids > 0).sum(dim=1)}


def export(module, example, batch_max=None):
    batch = torch.export.Dim("batch", max=batch_max) if batch_max else torch.export.Dim("batch")
    shapes = tuple({0: batch} for _ in example)
    return torch.export.export(module.eval(), example, dynamic_shapes=shapes)


@pytest.fixture(scope="module")
def program():
    torch.manual_seed(0)
    example = (torch.randn(2, 6), torch.ones(2, 5, dtype=torch.int64))
    return export(TwoHeads(), example, batch_max=16)


def test_signature_reads_argument_names_dtypes_shapes_and_dict_keys(program):
    sig = exported_signature(program)
    assert [(t.name, t.datatype, t.shape) for t in sig.inputs] == [
        ("features", "FP32", (None, 6)),
        ("ids", "INT64", (None, 5)),
    ]
    assert [(t.name, t.datatype, t.shape) for t in sig.outputs] == [
        ("scores", "FP32", (None, 3)),
        ("count", "INT64", (None,)),
    ]
    assert sig.inputs_by_name is False
    assert sig.outputs_by_name is True
    assert sig.max_batch == 16


def test_unbounded_batch_has_no_limit():
    program = export(torch.nn.Linear(4, 2), (torch.randn(3, 4),))
    sig = exported_signature(program)
    assert sig.max_batch is None
    assert [t.name for t in sig.outputs] == ["OUTPUT0"]
    assert sig.outputs_by_name is False


def test_completed_config_and_serving_a_pt2(tmp_path, program):
    folder = tmp_path / "two" / "1"
    folder.mkdir(parents=True)
    torch.export.save(program, str(folder / "model.pt2"))
    raw = parse_model_config({"backend": "torch"}, tmp_path / "two/config.yaml", "two")
    config = TorchBackend.complete_config(raw, folder)
    assert config.max_batch_size == 8  # the default, within the program's 16
    assert [(t.name, t.shape) for t in config.inputs] == [("features", [6]), ("ids", [5])]
    assert [(t.name, t.datatype) for t in config.outputs] == [
        ("scores", "FP32"),
        ("count", "INT64"),
    ]
    backend = TorchBackend()
    backend.load(LoadContext(config=config, version_path=folder, version=1))
    features = np.random.default_rng(0).standard_normal((3, 6)).astype(np.float32)
    ids = np.array([[1, 0, 2, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=np.int64)
    out = backend.postprocess(
        backend.forward(backend.preprocess({"features": features, "ids": ids}))
    )
    assert out["count"].tolist() == [2, 0, 5]
    with torch.inference_mode():
        expected = program.module()(torch.from_numpy(features), torch.from_numpy(ids))["scores"]
    np.testing.assert_allclose(out["scores"], expected.numpy(), rtol=1e-6, atol=1e-6)


def test_dict_output_names_are_checked(tmp_path, program):
    folder = tmp_path / "two" / "1"
    folder.mkdir(parents=True)
    torch.export.save(program, str(folder / "model.pt2"))
    raw = parse_model_config(
        {"backend": "torch", "outputs": [{"name": "logits", "datatype": "FP32", "shape": [3]}]},
        tmp_path / "two/config.yaml",
        "two",
    )
    with pytest.raises(ConfigError) as info:
        TorchBackend.complete_config(raw, folder)
    assert "output 'logits': declared in config.yaml, but model.pt2 has no such output" in (
        info.value.message
    )


def test_a_file_that_is_not_a_program(tmp_path):
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.pt2").write_bytes(b"nope")
    raw = parse_model_config({"backend": "torch"}, tmp_path / "config.yaml", "m")
    with pytest.raises(ConfigError, match=r"not a torch\.export program"):
        TorchBackend.complete_config(raw, tmp_path / "1")


def test_torchscript_and_source_models_must_declare(tmp_path):
    (tmp_path / "1").mkdir()
    raw = parse_model_config({"backend": "torch"}, tmp_path / "config.yaml", "m")
    with pytest.raises(ConfigError, match="inputs and outputs omitted"):
        TorchBackend.complete_config(raw, tmp_path / "1")
