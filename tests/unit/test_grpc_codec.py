"""The gRPC codec without sockets: typed contents and raw bytes for every datatype, parameters,
response encoding, and wire compatibility of gpuserve's protos with tritonclient's."""

from __future__ import annotations

import numpy as np
import pytest

from gpuserve.config import ModelConfig, TensorSpec
from gpuserve.datatypes import CONFIG_DATATYPES
from gpuserve.engine.request import InferenceResponse
from gpuserve.errors import BackendError, InvalidInputError
from gpuserve.protocol.grpc_codec import CONTENTS_FIELD, decode_infer_request, encode_infer_response
from gpuserve.protocol.protos import grpc_service_pb2 as pb
from gpuserve.protocol.protos import model_config_pb2 as mc
from gpuserve.server.grpc.messages import model_config
from gpuserve.service.views import ModelConfigView

DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"]
DATATYPES += ["FP16", "FP32", "FP64", "BYTES"]


def config_for(datatype: str, max_batch_size: int = 4) -> ModelConfig:
    return ModelConfig(
        name="m",
        max_batch_size=max_batch_size,
        inputs=[TensorSpec(name="X", datatype=datatype, shape=[-1])],
        outputs=[TensorSpec(name="Y", datatype=datatype, shape=[-1])],
    )


def typed(datatype: str, values, shape=None, field=None) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="m")
    tensor = message.inputs.add(name="X", datatype=datatype, shape=shape or [1, len(values)])
    getattr(tensor.contents, field or CONTENTS_FIELD[datatype]).extend(values)
    return message


def raw(datatype: str, payload: bytes, shape) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="m")
    message.inputs.add(name="X", datatype=datatype, shape=shape)
    message.raw_input_contents.append(payload)
    return message


def decode(message, datatype):
    return decode_infer_request(message, config_for(datatype), "m", None)


SAMPLES = {
    "BOOL": [True, False],
    "UINT8": [0, 255],
    "UINT16": [0, 65535],
    "UINT32": [0, 2**32 - 1],
    "UINT64": [0, 2**64 - 1],
    "INT8": [-128, 127],
    "INT16": [-(2**15), 2**15 - 1],
    "INT32": [-(2**31), 2**31 - 1],
    "INT64": [-(2**63), 2**63 - 1],
    "FP32": [1.5, -2.25],
    "FP64": [1e300, -0.1],
    "BYTES": [b"a\x00", b"\xff"],
}


@pytest.mark.parametrize("datatype", list(SAMPLES))
def test_typed_contents_give_the_declared_dtype_exactly(datatype):
    request = decode(typed(datatype, SAMPLES[datatype]), datatype)
    array = request.inputs["X"]
    assert array.shape == (1, 2)
    assert array.ravel().tolist() == SAMPLES[datatype]
    if datatype != "BYTES":
        assert array.dtype == np.dtype(datatype.lower().replace("fp", "float"))


@pytest.mark.parametrize(("datatype", "value"), [("INT8", 128), ("INT16", -40000), ("UINT8", 256)])
def test_narrow_integers_are_range_checked(datatype, value):
    with pytest.raises(InvalidInputError, match=rf"element 1 \({value}\) is out of range"):
        decode(typed(datatype, [0, value]), datatype)


def test_fp16_travels_raw_only():
    with pytest.raises(InvalidInputError, match="FP16 has no typed contents field"):
        decode(typed("FP16", [1.0], field="fp32_contents"), "FP16")
    payload = np.array([1.5, 65504.0], "<f2").tobytes()
    request = decode(raw("FP16", payload, [1, 2]), "FP16")
    assert request.inputs["X"].dtype == np.float16
    assert request.inputs["X"].tolist() == [[1.5, 65504.0]]


@pytest.mark.parametrize("datatype", [d for d in DATATYPES if d != "BYTES"])
def test_raw_fixed_size_inputs_are_views_with_checked_sizes(datatype):
    dtype = np.dtype("?" if datatype == "BOOL" else datatype.lower().replace("fp", "float"))
    values = np.arange(3).astype(dtype)
    request = decode(raw(datatype, values.tobytes(), [1, 3]), datatype)
    np.testing.assert_array_equal(request.inputs["X"], values.reshape(1, 3))
    with pytest.raises(InvalidInputError, match=r"raw_input_contents size \d+ does not match"):
        decode(raw(datatype, values.tobytes() + b"\0" * dtype.itemsize, [1, 3]), datatype)


def test_several_contents_fields_are_refused():
    message = typed("INT32", [1])
    message.inputs[0].contents.int64_contents.append(1)
    with pytest.raises(InvalidInputError, match="several contents fields"):
        decode(message, "INT32")


