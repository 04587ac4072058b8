"""The gRPC-specific parts of failure cases BC-01, BC-02, BC-03 (gRPC) and BC-04 of
shared/cases/README.md over real gRPC: bytes that are not a request message, the all-or-none
rule of ``raw_input_contents``, typed values in the wrong ``contents`` field, and the framing
of raw BYTES tensors. Requests are built with the protos that tritonclient ships (Triton's
own), so typed ``contents`` and ``raw_input_contents`` can be set exactly as a client would.
After each bad request the server still serves a valid request to the same model and to
another model ("server alive").

What gRPC and HTTP share (shapes, datatypes, counts, empty batches, BYTES and INT64 round
trips, batch scatter and failures: BC-02/03/04/07/09/14) is in the parametrised suite,
``tests/integration/test_frontends_errors.py`` and ``test_frontends_infer.py``, which sends
every such request both as typed contents and as raw_input_contents."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

ROW = list(range(16))


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.grpc_url) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def request(model, name, datatype, shape, field=None, values=None, raw=None, request_id=""):
    """A ModelInferRequest with one input: typed values in contents.<field>, or raw bytes."""
    message = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    tensor = message.inputs.add(name=name, datatype=datatype, shape=shape)
    if field is not None:
        getattr(tensor.contents, field).extend(values)
    if raw is not None:
        message.raw_input_contents.append(raw)
    return message


def fp32(shape, values=None, raw=None, model="double_fp32", request_id=""):
    field = None if values is None else "fp32_contents"
    return request(model, "INPUT0", "FP32", shape, field, values, raw, request_id)


def output(response, index=0, dtype="<f4") -> list:
    return np.frombuffer(response.raw_output_contents[index], dtype).tolist()


def call(stub, message):
    """(code, response or error message)."""
    try:
        return grpc.StatusCode.OK, stub.ModelInfer(message, timeout=30)
    except grpc.RpcError as err:
        return err.code(), err.details()


def assert_invalid(stub, message, mentions):
    code, details = call(stub, message)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    for word in mentions:
        assert word in details, details
    assert_alive(stub)
    return details


def assert_alive(stub):
    code, response = call(stub, fp32([1, 16], ROW))
    assert code == grpc.StatusCode.OK, response
    assert output(response) == [2.0 * v for v in ROW]
    code, response = call(
        stub, request("varlen_fp32", "X", "FP32", [1, 3], "fp32_contents", [1, 2, 3])
    )
    assert code == grpc.StatusCode.OK, response
    assert output(response) == [2.0, 3.0, 4.0]


# -- BC-01 (gRPC): bytes that are not a request message are INVALID_ARGUMENT, not UNKNOWN ----


def test_bc01_malformed_message_is_invalid_argument(server, stub):
    garbage = b"\xff\xff\xff\x0f"
    with grpc.insecure_channel(server.grpc_url) as channel:
        unary = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as err:
            unary(garbage, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid inference.ModelInferRequest" in err.value.details()
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        good = fp32([1, 16], ROW, request_id="ok").SerializeToString()
        replies = [
            service_pb2.ModelStreamInferResponse.FromString(reply)
            for reply in stream(iter([garbage, good]), timeout=10)
        ]
    errors = [r.error_message for r in replies if r.error_message]
    assert len(replies) == 2 and len(errors) == 1 and "not a valid" in errors[0]
    assert [r.infer_response.id for r in replies if not r.error_message] == ["ok"]
    assert_alive(stub)


# -- BC-02: raw_input_contents is all or none ------------------------------------------------


def test_bc02_raw_contents_must_cover_every_input_or_none(stub):
    both = fp32([1, 16], ROW, raw=np.zeros(16, np.float32).tobytes())
    assert_invalid(stub, both, ["INPUT0", "contents", "raw_input_contents"])
    extra = fp32([1, 16], raw=np.zeros(16, np.float32).tobytes())
    extra.raw_input_contents.append(b"\0" * 64)
    assert_invalid(stub, extra, ["raw_input_contents", "2", "1"])


# -- BC-03 (gRPC): datatypes and contents fields -----------------------------------------------


def ids(datatype, field=None, values=None, raw=None, model="tokens_int64"):
    shape = [1, len(values) if values is not None else 3]
    return request(model, "input_ids", datatype, shape, field, values, raw)


@pytest.mark.parametrize(
    ("message", "mentions"),
    [
        # case 3: 2^63 does not fit INT64; a client can only send it in the unsigned field
        (ids("INT64", "uint64_contents", [2**63]), ["int64_contents", "uint64_contents"]),
        # case 4: 3000000000 does not fit INT32: only the 64-bit field can carry it
        (
            ids("INT32", "int64_contents", [3_000_000_000], model="tokens_int32"),
            ["int_contents", "int64_contents"],
        ),
        # case 5: non-integer values for an integer tensor
        (ids("INT64", "fp32_contents", [1.5]), ["int64_contents", "fp32_contents"]),
        (ids("INT64", "bool_contents", [True]), ["int64_contents", "bool_contents"]),
        # case 6: INT64 values in the 32-bit field
        (
            ids("INT64", "int_contents", [101, 2023, 102]),
            ["INT64", "int64_contents", "int_contents"],
        ),
        # case 7: raw INT64 with half the bytes
        (ids("INT64", raw=np.array([1, 2, 3], "<i4").tobytes()), ["12", "24", "INT64"]),
    ],
)
def test_bc03_wrong_datatype_or_field_is_invalid_argument(stub, message, mentions):
    details = assert_invalid(stub, message, mentions)
    assert "input_ids" in details


# -- BC-04: BYTES tensors ------------------------------------------------------------------------


def text(shape, values=None, raw=None, field="bytes_contents", datatype="BYTES"):
    return request(
        "echo_bytes", "TEXT", datatype, shape, field if values is not None else None, values, raw
    )


def serialized(items: list[bytes]) -> bytes:
    return b"".join(len(item).to_bytes(4, "little") + item for item in items)


@pytest.mark.parametrize(
    ("message", "mentions"),
    [
        (text([2, 1], [1, 2], field="int_contents"), ["bytes_contents", "int_contents"]),
        (text([1, 1], raw=b"\x05\0\0\0ab"), ["BYTES", "5"]),
        (
            text([1, 1], raw=serialized([b"a", b"b"])),
            ["unexpected number of string elements 2", "expecting 1"],
        ),
    ],
)
def test_bc04_bad_bytes_data_is_invalid_argument(stub, message, mentions):
    details = assert_invalid(stub, message, mentions)
    assert "TEXT" in details
