"""Failure cases BC-01, BC-02, BC-03 (gRPC), BC-04, BC-07, BC-09 and BC-14 of
shared/cases/README.md over real gRPC, with the codes the HTTP tests get, translated through the
one status table (400 -> INVALID_ARGUMENT, 500 -> INTERNAL). Requests are built with the protos
that tritonclient ships (Triton's own), so typed ``contents`` and ``raw_input_contents`` can be
set exactly as a client would. After each bad request the server still serves a valid request
to the same model and to another model ("server alive")."""

from __future__ import annotations

import concurrent.futures

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


def invalid_count(client, model="double_fp32") -> int:
    stats = client.get(f"/v2/models/{model}/stats").json()["model_stats"][0]
    return stats["failure_reasons"].get("invalid", 0)


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


# -- BC-02: data/shape mismatch and bad dims -------------------------------------------------

BC02 = [
    (fp32([1, 16], list(range(18))), ["16", "18"]),
    (fp32([1, 16], list(range(15))), ["16", "15"]),
    (fp32([2, 16], ROW), ["32", "16"]),
    (fp32([-1, 16], ROW), ["-1"]),
    (fp32([1, -16], ROW), ["-16"]),
    (fp32([], ROW), ["shape"]),
    (fp32([4294967296, 4294967296], [1, 2]), ["shape"]),
    (fp32([9, 16], list(range(9 * 16))), ["max_batch_size", "8"]),
    # case 8: raw bytes that do not match [1, 16] FP32 (64 bytes)
    (fp32([1, 16], raw=b"\0" * 60), ["raw_input_contents", "60", "64"]),
    (fp32([1, 16], raw=b"\0" * 68), ["raw_input_contents", "68", "64"]),
    (fp32([1, 16], raw=b""), ["raw_input_contents", "0", "64"]),
]


BC02_IDS = ["18-values", "15-values", "2-rows-1-given", "wildcard-batch", "negative-dim"]
BC02_IDS += ["no-shape", "overflowing-shape", "batch-9", "raw-60", "raw-68", "raw-0"]


@pytest.mark.parametrize(("message", "mentions"), BC02, ids=BC02_IDS)
def test_bc02_shape_and_size_errors_are_invalid_argument(stub, client, message, mentions):
    before = invalid_count(client)
    details = assert_invalid(stub, message, mentions)
    assert "INPUT0" in details
    assert invalid_count(client) == before + 1  # counted as an invalid request, never run


def test_bc02_raw_contents_must_cover_every_input_or_none(stub):
    both = fp32([1, 16], ROW, raw=np.zeros(16, np.float32).tobytes())
    assert_invalid(stub, both, ["INPUT0", "contents", "raw_input_contents"])
    extra = fp32([1, 16], raw=np.zeros(16, np.float32).tobytes())
    extra.raw_input_contents.append(b"\0" * 64)
    assert_invalid(stub, extra, ["raw_input_contents", "2", "1"])


def test_bc02_unknown_and_missing_inputs(stub):
    assert_invalid(
        stub, request("double_fp32", "NOPE", "FP32", [1, 16], "fp32_contents", ROW), ["INPUT0"]
    )
    assert_invalid(stub, service_pb2.ModelInferRequest(model_name="double_fp32"), ["INPUT0"])
    assert_invalid(stub, fp32([1, 16]), ["INPUT0", "16", "no data"])


# -- BC-03 (gRPC): datatypes and contents fields -----------------------------------------------


def ids(datatype, field=None, values=None, raw=None, model="tokens_int64"):
    shape = [1, len(values) if values is not None else 3]
    return request(model, "input_ids", datatype, shape, field, values, raw)


@pytest.mark.parametrize(
    ("message", "mentions"),
    [
        # case 1: INT32 declared to an INT64 model
        (ids("INT32", "int_contents", [101, 2023, 102]), ["INT32", "INT64"]),
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
        # case 7: raw, INT32 declared to the INT64 model, then INT64 with half the bytes
        (ids("INT32", raw=np.array([1, 2, 3], "<i4").tobytes()), ["INT32", "INT64"]),
        (ids("INT64", raw=np.array([1, 2, 3], "<i4").tobytes()), ["12", "24", "INT64"]),
    ],
)
def test_bc03_wrong_datatype_or_field_is_invalid_argument(stub, message, mentions):
    details = assert_invalid(stub, message, mentions)
    assert "input_ids" in details


