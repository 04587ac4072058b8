"""Triton's classification extension and its trace-setting and log-setting APIs, with
tritonclient over HTTP and gRPC.

* ``classification: k`` on an output: top-k ``score:index:label`` BYTES strings, labels from the
  output's ``label_filename`` (config.pbtxt and config.yaml), per row for a batching model.
* ``/v2/trace/setting`` (server-wide and per model) and gRPC ``TraceSetting``: Triton's keys,
  TIMESTAMPS traces written to ``trace_file``, model overrides and clearing them, bad values 400.
* ``/v2/logging`` and gRPC ``LogSettings``: the root logger's level changes at run time.
"""

from __future__ import annotations

import json
import logging
import re

import httpx
import numpy as np
import pytest

from tests.fixtures.triton_examples import LABELS, write_triton_examples
from tests.helpers import InProcessServer

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

#: Batched scores with labels for 3 of its 5 classes (config.yaml).
SCORES_YAML = """
backend: python
max_batch_size: 4
inputs:
  - {name: X, datatype: FP32, shape: [5]}
outputs:
  - {name: SCORES, datatype: FP32, shape: [5], label_filename: labels.txt}
  - {name: TEXT, datatype: BYTES, shape: [1]}
  - {name: COUNTS, datatype: INT64, shape: [5]}
"""
SCORES_MODEL = """
import numpy as np

from gpuserve import PythonModel


class Model(PythonModel):
    def forward(self, inputs):
        x = inputs["X"]
        rows = x.shape[0]
        return {
            "SCORES": x,
            "TEXT": np.array([[b"t"]] * rows, dtype=object),
            "COUNTS": (x * 10).astype(np.int64),
        }
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = write_triton_examples(tmp_path_factory.mktemp("cls") / "models")
    folder = root / "scores"
    (folder / "1").mkdir(parents=True)
    (folder / "config.yaml").write_text(SCORES_YAML)
    (folder / "1" / "model.py").write_text(SCORES_MODEL)
    (folder / "labels.txt").write_text("zero\none\ntwo\n")
    running = InProcessServer(root, trace_dir=root.parent / "traces")
    running.trace_dir = root.parent / "traces"
    yield running
    running.stop()


def clients(server):
    return {
        "http": (httpclient, httpclient.InferenceServerClient(server.url.removeprefix("http://"))),
        "grpc": (grpcclient, grpcclient.InferenceServerClient(server.grpc_url)),
    }


def _infer(module, client, model, name, array, output, **kwargs):
    tensor = module.InferInput(name, list(array.shape), "FP32")
    tensor.set_data_from_numpy(array)
    return client.infer(model, [tensor], outputs=[module.InferRequestedOutput(output, **kwargs)])


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_top_k_with_labels_from_config_pbtxt(server, kind):
    module, client = clients(server)[kind]
    image = np.random.default_rng(1).random((3, 224, 224), dtype=np.float32)
    plain = _infer(module, client, "densenet_onnx", "data_0", image, "fc6_1")
    scores = plain.as_numpy("fc6_1").ravel()
    classes = _infer(
        module, client, "densenet_onnx", "data_0", image, "fc6_1", class_count=4
    ).as_numpy("fc6_1")
    assert classes.shape == (4,)  # no batch dimension: every element ranked
    expected = np.argsort(-scores, kind="stable")[:4]
    for text, index in zip(classes, expected, strict=True):
        score, got_index, label = text.decode().split(":")
        assert int(got_index) == index and label == LABELS[index]
        # Triton's "%f" text; two runs of the ONNX model may differ in the last digit
        assert re.fullmatch(r"-?\d+\.\d{6}", score), score
        assert float(score) == pytest.approx(float(scores[index]), abs=2e-6)


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_per_row_classes_and_labels_from_config_yaml(server, kind):
    module, client = clients(server)[kind]
    rows = np.array([[0.1, 0.9, 0.3, 0.95, 0.0], [5, 4, 3, 2, 1]], dtype=np.float32)
    result = _infer(module, client, "scores", "X", rows, "SCORES", class_count=3)
    got = [[value.decode() for value in row] for row in result.as_numpy("SCORES")]
    assert got == [
        ["0.950000:3", "0.900000:1:one", "0.300000:2:two"],  # class 3 has no label line
        ["5.000000:0:zero", "4.000000:1:one", "3.000000:2:two"],
    ]
    wide = _infer(module, client, "scores", "X", rows, "SCORES", class_count=9)
    assert wide.as_numpy("SCORES").shape == (2, 5)  # k is capped at the classes
    ints = _infer(module, client, "scores", "X", rows, "COUNTS", class_count=1)
    # 0.9 and 0.95 both become 9: ties keep the lower index first
    assert [v.decode() for v in ints.as_numpy("COUNTS").ravel()] == ["9:1", "50:0"]


def test_classification_over_the_grpc_stream(server):
    """ModelStreamInfer honours the output options too (classification here)."""
    import queue

    client = grpcclient.InferenceServerClient(server.grpc_url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        rows = np.array([[0.1, 0.9, 0.3, 0.95, 0.0]], dtype=np.float32)
        tensor = grpcclient.InferInput("X", list(rows.shape), "FP32")
        tensor.set_data_from_numpy(rows)
        output = grpcclient.InferRequestedOutput("SCORES", class_count=2)
        client.async_stream_infer("scores", [tensor], outputs=[output])
        result, error = answers.get(timeout=30)
    finally:
        client.stop_stream()
    assert error is None, error
    assert [v.decode() for v in result.as_numpy("SCORES").ravel()] == [
        "0.950000:3",
        "0.900000:1:one",
    ]


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_classification_of_a_bytes_output_is_refused(server, kind):
    module, client = clients(server)[kind]
    rows = np.zeros((1, 5), dtype=np.float32)
    with pytest.raises(InferenceServerException) as err:
        _infer(module, client, "scores", "X", rows, "TEXT", class_count=2)
    assert "output 'TEXT': 'classification' needs a numeric output; 'TEXT' is BYTES" in (
        err.value.message()
    )
    assert server.manager.version("scores", None) is not None  # still serving


def test_label_filename_in_the_model_config(server):
    config = httpx.get(f"{server.url}/v2/models/densenet_onnx/config").json()
    assert config["output"][0]["label_filename"] == "densenet_labels.txt"
    assert config["input"][0]["format"] == "FORMAT_NCHW"
    grpc = grpcclient.InferenceServerClient(server.grpc_url).get_model_config("densenet_onnx")
    assert grpc.config.output[0].label_filename == "densenet_labels.txt"


# -- trace settings -----------------------------------------------------------------------


def _trace(kind, client, model=None, settings=None):
    if settings is None:
        answer = client.get_trace_settings(model_name=model)
    else:
        answer = client.update_trace_settings(model_name=model, settings=settings)
    if kind == "http":
        return answer
    return {
        key: list(value.value) if key == "trace_level" else value.value[0]
        for key, value in answer.settings.items()
        if value.value
    }


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_trace_settings_write_timestamps_for_sampled_requests(server, kind):
    module, client = clients(server)[kind]
    trace_file = server.trace_dir / f"{kind}.jsonl"
    defaults = _trace(kind, client)
    assert defaults["trace_level"] == ["OFF"] and defaults["trace_rate"] == "1000"
    updated = _trace(
        kind,
        client,
        settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "2", "trace_file": trace_file.name},
    )
    assert updated["trace_level"] == ["TIMESTAMPS"] and updated["trace_rate"] == "2"
    # a model that turns it off for itself
    _trace(kind, client, "scores", {"trace_level": ["OFF"]})
    assert _trace(kind, client, "scores")["trace_level"] == ["OFF"]
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = module.InferInput(name, [1, 16], "INT32")
        tensor.set_data_from_numpy(a)
        inputs.append(tensor)
    for _ in range(4):
        client.infer("simple", inputs)
    _infer(module, client, "scores", "X", np.zeros((1, 5), np.float32), "SCORES")
    _trace(kind, client, settings={"trace_level": None})  # back to OFF: files closed
    lines = [json.loads(line) for line in trace_file.read_text().splitlines()]
    assert [line["model_name"] for line in lines] == ["simple", "simple"]  # 1 in 2; not scores
    stamps = [t["ns"] for t in lines[0]["timestamps"]]
    names = [t["name"] for t in lines[0]["timestamps"]]
    assert names == ["QUEUE_START", "COMPUTE_START", "COMPUTE_END", "REQUEST_END"]
    assert stamps == sorted(stamps) and stamps[-1] - stamps[0] < 60e9
    # clearing the model's key falls back to the server-wide value
    _trace(kind, client, settings={"trace_level": ["TIMESTAMPS"]})
    assert _trace(kind, client, "scores")["trace_level"] == ["OFF"]
    cleared = _trace(kind, client, "scores", {"trace_level": None})
    assert cleared["trace_level"] == ["TIMESTAMPS"]
    _trace(kind, client, settings={"trace_level": None, "trace_rate": None, "trace_file": None})
    assert _trace(kind, client) == defaults


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_trace_settings_refusals(server, kind):
    _, client = clients(server)[kind]
    for settings, message in [
        ({"trace_level": ["TENSORS"]}, "TENSORS is not supported"),
        ({"trace_rate": "0"}, "trace_rate must be an integer >= 1, got '0'"),
        ({"trace_mode": "opentelemetry"}, "only 'triton'"),
        ({"sampling": "1"}, "unknown trace setting 'sampling'"),
        ({"trace_file": "/etc/profile"}, "must be a file inside the server's trace directory"),
        ({"trace_file": "../x.jsonl"}, "must be a file inside the server's trace directory"),
    ]:
        with pytest.raises(InferenceServerException) as err:
            client.update_trace_settings(settings=settings)
        assert message in err.value.message()
    with pytest.raises(InferenceServerException) as err:
        client.get_trace_settings(model_name="nope")
    assert err.value.status() in ("404", "StatusCode.NOT_FOUND")
    assert _trace(kind, client)["trace_level"] == ["OFF"]  # nothing changed


# -- log settings ---------------------------------------------------------------------------


@pytest.fixture()
def root_level():
    root = logging.getLogger()
    level = root.level
    yield root
    root.setLevel(level)


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_log_settings_change_the_level_at_run_time(server, kind, root_level):
    _, client = clients(server)[kind]

    def settings(answer):
        if kind == "http":
            return answer
        return {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in answer.settings.items()}

    root_level.setLevel(logging.WARNING)
    assert settings(client.get_log_settings())["log_info"] is False
    answer = settings(client.update_log_settings({"log_verbose_level": 1}))
    assert answer["log_verbose_level"] == 1 and root_level.level == logging.DEBUG
    answer = settings(client.update_log_settings({"log_verbose_level": 0, "log_info": False}))
    assert answer["log_info"] is False and root_level.level == logging.WARNING
    settings(client.update_log_settings({"log_warning": False}))
    assert root_level.level == logging.ERROR
    with pytest.raises(InferenceServerException, match='only "" is accepted'):
        client.update_log_settings({"log_file": "/tmp/x.log"})
    with pytest.raises(InferenceServerException, match="unknown log setting 'log_colour'"):
        client.update_log_settings({"log_colour": True})
    assert root_level.level == logging.ERROR


def test_log_settings_type_errors_over_http(server, root_level):
    bad = httpx.post(f"{server.url}/v2/logging", json={"log_info": "yes"})
    assert bad.status_code == 400 and "'log_info' must be a bool" in bad.json()["error"]
    assert httpx.post(f"{server.url}/v2/logging", content=b"[").status_code == 400
