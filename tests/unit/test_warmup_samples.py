"""``model_warmup``: the typed section (config.yaml and config.pbtxt give the same objects), its
checks against the model's inputs, and the sample -> tensor construction."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from gpuserve.backends.base import Backend, Capabilities, LoadContext
from gpuserve.config import parse_model_config
from gpuserve.config.warmup import WarmupInput, WarmupSample, WarmupTarget, warmup_problem
from gpuserve.datatypes import numpy_dtype
from gpuserve.engine.assembly import stack_inputs
from gpuserve.engine.instance import Instance
from gpuserve.engine.warmup_samples import (
    WarmupBatch,
    check_warmup_files,
    file_tensor,
    random_tensor,
    stream_sample,
    warmup_batches,
    zero_tensor,
)
from gpuserve.errors import BackendError, ConfigError
from gpuserve.repository.triton.pbtxt import parse_text
from gpuserve.repository.scan import scan_model
from gpuserve.repository.triton.config import triton_config

BASE = {
    "backend": "python",
    "max_batch_size": 8,
    "inputs": [
        {"name": "IMAGE", "datatype": "FP32", "shape": [2, -1]},
        {"name": "IDS", "datatype": "INT64", "shape": [4]},
        {"name": "TEXT", "datatype": "BYTES", "shape": [1], "optional": True},
    ],
    "outputs": [{"name": "OUT", "datatype": "FP32", "shape": [1]}],
}
GOOD_SAMPLE = {
    "name": "zeros",
    "batch_size": 3,
    "count": 2,
    "inputs": {
        "IMAGE": {"data_type": "FP32", "dims": [2, 5], "zero_data": True},
        "IDS": {"data_type": "TYPE_INT64", "dims": [4], "random_data": True},
    },
}


def config(*samples, **changes):
    data = {**BASE, **changes, "model_warmup": list(samples)}
    return parse_model_config(data, Path("m/config.yaml"), "m")


def bytes_file(*elements: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


# -- tensors ---------------------------------------------------------------------------------


def test_zero_tensors_are_zeros_and_empty_strings():
    zeros = zero_tensor("FP16", [2, 3])
    assert zeros.dtype == np.float16 and zeros.shape == (2, 3) and not zeros.any()
    text = zero_tensor("BYTES", [2])
    assert text.dtype == object and text.tolist() == [b"", b""]


@pytest.mark.parametrize("datatype", ["FP32", "FP64", "INT8", "UINT8", "INT64", "UINT64", "BOOL"])
def test_random_tensors_have_the_datatype_and_vary(datatype):
    values = random_tensor(datatype, [64], np.random.default_rng(1))
    assert values.shape == (64,) and values.dtype == numpy_dtype(datatype)
    assert len(np.unique(values)) > 1
    if datatype != "BOOL":
        assert values.min() >= 0 and values.max() < 128


def test_random_bytes_fall_back_to_empty_strings_as_triton():
    assert random_tensor("BYTES", [3], np.random.default_rng(0)).tolist() == [b"", b"", b""]


def test_a_data_file_is_one_rows_raw_values_in_row_major_order(tmp_path):
    path = tmp_path / "img.bin"
    values = np.arange(6, dtype="<f4").reshape(2, 3)
    path.write_bytes(values.tobytes())
    got = file_tensor(path, "FP32", [2, 3], "f")
    np.testing.assert_array_equal(got, values)
    got[0, 0] = 7  # a writable copy, not a view of the file's bytes
    path.write_bytes(bytes([1, 0, 1]))
    assert file_tensor(path, "BOOL", [3], "f").tolist() == [True, False, True]


def test_a_data_file_of_the_wrong_size_names_file_field_and_sizes(tmp_path):
    path = tmp_path / "img.bin"
    path.write_bytes(b"\0" * 20)
    with pytest.raises(ConfigError) as err:
        file_tensor(path, "FP32", [2, 3], "model_warmup[0] ('w').inputs.X.input_data_file")
    message = err.value.message
    assert message.startswith(f"{path}: field 'model_warmup[0] ('w').inputs.X.input_data_file'")
    assert "holds 20 bytes" in message and "need 24 (6 x 4)" in message


def test_a_missing_data_file_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.bin: field 'f': cannot read the warmup data"):
        file_tensor(tmp_path / "nope.bin", "INT32", [1], "f")


def test_bytes_files_are_length_prefixed_elements(tmp_path):
    path = tmp_path / "text.bin"
    path.write_bytes(bytes_file(b"hello", b"", b"w\xc3\xb6rld"))
    got = file_tensor(path, "BYTES", [3], "f")
    assert got.dtype == object and got.tolist() == [b"hello", b"", b"w\xc3\xb6rld"]
    path.write_bytes(bytes_file(b"hello") + b"\x09\0\0\0abc")
    with pytest.raises(ConfigError, match="element 1 claims 9 bytes but only 3 are left"):
        file_tensor(path, "BYTES", [2], "f")
    path.write_bytes(bytes_file(b"a", b"b"))
    with pytest.raises(ConfigError, match=r"5 byte\(s\) left after the 1 BYTES element"):
        file_tensor(path, "BYTES", [1], "f")
    path.write_bytes(bytes_file(b"a"))
    with pytest.raises(ConfigError, match="ends before element 1 of 2"):
        file_tensor(path, "BYTES", [2], "f")


# -- batches ---------------------------------------------------------------------------------


def test_a_batching_model_gets_batch_size_requests_of_one_row_each(tmp_path):
    batches = warmup_batches(config(GOOD_SAMPLE), tmp_path, np.random.default_rng(0))
    (batch,) = batches
    assert (batch.label, batch.requests, batch.runs) == ("model_warmup[0] ('zeros')", 3, 2)
    assert {n: a.shape for n, a in batch.row.items()} == {"IMAGE": (1, 2, 5), "IDS": (1, 4)}
    assert batch.row["IDS"].dtype == np.int64 and not batch.row["IMAGE"].any()
    formed = batch.batch("m")
    assert formed.rows == 3 and len(formed.items) == 3
    stacked = stack_inputs(formed.items)
    assert stacked["IMAGE"].shape == (3, 2, 5) and stacked["IDS"].shape == (3, 4)
    # Every request holds the same row (Triton repeats the sample's inputs batch_size times).
    assert (stacked["IDS"] == stacked["IDS"][0]).all()


def test_count_zero_runs_once_and_batch_size_zero_is_skipped(tmp_path):
    once = {**GOOD_SAMPLE, "name": "once", "count": 0}
    skipped = {**GOOD_SAMPLE, "name": "skipped", "batch_size": 0}
    batches = warmup_batches(config(skipped, once), tmp_path)
    assert [(b.label, b.runs) for b in batches] == [("model_warmup[1] ('once')", 1)]


def test_without_batching_dims_are_the_full_shape(tmp_path):
    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "ids.bin").write_bytes(np.arange(4, dtype="<i8").tobytes())
    sample = {
        "inputs": {
            "IMAGE": {"data_type": "FP32", "dims": [2, 7], "random_data": True},
            "IDS": {"data_type": "INT64", "dims": [4], "input_data_file": "ids.bin"},
        }
    }
    (batch,) = warmup_batches(config(sample, max_batch_size=0), tmp_path)
    assert batch.requests == 1 and batch.label == "model_warmup[0]"
    assert batch.row["IMAGE"].shape == (2, 7)
    assert batch.row["IDS"].tolist() == [0, 1, 2, 3]
    assert batch.batch("m").rows == 1


# -- checks at config read -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"inputs": {**GOOD_SAMPLE["inputs"], "NOPE": {"data_type": "FP32", "zero_data": 1}}},
            "model_warmup[0] ('zeros'): inputs.NOPE: not an input of the model",
        ),
        (
            {
                "inputs": {
                    **GOOD_SAMPLE["inputs"],
                    "IDS": {"data_type": "INT32", "dims": [4], "zero_data": True},
                }
            },
            "inputs.IDS.data_type: INT32 does not match the input's INT64",
        ),
        (
            {
                "inputs": {
                    **GOOD_SAMPLE["inputs"],
                    "IDS": {"data_type": "INT64", "dims": [5], "zero_data": True},
                }
            },
            "inputs.IDS.dims: [5] do not fit the input's shape without the batch dimension [4]",
        ),
        (
            {
                "inputs": {
                    **GOOD_SAMPLE["inputs"],
                    "IMAGE": {"data_type": "FP32", "dims": [2], "zero_data": True},
                }
            },
            "inputs.IMAGE.dims: [2] do not fit",
        ),
        ({"batch_size": 9}, "batch_size 9 exceeds max_batch_size=8"),
        (
            {"inputs": {"IMAGE": GOOD_SAMPLE["inputs"]["IMAGE"]}},
            "inputs: the model's required input(s) ['IDS'] are not given",
        ),
    ],
)
def test_samples_that_do_not_fit_the_model_are_config_errors(change, message):
    with pytest.raises(ConfigError) as err:
        config({**GOOD_SAMPLE, **change})
    assert message in err.value.message and "m/config.yaml" in err.value.message


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"data_type": "FP32", "dims": [1]}, "set exactly one of zero_data, random_data"),
        (
            {"data_type": "FP32", "dims": [1], "zero_data": True, "input_data_file": "x"},
            "got ['zero_data', 'input_data_file']",
        ),
        ({"data_type": "FP32", "dims": [0], "zero_data": True}, "each dim must be a positive"),
        ({"data_type": "FP32", "dims": [1], "input_data_file": "../x"}, "inside the model's"),
        ({"data_type": "FP8", "dims": [1], "zero_data": True}, "field 'model_warmup.0.inputs"),
    ],
)
def test_bad_sample_inputs_name_the_field(given, message):
    with pytest.raises(ConfigError) as err:
        config({"inputs": {"IDS": given}})
    assert message in err.value.message


def test_batch_size_above_one_without_batching_is_refused():
    with pytest.raises(ConfigError, match="batch_size must be 1 for a model with max_batch_size"):
        config({**GOOD_SAMPLE, "batch_size": 2}, max_batch_size=0)


def test_ensembles_and_sequence_models_take_no_samples():
    sequence = {"sequence_batching": {"max_sequence_idle_us": 1000}}
    with pytest.raises(ConfigError, match="not supported by gpuserve yet for sequence_batching"):
        config(GOOD_SAMPLE, **sequence)
    target = WarmupTarget.of_fields({"ensemble": object(), "max_batch_size": 1})
    sample = WarmupSample.model_validate(GOOD_SAMPLE)
    assert warmup_problem([sample], target) == (
        "an ensemble cannot have warmup samples (as in Triton)"
    )


def test_config_pbtxt_maps_onto_the_same_typed_samples():
    text = """
    backend: "python"
    max_batch_size: 8
    input [ { name: "IMAGE" data_type: TYPE_FP32 dims: [ 2, -1 ] },
            { name: "IDS" data_type: TYPE_INT64 dims: [ 4 ] },
            { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] optional: true } ]
    output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
    model_warmup [ {
      name: "zeros" batch_size: 3 count: 2
      inputs { key: "IMAGE" value { data_type: TYPE_FP32 dims: [ 2, 5 ] zero_data: true } }
      inputs { key: "IDS" value { data_type: TYPE_INT64 dims: 4 random_data: false } }
    } ]
    """
    path = Path("m/config.pbtxt")
    from_pbtxt = triton_config(parse_text(text, path), path, "m")
    assert from_pbtxt.model_warmup == config(GOOD_SAMPLE).model_warmup
    (sample,) = from_pbtxt.model_warmup
    assert isinstance(sample, WarmupSample) and isinstance(sample.inputs["IDS"], WarmupInput)
    assert sample.inputs["IDS"].source == "random_data"  # set: chosen, whatever its value


def test_pbtxt_refuses_unknown_warmup_fields_and_bad_datatypes():
    base = 'backend: "python" input { name: "x" data_type: TYPE_FP32 dims: [1] } '
    base += 'output { name: "y" data_type: TYPE_FP32 dims: [1] } '
    path = Path("m/config.pbtxt")
    cases = [
        ('model_warmup { name: "w" speed: 3 }', "field 'model_warmup[0].speed'"),
        (
            'model_warmup { inputs { key: "x" value { data_type: TYPE_BF16 zero_data: true } } }',
            "field 'model_warmup[0].inputs[x].data_type'",
        ),
        (
            'model_warmup { inputs { key: "x" value { data_type: TYPE_FP32 dims: [1] '
            "zero_data: true shape: [1] } } }",
            "field 'model_warmup[0].inputs[x].shape'",
        ),
    ]
    for extra, message in cases:
        with pytest.raises(ConfigError) as err:
            triton_config(parse_text(base + extra, path), path, "m")
        assert message in err.value.message and "m/config.pbtxt" in err.value.message


def test_data_files_are_checked_when_the_repository_is_read(tmp_path):
    folder = tmp_path / "m"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text("class Model: ...\n")
    (folder / "config.pbtxt").write_text(
        'backend: "python" max_batch_size: 2\n'
        'input { name: "x" data_type: TYPE_INT32 dims: [3] }\n'
        'output { name: "y" data_type: TYPE_INT32 dims: [3] }\n'
        'model_warmup { name: "file" batch_size: 1 inputs { key: "x" value {\n'
        '  data_type: TYPE_INT32 dims: [3] input_data_file: "x.bin" } } }\n'
    )
    entry = scan_model(folder)
    assert entry.error is not None
    assert f"{folder / 'warmup' / 'x.bin'}: field 'model_warmup[0] ('file').inputs.x" in entry.error
    assert "cannot read the warmup data file" in entry.error
    (folder / "warmup").mkdir()
    (folder / "warmup" / "x.bin").write_bytes(b"\0" * 8)
    entry = scan_model(folder)
    assert entry.error is not None and "holds 8 bytes; dims [3] of INT32 need 12" in entry.error
    (folder / "warmup" / "x.bin").write_bytes(b"\0" * 12)
    entry = scan_model(folder)
    assert entry.error is None and entry.config is not None
    check_warmup_files(entry.config, folder)  # no error


def test_inputs_filled_in_at_load_are_checked_then(tmp_path):
    onnx = {
        "backend": "onnx",
        "max_batch_size": 4,
        "model_warmup": [{"inputs": {"x": {"data_type": "FP32", "dims": [3], "zero_data": 1}}}],
    }
    parsed = parse_model_config(onnx, Path("m/config.yaml"), "m")  # no inputs declared yet
    from gpuserve.config import TensorSpec

    completed = parsed.model_copy(
        update={"inputs": [TensorSpec(name="INPUT0", datatype="FP32", shape=[3])]}
    )
    with pytest.raises(ConfigError, match=r"inputs\.x: not an input of the model"):
        warmup_batches(completed, tmp_path)


# -- through an instance's stages -------------------------------------------------------------


class Recorder(Backend):
    """Records each stage it runs (and the order of the per-bucket warm-up); fails a forward
    on a batch of ``fail_rows`` rows."""

    def __init__(self, fail_rows: int = 0) -> None:
        self.log: list[tuple[str, tuple[int, ...]]] = []
        self.fail_rows = fail_rows

    def load(self, context: LoadContext) -> None:
        self.log.append(("load", ()))

    def warmup(self) -> None:
        self.log.append(("bucket_warmup", ()))

    def unload(self) -> None:
        self.log.append(("unload", ()))

    def preprocess(self, inputs):
        self.log.append(("pre", inputs["IDS"].shape))
        return inputs["IDS"]

    def forward(self, ids):
        if ids.shape[0] == self.fail_rows:
            raise ValueError(f"no batches of {self.fail_rows}")
        self.log.append(("fwd", ids.shape))
        return ids

    def postprocess(self, ids):
        self.log.append(("post", ids.shape))
        return {"OUT": ids[:, :1].astype(np.float32)}


def _instance(backend: Backend, depth: int, done: list) -> Instance:
    model = config(
        {**GOOD_SAMPLE, "batch_size": 3, "count": 2},
        {"name": "once", "batch_size": 1, "inputs": GOOD_SAMPLE["inputs"]},
        optimization={"pipeline_depth": depth},
    )
    context = LoadContext(config=model, version_path=Path("/nonexistent/m/1"), version=1)
    return Instance("m:1#0", backend, context, done.append, pipeline_depth=depth)


@pytest.mark.parametrize("depth", [1, 2])
def test_an_instance_runs_every_sample_through_its_stages_before_it_starts(depth):
    backend, done = Recorder(), []
    instance = _instance(backend, depth, done)
    instance.start(timeout_s=30)
    try:
        stages = [("pre", (3, 4)), ("fwd", (3, 4)), ("post", (3, 4))]
        once = [("pre", (1, 4)), ("fwd", (1, 4)), ("post", (1, 4))]
        assert backend.log == [("load", ()), ("bucket_warmup", ()), *stages, *stages, *once]
        assert done == []  # warmup batches are nobody's: nothing is reported
    finally:
        instance.stop()


def test_a_sample_that_fails_fails_the_start_naming_it():
    backend, done = Recorder(fail_rows=1), []
    instance = _instance(backend, 1, done)
    with pytest.raises(BackendError) as err:
        instance.start(timeout_s=30)
    message = err.value.message
    assert message == "model 'm' failed to run warmup sample model_warmup[1] ('once'): " + (
        "ValueError: no batches of 1"
    )
    assert done == [] and backend.log[-1] == ("unload", ())  # what the load took is released


STREAMS = Capabilities(streams=True)


class Streams(Recorder):
    """A decoupled backend: ``how`` says what each ``stream`` call does."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.seen: list[list[int]] = []

    def stream(self, inputs, sink):
        self.seen.append(inputs["IN"].tolist())
        if self.how == "raise":
            raise ValueError("stream broke")
        if self.how == "error":
            sink.send(None, final=True, error=ValueError("bad response"))
        elif self.how == "ok":
            sink.send({"OUT": inputs["IN"]})
            sink.send(None, final=True)
            assert not sink.send({"OUT": inputs["IN"]})  # nothing after the final mark
        # "silent": never sends the final mark


def test_a_decoupled_sample_streams_each_request_until_its_final_response():
    sample = WarmupBatch("s", {"IN": np.array([[1, 2]])}, requests=2, runs=1, batched=True)
    ok = Streams("ok")
    assert stream_sample(ok, STREAMS, sample, "m") is None and ok.seen == [[[1, 2]], [[1, 2]]]
    for how, message in (("raise", "stream broke"), ("error", "bad response")):
        backend = Streams(how)
        error = stream_sample(backend, STREAMS, sample, "m")
        assert isinstance(error, ValueError) and str(error) == message
        assert len(backend.seen) == 1  # the first failure ends the sample
    error = stream_sample(Streams("silent"), STREAMS, sample, "m", timeout_s=0.0)
    assert isinstance(error, BackendError)
    assert error.message == "model 'm' sent no final response within 0 s"