def test_bc03_int64_beyond_2_pow_53_is_exact(stub):
    for message in (
        ids("INT64", "int64_contents", [9007199254740993]),
        ids("INT64", raw=np.array([9007199254740993], "<i8").tobytes()),
    ):
        message.inputs[0].shape[:] = [1, 1]
        code, response = call(stub, message)
        assert code == grpc.StatusCode.OK, response
        assert output(response, dtype="<i8") == [9007199254740993]


# -- BC-04: BYTES tensors ------------------------------------------------------------------------


def text(shape, values=None, raw=None, field="bytes_contents", datatype="BYTES"):
    return request(
        "echo_bytes", "TEXT", datatype, shape, field if values is not None else None, values, raw
    )


def serialized(items: list[bytes]) -> bytes:
    return b"".join(len(item).to_bytes(4, "little") + item for item in items)


@pytest.mark.parametrize(
    ("value", "length"), [("héllo ✓", 10), ("", 0), ("a\u0000b", 3), ("aGVsbG8=", 8)]
)
def test_bc04_bytes_round_trip_exactly_typed_and_raw(stub, value, length):
    data = value.encode()
    for message in (text([1, 1], [data]), text([1, 1], raw=serialized([data]))):
        code, response = call(stub, message)
        assert code == grpc.StatusCode.OK, response
        names = [o.name for o in response.outputs]
        out = dict(zip(names, response.raw_output_contents, strict=True))
        assert out["TEXT_OUT"] == serialized([data])
        assert np.frombuffer(out["LEN"], "<i4").tolist() == [length]


def test_bc04_flat_contents_for_a_2x1_tensor(stub):
    code, response = call(stub, text([2, 1], [b"a", b"b"]))
    assert code == grpc.StatusCode.OK, response
    assert response.raw_output_contents[0] == serialized([b"a", b"b"])


@pytest.mark.parametrize(
    ("message", "mentions"),
    [
        (text([2, 1], [1, 2], field="int_contents"), ["bytes_contents", "int_contents"]),
        (text([2, 1], [b"a"]), ["2", "1"]),
        (text([1, 1], raw=b"\x05\0\0\0ab"), ["BYTES", "5"]),
        (text([1, 1], raw=serialized([b"a", b"b"])), ["left over"]),
    ],
)
def test_bc04_bad_bytes_data_is_invalid_argument(stub, message, mentions):
    details = assert_invalid(stub, message, mentions)
    assert "TEXT" in details


# -- BC-07: zero-size dimensions -------------------------------------------------------------


def test_bc07_zero_size_non_batch_dim_returns_empty_output(stub):
    for message in (
        request("varlen_fp32", "X", "FP32", [1, 0], raw=b""),
        request("varlen_fp32", "X", "FP32", [1, 0]),
    ):
        code, response = call(stub, message)
        assert code == grpc.StatusCode.OK, response
        assert list(response.outputs[0].shape) == [1, 0]
        assert response.raw_output_contents[0] == b""


@pytest.mark.parametrize(
    ("model", "name", "datatype", "shape"),
    [
        ("varlen_fp32", "X", "FP32", [0, 5]),
        ("varlen_fp32", "X", "FP32", [0, 0]),
        ("echo_bytes", "TEXT", "BYTES", [0, 1]),
    ],
)
def test_bc07_empty_batch_is_invalid_argument(stub, model, name, datatype, shape):
    assert_invalid(stub, request(model, name, datatype, shape, raw=b""), ["batch"])


def test_bc07_empty_tensor_and_neighbours_in_the_same_window(stub):
    messages = [request("varlen_fp32", "X", "FP32", [1, 0], raw=b"")] + [
        request("varlen_fp32", "X", "FP32", [1, 5], "fp32_contents", [i] * 5) for i in range(3)
    ]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda m: call(stub, m), messages))
    assert [code for code, _ in results] == [grpc.StatusCode.OK] * 4
    assert list(results[0][1].outputs[0].shape) == [1, 0]
    for i, (_, response) in enumerate(results[1:]):
        assert output(response) == [i + 1.0] * 5


