"""``gpuserve export``: a torch model (model.py, model.pt) to ONNX in the repository, served
by the onnx backend with the same outputs as the torch backend."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import yaml

from gpuserve.cli.main import main
from tests.fixtures.backend_models import make_module, reference, write_model
from tests.helpers import InProcessServer

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

PYTHON_MODEL = """\
from gpuserve import PythonModel


class Model(PythonModel):
    def forward(self, batch):
        return {"OUTPUT0": batch["INPUT0"][:, :4]}
"""


@pytest.fixture(scope="module")
def module():
    return make_module(seed=3)


@pytest.fixture(scope="module")
def repository(tmp_path_factory, module):
    repo = tmp_path_factory.mktemp("export")
    write_model(repo, "mlp", "torch", module)
    write_model(repo, "mlp_script", "torchscript", module)
    write_model(repo, "mlp_pt2", "torch.export", module)
    folder = write_model(repo, "py", "torch", module)
    config = (folder / "config.yaml").read_text().replace("backend: torch", "backend: python")
    (folder / "config.yaml").write_text(config)
    (folder / "1" / "model.py").write_text(PYTHON_MODEL)
    return repo


def export(repository, *args):
    return main(["export", "--model-repository", str(repository), *args])


@pytest.fixture(scope="module")
def exported(repository):
    """mlp -> mlp_onnx 1 (fp32), 2 (fp16); mlp_script -> mlp_onnx 5 (fp32)."""
    assert export(repository, "mlp") == 0
    assert export(repository, "mlp", "--fp16") == 0
    assert export(repository, "mlp_script", "--to-model", "mlp_onnx", "--to-version", "5") == 0
    return repository / "mlp_onnx"


def test_export_writes_a_new_onnx_model(exported):
    assert sorted(p.name for p in exported.iterdir()) == ["1", "2", "5", "config.yaml"]
    for version in ("1", "2", "5"):
        assert (exported / version / "model.onnx").is_file()
    config = yaml.safe_load((exported / "config.yaml").read_text())
    assert config["backend"] == "onnx"
    assert config["max_batch_size"] == 8
    assert config["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": [8]}]
    assert config["outputs"] == [{"name": "OUTPUT0", "datatype": "FP32", "shape": [4]}]
    assert config["dynamic_batching"] == {"max_queue_delay_us": 10000}
    assert not list(exported.parent.glob(".*")), "staging folders left behind"


def test_export_graph_has_dynamic_batch_and_fp32_io(exported):
    import onnx

    for version in ("1", "2"):
        graph = onnx.load(str(exported / version / "model.onnx")).graph
        assert graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
        assert graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
        assert graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    fp16 = onnx.load(str(exported / "2" / "model.onnx")).graph
    weights = {init.data_type for init in fp16.initializer}
    assert onnx.TensorProto.FLOAT16 in weights
    assert onnx.TensorProto.FLOAT not in weights


def test_exported_versions_serve_the_torch_outputs(exported, module):
    config = exported / "config.yaml"
    config.write_text(config.read_text() + "version_policy: {all: {}}\n")
    server = InProcessServer(exported.parent)
    try:
        data = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
        body = {
            "inputs": [
                {
                    "name": "INPUT0",
                    "shape": [5, 8],
                    "datatype": "FP32",
                    "data": data.ravel().tolist(),
                }
            ]
        }
        expected = reference(module, data)
        tolerance = {"1": 1e-5, "2": 2e-2, "5": 1e-5}
        with httpx.Client(base_url=server.url, timeout=30.0) as client:
            for version, atol in tolerance.items():
                response = client.post(f"/v2/models/mlp_onnx/versions/{version}/infer", json=body)
                assert response.status_code == 200, response.text
                out = response.json()["outputs"][0]
                assert out["datatype"] == "FP32"
                got = np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])
                np.testing.assert_allclose(got, expected, atol=atol, rtol=atol, err_msg=version)
    finally:
        server.stop()


def test_export_prints_what_it_did(repository, capsys):
    assert export(repository, "mlp", "--to-model", "mlp_copy") == 0
    out = capsys.readouterr().out
    assert f"exported mlp:1 to {repository / 'mlp_copy' / '1' / 'model.onnx'}" in out
    assert "wrote" in out and "check: max |onnxruntime - torch| =" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nope"], "no model 'nope'"),
        (["py"], "has backend 'python'; export converts backend 'torch' models"),
        (["mlp_pt2"], "needs the dynamo exporter"),
        (["mlp", "--version", "4"], "model 'mlp' has no version 4 (it has [1])"),
        (["mlp", "--to-model", "mlp_script"], "backend is 'torch', not 'onnx'"),
        (["mlp", "--opset", "13"], "opset 13 is too old"),
    ],
)
def test_export_refusals(repository, capsys, args, message):
    assert export(repository, *args) == 1
    assert message in capsys.readouterr().err


def test_export_never_overwrites_a_version(repository, exported, capsys):
    assert export(repository, "mlp", "--to-version", "1") == 1
    assert f"{exported / '1'} exists; choose another --to-version" in capsys.readouterr().err
