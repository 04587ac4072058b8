"""Wire compatibility with the real ``tritonclient.http`` encoder and decoder (no sockets)."""

from __future__ import annotations

import numpy as np
import pytest

from gpuserve.config import ModelConfig, TensorSpec
from gpuserve.engine.request import InferenceResponse
from gpuserve.protocol import OutputOptions, decode_infer_request, encode_infer_response

httpclient = pytest.importorskip("tritonclient.http")

CONFIG = ModelConfig(
    inputs=[
        TensorSpec(name="F", datatype="FP32", shape=[-1]),
        TensorSpec(name="I", datatype="INT64", shape=[-1]),
        TensorSpec(name="T", datatype="BYTES", shape=[-1]),
    ],
    outputs=[
        TensorSpec(name="F_OUT", datatype="FP32", shape=[-1]),
        TensorSpec(name="I_OUT", datatype="INT64", shape=[-1]),
        TensorSpec(name="T_OUT", datatype="BYTES", shape=[-1]),
    ],
    max_batch_size=8,
)


def arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    return {
        "F": rng.standard_normal((2, 5)).astype(np.float32),
        "I": np.array([[101, 2**53 + 1, -(2**63), 2**63 - 1, 0]] * 2, dtype=np.int64),
        "T": np.array([["héllo ✓", "", "a\x00b", "x:y", "z"]] * 2, dtype=object),
    }


def triton_inputs(binary: dict[str, bool]) -> list[object]:
    inputs = []
    for name, value in arrays().items():
        datatype = {"F": "FP32", "I": "INT64", "T": "BYTES"}[name]
        item = httpclient.InferInput(name, list(value.shape), datatype)
        item.set_data_from_numpy(value, binary_data=binary[name])
        inputs.append(item)
    return inputs


@pytest.mark.parametrize(
    "binary",
    [
        {"F": True, "I": True, "T": True},
        {"F": False, "I": False, "T": False},
        {"F": True, "I": False, "T": True},
        {"F": False, "I": True, "T": False},
    ],
    ids=["all-binary", "all-json", "mixed-1", "mixed-2"],
)
def test_decode_tritonclient_request(binary: dict[str, bool]) -> None:
    outputs = [
        httpclient.InferRequestedOutput("F_OUT", binary_data=True),
        httpclient.InferRequestedOutput("T_OUT", binary_data=False),
    ]
    body, json_size = httpclient.InferenceServerClient.generate_request_body(
        triton_inputs(binary), outputs=outputs, request_id="req-7", priority=2, timeout=5000
    )
    decoded = decode_infer_request(body, json_size, CONFIG, "m", None)
    request = decoded.request
    expected = arrays()
    np.testing.assert_array_equal(request.inputs["F"], expected["F"])
    assert request.inputs["F"].dtype == np.float32
    np.testing.assert_array_equal(request.inputs["I"], expected["I"])
    assert request.inputs["I"].dtype == np.int64
    assert request.inputs["T"].tolist() == [[s.encode() for s in row] for row in expected["T"]]
    assert request.id == "req-7" and request.priority == 2 and request.timeout_us == 5000
    assert request.requested_outputs == ["F_OUT", "T_OUT"]
    assert decoded.output_options.binary == {"F_OUT": True, "T_OUT": False}


def test_tritonclient_default_outputs_request_binary() -> None:
    body, json_size = httpclient.InferenceServerClient.generate_request_body(
        triton_inputs({"F": True, "I": True, "T": True})
    )
    decoded = decode_infer_request(body, json_size, CONFIG, "m", None)
    assert decoded.request.requested_outputs is None
    assert decoded.output_options.default_binary is True


def test_tritonclient_bytes_from_bytes_objects() -> None:
    raw = np.array([[b"\x00\xff\xfe", b"plain"]], dtype=object)
    item = httpclient.InferInput("T", [1, 2], "BYTES")
    item.set_data_from_numpy(raw, binary_data=True)
    ids = httpclient.InferInput("I", [1, 1], "INT64")
    ids.set_data_from_numpy(np.array([[1]], dtype=np.int64), binary_data=False)
    floats = httpclient.InferInput("F", [1, 1], "FP32")
    floats.set_data_from_numpy(np.array([[1.0]], dtype=np.float32), binary_data=True)
    body, json_size = httpclient.InferenceServerClient.generate_request_body([floats, item, ids])
    inputs = decode_infer_request(body, json_size, CONFIG, "m", None).request.inputs
    assert inputs["T"].tolist() == [[b"\x00\xff\xfe", b"plain"]]


def response_outputs() -> dict[str, np.ndarray]:
    values = arrays()
    return {"F_OUT": values["F"] * 2, "I_OUT": values["I"], "T_OUT": values["T"]}


@pytest.mark.parametrize(
    "options",
    [
        OutputOptions({}, default_binary=True),
        OutputOptions({}, default_binary=False),
        OutputOptions({"F_OUT": True, "T_OUT": True}),
        OutputOptions({"I_OUT": True}, default_binary=False),
    ],
    ids=["all-binary", "all-json", "mixed-1", "mixed-2"],
)
def test_tritonclient_parses_our_response(options: OutputOptions) -> None:
    outputs = response_outputs()
    response = InferenceResponse("m", "1", "req-9", outputs)
    encoded = encode_infer_response(response, options, CONFIG)
    result = httpclient.InferenceServerClient.parse_response_body(
        encoded.body, header_length=encoded.header_length
    )
    assert result.get_response()["id"] == "req-9"
    f_out = result.as_numpy("F_OUT")
    assert f_out.dtype == np.float32
    np.testing.assert_array_equal(f_out, outputs["F_OUT"])
    i_out = result.as_numpy("I_OUT")
    assert i_out.dtype == np.int64
    np.testing.assert_array_equal(i_out, outputs["I_OUT"])
    t_out = result.as_numpy("T_OUT")
    assert t_out.shape == (2, 5)
    # tritonclient returns bytes from binary outputs and str from JSON ones
    as_text = [[x.decode() if isinstance(x, bytes) else x for x in row] for row in t_out]
    assert as_text == outputs["T_OUT"].tolist()
