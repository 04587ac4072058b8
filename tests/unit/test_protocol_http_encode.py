"""HTTP response encoding (protocol.http_codec.encode_infer_response) and wire round trips."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest

from gpuserve.config import ModelConfig, TensorSpec
from gpuserve.datatypes import NUMPY_DTYPES
from gpuserve.engine.request import InferenceResponse
from gpuserve.errors import BackendError
from gpuserve.protocol import (
    EncodedResponse,
    OutputOptions,
    decode_infer_request,
    encode_infer_response,
)

ALL_TYPES = [name for name in NUMPY_DTYPES if name != "BYTES"]


def config_for(outputs: dict[str, str]) -> ModelConfig:
    return ModelConfig(
        inputs=[TensorSpec(name="IN", datatype="FP32", shape=[-1])],
        outputs=[TensorSpec(name=n, datatype=dt, shape=[-1]) for n, dt in outputs.items()],
        max_batch_size=8,
    )


def encode(
    outputs: dict[str, np.ndarray],
    datatypes: dict[str, str],
    options: OutputOptions | None = None,
    request_id: str | None = None,
) -> EncodedResponse:
    response = InferenceResponse("m", "3", request_id, outputs)
    return encode_infer_response(response, options or OutputOptions({}), config_for(datatypes))


def split(encoded: EncodedResponse) -> tuple[dict[str, Any], bytes]:
    if encoded.header_length is None:
        return json.loads(encoded.body), b""
    head = encoded.body[: encoded.header_length]
    return json.loads(head), encoded.body[encoded.header_length :]


def sample(datatype: str, shape: tuple[int, ...] = (2, 3)) -> np.ndarray:
    rng = np.random.default_rng(7)
    dtype = NUMPY_DTYPES[datatype]
    if datatype == "BOOL":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return (rng.standard_normal(shape) * 100).astype(dtype)


def test_json_response_layout() -> None:
    out = np.arange(6, dtype=np.float32).reshape(2, 3) / 4
    encoded = encode({"OUT": out}, {"OUT": "FP32"}, request_id="r1")
    assert encoded.header_length is None and encoded.content_type == "application/json"
    doc = json.loads(encoded.body)
    assert doc == {
        "model_name": "m",
        "model_version": "3",
        "id": "r1",
        "outputs": [
            {"name": "OUT", "datatype": "FP32", "shape": [2, 3], "data": out.ravel().tolist()}
        ],
    }


def test_no_id_when_request_had_none() -> None:
    doc = json.loads(encode({"OUT": np.zeros(1, np.float32)}, {"OUT": "FP32"}).body)
    assert "id" not in doc


@pytest.mark.parametrize("datatype", ALL_TYPES)
def test_json_values_exact_for_every_datatype(datatype: str) -> None:
    out = sample(datatype)
    doc, _ = split(encode({"OUT": out}, {"OUT": datatype}))
    entry = doc["outputs"][0]
    assert entry["datatype"] == datatype and entry["shape"] == [2, 3]
    back = np.array(entry["data"], dtype=NUMPY_DTYPES[datatype]).reshape(2, 3)
    np.testing.assert_array_equal(back, out)


@pytest.mark.parametrize("datatype", ALL_TYPES)
def test_binary_bit_exact_for_every_datatype(datatype: str) -> None:
    out = sample(datatype)
    encoded = encode({"OUT": out}, {"OUT": datatype}, OutputOptions({"OUT": True}))
    assert encoded.content_type == "application/octet-stream"
    doc, tail = split(encoded)
    entry = doc["outputs"][0]
    assert "data" not in entry
    assert entry["parameters"] == {"binary_data_size": out.nbytes}
    assert tail == out.astype(NUMPY_DTYPES[datatype]).tobytes()
    back = np.frombuffer(tail, dtype=NUMPY_DTYPES[datatype]).reshape(entry["shape"])
    np.testing.assert_array_equal(back, out)


def test_nonfinite_floats_binary_bit_exact_and_json_null() -> None:
    out = np.array([np.nan, np.inf, -np.inf, 1.0], dtype=np.float32)
    doc, tail = split(encode({"OUT": out}, {"OUT": "FP32"}, OutputOptions({}, True)))
    assert tail == out.tobytes()
    doc, _ = split(encode({"OUT": out}, {"OUT": "FP32"}))
    assert doc["outputs"][0]["data"] == [None, None, None, 1.0]


def test_mixed_binary_and_json_outputs_in_order() -> None:
    a = np.arange(4, dtype=np.float32).reshape(1, 4)
    b = np.array([[1, -2]], dtype=np.int64)
    c = np.array([[True, False, True]])
    options = OutputOptions({"A": True, "B": False}, default_binary=True)
    encoded = encode({"A": a, "B": b, "C": c}, {"A": "FP32", "B": "INT64", "C": "BOOL"}, options)
    doc, tail = split(encoded)
    assert encoded.header_length == len(encoded.body) - len(tail)
    names = [o["name"] for o in doc["outputs"]]
    assert names == ["A", "B", "C"]
    assert doc["outputs"][1]["data"] == [1, -2]
    assert doc["outputs"][0]["parameters"]["binary_data_size"] == 16
    assert doc["outputs"][2]["parameters"]["binary_data_size"] == 3
    assert tail == a.tobytes() + c.tobytes()


def test_request_level_default_with_per_output_override() -> None:
    options = OutputOptions({"A": False}, default_binary=True)
    assert not options.is_binary("A") and options.is_binary("B")
    options = OutputOptions({"A": True})
    assert options.is_binary("A") and not options.is_binary("B")


def test_cast_to_declared_datatype() -> None:
    out64 = np.array([[0.1, 1 / 3]], dtype=np.float64)
    doc, tail = split(encode({"OUT": out64}, {"OUT": "FP32"}, OutputOptions({}, True)))
    assert doc["outputs"][0]["parameters"]["binary_data_size"] == 8
    assert tail == out64.astype(np.float32).tobytes()
    doc, _ = split(encode({"OUT": np.array([1, 2], dtype=np.int64)}, {"OUT": "INT32"}))
    assert doc["outputs"][0]["data"] == [1, 2]


def test_cast_across_kinds_is_a_backend_error() -> None:
    with pytest.raises(BackendError, match="returned float64 values but the output is declared"):
        encode({"OUT": np.array([1.5])}, {"OUT": "INT64"})


def test_non_contiguous_and_big_endian_outputs() -> None:
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    transposed = base.T
    doc, tail = split(encode({"OUT": transposed}, {"OUT": "FP32"}, OutputOptions({}, True)))
    assert doc["outputs"][0]["shape"] == [4, 3]
    assert tail == np.ascontiguousarray(transposed).tobytes()
    doc, _ = split(encode({"OUT": transposed}, {"OUT": "FP32"}))
    assert doc["outputs"][0]["data"] == transposed.ravel().tolist()
    big = np.array([1.5, -2.0], dtype=">f4")
    doc, tail = split(encode({"OUT": big}, {"OUT": "FP32"}, OutputOptions({}, True)))
    assert tail == np.array([1.5, -2.0], dtype="<f4").tobytes()
    doc, _ = split(encode({"OUT": big}, {"OUT": "FP32"}))
    assert doc["outputs"][0]["data"] == [1.5, -2.0]


def test_zero_size_output() -> None:
    empty = np.zeros((1, 0), dtype=np.float32)
    doc, _ = split(encode({"OUT": empty}, {"OUT": "FP32"}))
    assert doc["outputs"][0]["shape"] == [1, 0] and doc["outputs"][0]["data"] == []
    doc, tail = split(encode({"OUT": empty}, {"OUT": "FP32"}, OutputOptions({}, True)))
    assert doc["outputs"][0]["parameters"]["binary_data_size"] == 0 and tail == b""


def test_scalar_output() -> None:
    doc, _ = split(encode({"OUT": np.array(2.5, dtype=np.float32)}, {"OUT": "FP32"}))
    assert doc["outputs"][0]["shape"] == [] and doc["outputs"][0]["data"] == [2.5]


def test_bytes_output_json() -> None:
    out = np.array([[b"h\xc3\xa9llo \xe2\x9c\x93"], [b""], ["str ok"], [b"a\x00b"]], dtype=object)
    doc, _ = split(encode({"T": out}, {"T": "BYTES"}))
    entry = doc["outputs"][0]
    assert entry["shape"] == [4, 1] and entry["datatype"] == "BYTES"
    assert entry["data"] == ["héllo ✓", "", "str ok", "a\x00b"]


def test_bytes_output_binary() -> None:
    items = [b"\xff\x00", "é".encode(), b""]
    out = np.array(items, dtype=object).reshape(3, 1)
    doc, tail = split(encode({"T": out}, {"T": "BYTES"}, OutputOptions({"T": True})))
    wire = b"".join(struct.pack("<I", len(x)) + x for x in items)
    assert tail == wire
    assert doc["outputs"][0]["parameters"]["binary_data_size"] == len(wire)


def test_bytes_output_from_fixed_width_numpy_strings() -> None:
    doc, _ = split(encode({"T": np.array(["ab", "c"])}, {"T": "BYTES"}))
    assert doc["outputs"][0]["data"] == ["ab", "c"]
    doc, tail = split(encode({"T": np.array([b"ab"])}, {"T": "BYTES"}, OutputOptions({}, True)))
    assert tail == b"\x02\x00\x00\x00ab"


def test_non_utf8_bytes_in_json_is_a_backend_error() -> None:
    out = np.array([b"\xff"], dtype=object)
    with pytest.raises(BackendError, match="output 'T' has bytes that are not valid UTF-8"):
        encode({"T": out}, {"T": "BYTES"})


def test_numeric_array_for_bytes_output_is_a_backend_error() -> None:
    with pytest.raises(BackendError, match="declared BYTES"):
        encode({"T": np.zeros(2)}, {"T": "BYTES"})


def test_undeclared_output_is_a_backend_error() -> None:
    response = InferenceResponse("m", "1", None, {"NOPE": np.zeros(1, np.float32)})
    with pytest.raises(BackendError, match="'NOPE', which it does not declare"):
        encode_infer_response(response, OutputOptions({}), config_for({"OUT": "FP32"}))


def test_non_array_output_is_a_backend_error() -> None:
    response = InferenceResponse("m", "1", None, {"OUT": [1.0]})  # type: ignore[dict-item]
    with pytest.raises(BackendError, match="not an array"):
        encode_infer_response(response, OutputOptions({}), config_for({"OUT": "FP32"}))


def test_bc06_case10_binary_output_of_16_bytes() -> None:
    """A binary request in, ``binary_data: true`` out: 16 bit-exact bytes appended."""
    config = ModelConfig(
        inputs=[TensorSpec(name="INPUT0", datatype="FP32", shape=[4])],
        outputs=[TensorSpec(name="OUTPUT0", datatype="FP32", shape=[4])],
        max_batch_size=8,
    )
    values = np.array([[0.1, -1e-30, 1.5e38, 7.0]], dtype="<f4")
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "shape": [1, 4],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 16},
                }
            ],
            "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
        }
    ).encode()
    decoded = decode_infer_request(header + values.tobytes(), len(header), config, "m", None)
    doubled = decoded.request.inputs["INPUT0"] * 2
    response = InferenceResponse("m", "1", None, {"OUTPUT0": doubled})
    encoded = encode_infer_response(response, decoded.output_options, config)
    doc, tail = split(encoded)
    assert encoded.header_length is not None
    assert doc["outputs"][0]["parameters"] == {"binary_data_size": 16}
    assert len(tail) == 16 and tail == (values * 2).tobytes()


def test_json_round_trip_through_decoder() -> None:
    """Encode outputs as JSON, then feed them back as inputs: values survive exactly."""
    config = ModelConfig(
        inputs=[
            TensorSpec(name="F", datatype="FP32", shape=[-1]),
            TensorSpec(name="I", datatype="INT64", shape=[-1]),
            TensorSpec(name="T", datatype="BYTES", shape=[-1]),
        ],
        outputs=[
            TensorSpec(name="F", datatype="FP32", shape=[-1]),
            TensorSpec(name="I", datatype="INT64", shape=[-1]),
            TensorSpec(name="T", datatype="BYTES", shape=[-1]),
        ],
        max_batch_size=8,
    )
    outputs = {
        "F": np.random.default_rng(3).standard_normal((2, 50)).astype(np.float32),
        "I": np.array([[2**63 - 1, -(2**63), 2**53 + 1]], dtype=np.int64).repeat(2, axis=0),
        "T": np.array([["é✓", "a\x00"]] * 2, dtype=object),
    }
    encoded = encode_infer_response(
        InferenceResponse("m", "1", None, outputs), OutputOptions({}), config
    )
    doc = json.loads(encoded.body)
    request_body = json.dumps({"inputs": doc["outputs"]}).encode()
    inputs = decode_infer_request(request_body, None, config, "m", None).request.inputs
    np.testing.assert_array_equal(inputs["F"], outputs["F"])
    np.testing.assert_array_equal(inputs["I"], outputs["I"])
    assert inputs["T"].tolist() == [["é✓".encode(), b"a\x00"]] * 2
