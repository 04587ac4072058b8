"""One backend suite over every model format: torch (model.py), torchscript (model.pt),
torch.export (model.pt2) and onnx (model.onnx), all written at test time from the same
seeded module and served together by the real server.

Also the config auto-completion of onnx and torch.export models: omitted inputs/outputs are
filled in from the model file and shown at ``/v2/models/{m}/config``; a declaration that
disagrees with the model fails that model's load with a message naming both values.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from tests.fixtures.backend_models import FORMATS, make_module, reference, write_model
from tests.helpers import InProcessServer

pytest.importorskip("onnxruntime")

MODELS = {fmt: "fmt_" + fmt.replace(".", "_") for fmt in FORMATS}

BAD_IO = """\
inputs:
  - {name: INPUT0, datatype: FP64, shape: [8]}
outputs:
  - {name: OUTPUT0, datatype: FP32, shape: [5]}
"""


@pytest.fixture(scope="module")
def module():
    return make_module(seed=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory, module):
    repository = tmp_path_factory.mktemp("formats")
    for fmt, name in MODELS.items():
        write_model(repository, name, fmt, module)
    # Auto-completion: nothing declared (onnx), only max_batch_size (torch.export).
    write_model(repository, "auto_onnx", "onnx", module, config="instance_group: [{kind: cpu}]\n")
    write_model(repository, "auto_export", "torch.export", module, config="max_batch_size: 4\n")
    # A graph with a fixed batch of 2 and max_batch_size omitted: completed to 0.
    write_model(repository, "auto_fixed_onnx", "onnx", module, config="", dynamic_batch=False)
    # Declarations that disagree with the model file.
    write_model(repository, "bad_onnx", "onnx", module, config=f"max_batch_size: 8\n{BAD_IO}")
    write_model(
        repository, "bad_export", "torch.export", module, config=f"max_batch_size: 16\n{BAD_IO}"
    )
    write_model(
        repository,
        "bad_fixed_onnx",
        "onnx",
        module,
        config="max_batch_size: 8\n",
        dynamic_batch=False,
    )
    # TorchScript declares nothing readable: omitting inputs/outputs is an error.
    write_model(repository, "auto_torchscript", "torchscript", module, config="max_batch_size: 8\n")
    running = InProcessServer(repository)
    yield running
    running.stop()


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, timeout=30.0) as http:
        yield http


def infer(client, model, rows, name="INPUT0", datatype="FP32"):
    body = {
        "inputs": [
            {
                "name": name,
                "shape": list(rows.shape),
                "datatype": datatype,
                "data": rows.reshape(-1).tolist(),
            }
        ]
    }
    return client.post(f"/v2/models/{model}/infer", json=body)


def output(response, name="OUTPUT0"):
    assert response.status_code == 200, response.text
    out = {o["name"]: o for o in response.json()["outputs"]}[name]
    assert out["datatype"] == "FP32"
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def rows(n, seed):
    return np.random.default_rng(seed).standard_normal((n, 8)).astype(np.float32)


# -- the same model in every format --------------------------------------------------------


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_format_serves_reference_outputs(client, module, fmt):
    for n in (1, 5, 8):
        data = rows(n, seed=n)
        got = output(infer(client, MODELS[fmt], data))
        assert got.shape == (n, 4)
        np.testing.assert_allclose(got, reference(module, data), rtol=1e-5, atol=1e-5)


def test_formats_agree_with_each_other(client):
    data = rows(6, seed=42)
    results = {fmt: output(infer(client, name, data)) for fmt, name in MODELS.items()}
    for fmt, got in results.items():
        np.testing.assert_allclose(got, results["torch"], rtol=1e-5, atol=1e-5, err_msg=fmt)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_format_concurrent_requests_are_batched_and_split(client, server, module, fmt):
    model = MODELS[fmt]
    before = client.get(f"/v2/models/{model}/stats").json()["model_stats"][0]
    sizes = [1 + i % 3 for i in range(24)]
    inputs = [rows(n, seed=100 + i) for i, n in enumerate(sizes)]

    def call(data):
        with httpx.Client(base_url=server.url, timeout=30.0) as own:
            return output(infer(own, model, data))

    with ThreadPoolExecutor(max_workers=12) as pool:
        results = list(pool.map(call, inputs))
    for data, got in zip(inputs, results, strict=True):
        np.testing.assert_allclose(got, reference(module, data), rtol=1e-5, atol=1e-5)
    after = client.get(f"/v2/models/{model}/stats").json()["model_stats"][0]
    executions = after["execution_count"] - before["execution_count"]
    assert executions < len(inputs), "no two concurrent requests shared a batch"


BAD_INPUTS = {
    "wrong_datatype": dict(data=np.zeros((2, 8)), datatype="FP64"),
    "wrong_shape": dict(data=np.zeros((2, 7))),
    "unknown_input": dict(data=np.zeros((2, 8)), name="BOGUS"),
    "too_many_rows": dict(data=np.zeros((9, 8))),
    "no_batch_dim": dict(data=np.zeros(8)),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_formats_refuse_bad_input_alike(client, case):
    spec = dict(BAD_INPUTS[case])
    data = spec.pop("data")
    answers = {}
    for fmt, model in MODELS.items():
        response = infer(client, model, data.astype(np.float32), **spec)
        answers[fmt] = (response.status_code, response.json()["error"].replace(model, "<m>"))
    assert answers["torch"][0] == 400
    assert len(set(answers.values())) == 1, answers


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_format_metadata_is_the_same(client, fmt):
    meta = client.get(f"/v2/models/{MODELS[fmt]}").json()
    assert meta["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 8]}]
    assert meta["outputs"] == [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, 4]}]


# -- config auto-completion ----------------------------------------------------------------


def test_onnx_config_is_completed_from_the_graph(client, module):
    config = client.get("/v2/models/auto_onnx/config/gpuserve").json()
    assert config["backend"] == "onnx"
    assert config["max_batch_size"] == 8
    assert [(t["name"], t["datatype"], t["shape"]) for t in config["inputs"]] == [
        ("INPUT0", "FP32", [8])
    ]
    assert [(t["name"], t["datatype"], t["shape"]) for t in config["outputs"]] == [
        ("OUTPUT0", "FP32", [4])
    ]
    meta = client.get("/v2/models/auto_onnx").json()
    assert meta["inputs"][0]["shape"] == [-1, 8]
    data = rows(3, seed=7)
    got = output(infer(client, "auto_onnx", data))
    np.testing.assert_allclose(got, reference(module, data), rtol=1e-5, atol=1e-5)


def test_export_config_is_completed_from_the_program(client, module):
    config = client.get("/v2/models/auto_export/config/gpuserve").json()
    assert config["max_batch_size"] == 4  # declared; the program allows up to 8
    # Inputs are named after forward's arguments; a single tensor result is OUTPUT0.
    assert [(t["name"], t["datatype"], t["shape"]) for t in config["inputs"]] == [
        ("x", "FP32", [8])
    ]
    assert [(t["name"], t["datatype"], t["shape"]) for t in config["outputs"]] == [
        ("OUTPUT0", "FP32", [4])
    ]
    data = rows(4, seed=8)
    got = output(infer(client, "auto_export", data, name="x"))
    np.testing.assert_allclose(got, reference(module, data), rtol=1e-5, atol=1e-5)


def test_fixed_batch_graph_completes_to_no_batching(client, module):
    config = client.get("/v2/models/auto_fixed_onnx/config/gpuserve").json()
    assert config["max_batch_size"] == 0
    assert config["inputs"][0]["shape"] == [2, 8]
    data = rows(2, seed=9)
    got = output(infer(client, "auto_fixed_onnx", data))
    np.testing.assert_allclose(got, reference(module, data), rtol=1e-5, atol=1e-5)


def reason(client, model):
    response = client.get(f"/v2/models/{model}/ready")
    assert response.status_code == 503
    return response.json()["reason"]


def test_disagreeing_onnx_declaration_names_both_values(client):
    text = reason(client, "bad_onnx")
    assert "config.yaml declares datatype FP64, but model.onnx has FP32" in text
    assert "config.yaml declares shape [5], but model.onnx has [4]" in text


def test_disagreeing_export_declaration_names_both_values(client):
    text = reason(client, "bad_export")
    assert "max_batch_size: 16, but model.pt2 accepts batches of at most 8 rows" in text


def test_fixed_batch_graph_with_batching_is_refused(client):
    text = reason(client, "bad_fixed_onnx")
    assert "model.onnx has shape [2, 8] with no dynamic first dimension" in text
    assert "max_batch_size: 8" in text


def test_torchscript_cannot_omit_inputs(client):
    text = reason(client, "auto_torchscript")
    assert "inputs and outputs omitted" in text and "declare them in config.yaml" in text


def test_failed_models_do_not_affect_the_others(client):
    assert client.get("/v2/health/ready").status_code == 200
    index = {row["name"]: row["state"] for row in client.post("/v2/repository/index").json()}
    for name in MODELS.values():
        assert index[name] == "READY"