# -- BC-09: batch scatter and output-count mismatch ------------------------------------------

THREE = [(1, 0), (3, 1000), (2, 5000)]


def run_three(stub, model):
    def one(args):
        rows, start = args
        values = (np.arange(rows * 16) + start).tolist()
        return call(stub, fp32([rows, 16], values, model=model))

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        return list(pool.map(one, THREE))


def test_bc09_each_caller_gets_exactly_its_rows(stub):
    for (rows, start), (code, response) in zip(
        THREE, run_three(stub, "double_fp32_wide"), strict=True
    ):
        assert code == grpc.StatusCode.OK, response
        assert list(response.outputs[0].shape) == [rows, 16]
        assert output(response) == [2.0 * v for v in (np.arange(rows * 16) + start).tolist()]


def test_bc09_wrong_output_rows_fail_every_member_with_internal(stub):
    for code, details in run_three(stub, "wrong_count"):
        assert code == grpc.StatusCode.INTERNAL
        assert "rows" in details and "for a batch of" in details
    code, details = call(stub, fp32([1, 16], ROW, model="scalar_out"))
    assert code == grpc.StatusCode.INTERNAL and "scalar" in details
    assert_alive(stub)


# -- BC-14: one bad request in a batch -------------------------------------------------------


def run_concurrently(stub, messages):
    with concurrent.futures.ThreadPoolExecutor(len(messages)) as pool:
        return list(pool.map(lambda m: call(stub, m), messages))


def test_bc14_invalid_requests_are_refused_before_batching(stub):
    messages = [fp32([1, 16], [float(i)] * 16) for i in range(6)]
    messages.append(request("double_fp32", "INPUT0", "INT32", [1, 16], "int_contents", ROW))
    messages.append(fp32([1, 15], ROW[:15]))
    results = run_concurrently(stub, messages)
    for i, (code, response) in enumerate(results[:6]):
        assert code == grpc.StatusCode.OK, response
        assert output(response) == [2.0 * i] * 16
    assert [code for code, _ in results[6:]] == [grpc.StatusCode.INVALID_ARGUMENT] * 2


def fail_count(client, model, reason=None) -> int:
    stats = client.get(f"/v2/models/{model}/stats").json()["model_stats"][0]
    if reason is None:
        return stats["inference_stats"]["fail"]["count"]
    return stats["failure_reasons"].get(reason, 0)


def test_bc14_a_raising_batch_is_split_so_only_the_bad_request_fails(stub, client):
    before = fail_count(client, "marker_fail", "backend_error")
    messages = [fp32([1, 16], [float(i + 1)] * 16, model="marker_fail") for i in range(7)]
    messages.insert(3, fp32([1, 16], [-999.0] + [0.0] * 15, model="marker_fail"))
    results = run_concurrently(stub, messages)
    codes = [code for code, _ in results]
    assert codes == [grpc.StatusCode.OK] * 3 + [grpc.StatusCode.INTERNAL] + [grpc.StatusCode.OK] * 4
    assert "marker" in results[3][1]
    for message, (code, response) in zip(messages, results, strict=True):
        if code == grpc.StatusCode.OK:
            assert output(response) == [2.0 * v for v in message.inputs[0].contents.fp32_contents]
    assert fail_count(client, "marker_fail", "backend_error") == before + 1


def test_bc14_per_row_error_fails_only_its_request(stub, client):
    before = fail_count(client, "marker_fail_per_row")
    messages = [fp32([1, 16], [float(i + 1)] * 16, model="marker_fail_per_row") for i in range(7)]
    messages.insert(5, fp32([1, 16], [-999.0] + [0.0] * 15, model="marker_fail_per_row"))
    results = run_concurrently(stub, messages)
    codes = [code for code, _ in results]
    assert codes == [grpc.StatusCode.OK] * 5 + [grpc.StatusCode.INTERNAL] + [grpc.StatusCode.OK] * 2
    assert "marker" in results[5][1]
    assert fail_count(client, "marker_fail_per_row") == before + 1