def test_parameters_outputs_and_id():
    message = typed("FP32", [1.0])
    message.id = "abc"
    message.parameters["priority"].uint64_param = 2
    message.parameters["timeout"].int64_param = 0
    message.parameters["custom"].string_param = "x"
    message.outputs.add(name="Y")
    request = decode(message, "FP32")
    assert request.id == "abc" and request.priority == 2 and request.timeout_us is None
    assert request.parameters["custom"] == "x" and request.requested_outputs == ["Y"]
    message.parameters["timeout"].int64_param = -5
    with pytest.raises(InvalidInputError, match="'timeout' must be a non-negative integer"):
        decode(message, "FP32")
    message.parameters["timeout"].int64_param = 100
    message.outputs.add(name="Y")
    with pytest.raises(InvalidInputError, match="already exists in request"):
        decode(message, "FP32")


def response(datatype: str, array) -> InferenceResponse:
    return InferenceResponse("m", "1", "id-1", {"Y": array})


def test_encode_puts_every_output_in_raw_output_contents():
    encoded = encode_infer_response(
        response("BYTES", np.array([[b"ab", "c\u00e9"]], dtype=object)), config_for("BYTES")
    )
    assert encoded.id == "id-1" and encoded.model_version == "1"
    (tensor,) = encoded.outputs
    assert (tensor.name, tensor.datatype, list(tensor.shape)) == ("Y", "BYTES", [1, 2])
    assert encoded.raw_output_contents[0] == b"\x02\0\0\0ab\x03\0\0\0c\xc3\xa9"
    half = encode_infer_response(response("FP16", np.array([[1.0, np.inf]])), config_for("FP16"))
    assert np.frombuffer(half.raw_output_contents[0], "<f2").tolist() == [1.0, np.inf]


def test_encode_refuses_what_the_model_got_wrong():
    with pytest.raises(BackendError, match="does not declare"):
        encode_infer_response(
            InferenceResponse("m", "1", None, {"Z": np.zeros(1)}), config_for("FP32")
        )
    with pytest.raises(BackendError, match="float64"):
        encode_infer_response(response("INT64", np.zeros((1, 2))), config_for("INT64"))


def test_model_config_message():
    config = config_for("BYTES").model_copy(update={"parameters": {"n": 3, "s": "x"}})
    message = model_config(ModelConfigView("m", "python", config))
    assert message.input[0].data_type == mc.TYPE_STRING and list(message.input[0].dims) == [-1]
    assert message.parameters["n"].string_value == "3"
    assert message.parameters["s"].string_value == "x"
    assert message.dynamic_batching.default_queue_policy.max_queue_size == 1024
    assert set(CONFIG_DATATYPES) == set(DATATYPES)
    assert all(mc.DataType.Value(name) for name in CONFIG_DATATYPES.values())


def test_protos_are_wire_compatible_with_tritonclient():
    """Every message, field number, type and enum value matches Triton's compiled protos."""
    from tritonclient.grpc import model_config_pb2 as triton_config
    from tritonclient.grpc import service_pb2 as triton_service

    def same(mine, theirs, path):
        for field in mine.fields:
            other = theirs.fields_by_name.get(field.name)
            assert other is not None, f"{path}.{field.name} is not in Triton's protos"
            assert (other.number, other.type) == (field.number, field.type), f"{path}.{field.name}"
            assert other.is_repeated == field.is_repeated, f"{path}.{field.name}"
            if field.message_type is not None:
                same(field.message_type, other.message_type, f"{path}.{field.name}")
        for enum in mine.enum_types:
            values = theirs.enum_types_by_name[enum.name].values_by_name
            assert all(values[v.name].number == v.number for v in enum.values), path

    for mine, theirs in ((pb, triton_service), (mc, triton_config)):
        for name, message in mine.DESCRIPTOR.message_types_by_name.items():
            same(message, theirs.DESCRIPTOR.message_types_by_name[name], name)
    datatype = triton_config.DESCRIPTOR.enum_types_by_name["DataType"]
    for value in mc.DESCRIPTOR.enum_types_by_name["DataType"].values:
        assert datatype.values_by_name[value.name].number == value.number
    ours = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    triton = triton_service.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert ours.full_name == triton.full_name == "inference.GRPCInferenceService"
    for method in ours.methods:
        other = triton.methods_by_name[method.name]
        assert method.input_type.full_name == other.input_type.full_name
        assert method.output_type.full_name == other.output_type.full_name
        assert method.client_streaming == other.client_streaming
        assert method.server_streaming == other.server_streaming
