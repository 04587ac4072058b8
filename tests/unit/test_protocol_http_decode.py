"""HTTP request decoding (protocol.http_codec.decode_infer_request): BC-01..BC-07, REST parts."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import orjson
import pytest

from gpuserve.config import ModelConfig, TensorSpec
from gpuserve.errors import InvalidInputError
from gpuserve.protocol import DecodedRequest, decode_infer_request, parse_header_length


def model(inputs: list[TensorSpec], outputs: list[TensorSpec], max_batch_size: int = 8):
    return ModelConfig(inputs=inputs, outputs=outputs, max_batch_size=max_batch_size)


DOUBLE = model(
    [TensorSpec(name="INPUT0", datatype="FP32", shape=[16])],
    [TensorSpec(name="OUTPUT0", datatype="FP32", shape=[16])],
)
DOUBLE4 = model(
    [TensorSpec(name="INPUT0", datatype="FP32", shape=[4])],
    [TensorSpec(name="OUTPUT0", datatype="FP32", shape=[4])],
)
VARLEN = model(
    [TensorSpec(name="X", datatype="FP32", shape=[-1])],
    [TensorSpec(name="Y", datatype="FP32", shape=[-1])],
)
VARLEN_UNBATCHED = model(
    [TensorSpec(name="X", datatype="FP32", shape=[-1, -1])],
    [TensorSpec(name="Y", datatype="FP32", shape=[-1, -1])],
    max_batch_size=0,
)
TOKENS64 = model(
    [TensorSpec(name="input_ids", datatype="INT64", shape=[-1])],
    [TensorSpec(name="ids_out", datatype="INT64", shape=[-1])],
)
TOKENS32 = model(
    [TensorSpec(name="input_ids", datatype="INT32", shape=[-1])],
    [TensorSpec(name="ids_out", datatype="INT32", shape=[-1])],
)
ECHO_BYTES = model(
    [TensorSpec(name="TEXT", datatype="BYTES", shape=[1])],
    [
        TensorSpec(name="TEXT_OUT", datatype="BYTES", shape=[1]),
        TensorSpec(name="LEN", datatype="INT32", shape=[1]),
    ],
)
TWO_INPUTS = model(
    [
        TensorSpec(name="input_ids", datatype="INT64", shape=[-1]),
        TensorSpec(name="attention_mask", datatype="INT64", shape=[-1]),
        TensorSpec(name="token_type_ids", datatype="INT64", shape=[-1], optional=True),
    ],
    [
        TensorSpec(name="embedding", datatype="FP32", shape=[4]),
        TensorSpec(name="pooled", datatype="FP32", shape=[4]),
    ],
)


def decode(
    body: bytes | dict[str, Any],
    config: ModelConfig = DOUBLE,
    header_length: int | None = None,
    version: str | None = None,
) -> DecodedRequest:
    raw = orjson.dumps(body) if isinstance(body, dict) else body
    return decode_infer_request(raw, header_length, config, "m", version)


def fails(body: bytes | dict[str, Any], match: str, config: ModelConfig = DOUBLE, **kw: Any):
    with pytest.raises(InvalidInputError, match=match) as info:
        decode(body, config, **kw)
    return info.value


def input0(shape: Any = (1, 16), data: Any = None, datatype: str = "FP32", **extra: Any):
    item = {"name": "INPUT0", "shape": list(shape) if isinstance(shape, tuple) else shape}
    item["datatype"] = datatype
    if data is not None:
        item["data"] = data
    item.update(extra)
    return item


def binary_body(header: dict[str, Any], *payloads: bytes) -> tuple[bytes, int]:
    head = json.dumps(header).encode()
    return head + b"".join(payloads), len(head)


# --- a valid request ----------------------------------------------------------------------


def test_valid_json_request() -> None:
    decoded = decode({"id": "r1", "inputs": [input0(data=list(range(16)))]}, version="2")
    request = decoded.request
    assert request.model_name == "m" and request.model_version == "2"
    assert request.id == "r1"
    arr = request.inputs["INPUT0"]
    assert arr.dtype == np.float32 and arr.shape == (1, 16)
    np.testing.assert_array_equal(arr[0], np.arange(16, dtype=np.float32))
    assert request.requested_outputs is None
    assert request.priority == 0 and request.timeout_us is None
    assert request.parameters == {}
    assert decoded.output_options.binary == {} and decoded.output_options.default_binary is False


def test_nested_data_rows() -> None:
    rows = [list(range(16)), list(range(16, 32))]
    arr = decode({"inputs": [input0((2, 16), rows)]}).request.inputs["INPUT0"]
    assert arr.shape == (2, 16) and arr[1, 0] == 16.0


# --- BC-01: malformed bodies ---------------------------------------------------------------


def test_bc01_cut_off() -> None:
    fails(
        b'{"inputs": [', r"not valid JSON: unexpected end of data at line 1 column 13 \(char 12\)"
    )


def test_bc01_stray_bracket() -> None:
    body = b'{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"FP32","data":[0.5]]}'
    fails(body, r"request body is not valid JSON: .* \(char \d+\)")


def test_bc01_empty_body() -> None:
    fails(b"", "^request body is empty$")


@pytest.mark.parametrize(("body", "kind"), [(b"[]", "array"), (b'"hello"', "string")])
def test_bc01_not_an_object(body: bytes, kind: str) -> None:
    fails(body, f"request body must be a JSON object, got {kind}")


def test_bc01_inputs_not_a_list() -> None:
    fails(b'{"inputs": {}}', "'inputs' must be a JSON array of input objects, got object")


def test_bc01_inputs_missing_or_empty() -> None:
    fails(b"{}", "request has no 'inputs'; model 'm' expects 'INPUT0'")
    fails(
        b'{"inputs": []}',
        r"^expected 1 inputs but got 0 inputs for model 'm'\. Got input\(s\) \[\]",
    )


def test_bc01_missing_shape() -> None:
    fails(b'{"inputs":[{"name":"INPUT0","datatype":"FP32","data":[1,2]}]}', "'shape' is missing")


def test_bc01_missing_datatype_and_name() -> None:
    fails(
        {"inputs": [{"name": "INPUT0", "shape": [1, 16], "data": [0] * 16}]},
        "'datatype' is missing",
    )
    fails({"inputs": [{"shape": [1, 16]}]}, r"inputs\[0\]: 'name' must be a string, got null")
    fails({"inputs": [3]}, r"inputs\[0\] must be a JSON object, got integer")


def test_bc01_unknown_input_lists_expected() -> None:
    body = {
        "inputs": [{"name": "NOPE", "shape": [1, 16], "datatype": "FP32", "data": list(range(16))}]
    }
    fails(body, "input 'NOPE' is not an input of model 'm'; its inputs are 'INPUT0'")


def test_bc01_duplicated_inputs_key() -> None:
    valid = json.dumps(input0(data=list(range(16))))
    body = f'{{"inputs": [{valid}], "inputs": [{valid}]}}'.encode()
    fails(body, "repeats the key 'inputs'")


def test_bc01_broken_utf8() -> None:
    body = b'{"inputs":[{"name":"INPUT0\xc3","shape":[1,16],"datatype":"FP32","data":[]}]}'
    fails(body, "request body is not valid UTF-8: byte 0xc3")


def test_repeated_input_name() -> None:
    item = input0(data=list(range(16)))
    fails({"inputs": [item, item]}, "input 'INPUT0' already exists in request")


def test_missing_required_input() -> None:
    body = {"inputs": [{"name": "input_ids", "shape": [1, 2], "datatype": "INT64", "data": [1, 2]}]}
    fails(body, r"missing required input\(s\) \['attention_mask'\]", TWO_INPUTS)


def test_optional_input_may_be_omitted_and_batches_must_agree() -> None:
    ids = {"name": "input_ids", "shape": [2, 3], "datatype": "INT64", "data": [[1, 2, 3]] * 2}
    mask = {"name": "attention_mask", "shape": [2, 3], "datatype": "INT64", "data": [1] * 6}
    request = decode({"inputs": [ids, mask]}, TWO_INPUTS).request
    assert set(request.inputs) == {"input_ids", "attention_mask"}
    mask_bad = dict(mask, shape=[1, 6])
    fails({"inputs": [ids, mask_bad]}, "inputs disagree on the batch dimension", TWO_INPUTS)


# --- BC-02: data vs shape ------------------------------------------------------------------


def test_bc02_too_many_and_too_few() -> None:
    fails({"inputs": [input0(data=list(range(18)))]}, r"shape \[1, 16\] needs 16 elements, got 18")
    fails({"inputs": [input0(data=list(range(15)))]}, "needs 16 elements, got 15")


def test_bc02_nested_with_one_row_of_two() -> None:
    fails({"inputs": [input0((2, 16), [list(range(16))])]}, "needs 32 elements, got 16")


def test_bc02_client_wildcard() -> None:
    fails({"inputs": [input0((-1, 16), list(range(16)))]}, r"shape \[-1, 16\] has a negative")


def test_bc02_negative_dim_message() -> None:
    fails(
        {"inputs": [input0((1, -16), list(range(16)))]},
        r"^input 'INPUT0': shape \[1, -16\] has a negative dimension; shapes sent by a client "
        r"must be concrete non-negative integers$",
    )


@pytest.mark.parametrize(
    ("shape", "match"),
    [([1, 16.0], "16.0 is a number"), (["1", 16], '"1" is a string'), ([], "0 dimensions")],
)
def test_bc02_bad_shapes(shape: list[Any], match: str) -> None:
    fails({"inputs": [input0(shape, list(range(16)))]}, match)


def test_bc02_overflowing_shape_no_allocation() -> None:
    huge = [4294967296, 4294967296]
    fails({"inputs": [input0(huge, [1, 2])]}, "batch dimension 4294967296 exceeds max_batch_size 8")
    body = {"inputs": [{"name": "X", "shape": huge, "datatype": "FP32", "data": [1, 2]}]}
    fails(body, r"needs 18446744073709551616 elements, got 2", VARLEN_UNBATCHED)


def test_bc02_batch_above_max() -> None:
    fails({"inputs": [input0((9, 16), [0] * 144)]}, "batch dimension 9 exceeds max_batch_size 8")


def test_bc02_then_a_valid_request() -> None:
    fails({"inputs": [input0(data=list(range(18)))]}, "needs 16")
    assert decode({"inputs": [input0(data=list(range(16)))]}).request.inputs["INPUT0"].shape == (
        1,
        16,
    )


# --- BC-03: datatypes ----------------------------------------------------------------------


def tokens(datatype: str, data: list[Any], shape: tuple[int, int] | None = None) -> dict[str, Any]:
    shape = shape or (1, len(data))
    return {
        "inputs": [{"name": "input_ids", "shape": list(shape), "datatype": datatype, "data": data}]
    }


def test_bc03_int32_to_int64_model() -> None:
    fails(
        tokens("INT32", [101, 2023, 102]),
        "input 'input_ids': datatype INT32 does not match the model's INT64",
        TOKENS64,
    )


def test_bc03_exact_int64() -> None:
    body = (
        b'{"inputs":[{"name":"input_ids","shape":[1,2],"datatype":"INT64",'
        b'"data":[9007199254740993,-9223372036854775808]}]}'
    )
    arr = decode(body, TOKENS64).request.inputs["input_ids"]
    assert arr.dtype == np.int64
    assert int(arr[0, 0]) == 9007199254740993 and int(arr[0, 1]) == -(2**63)


def test_bc03_int64_2_pow_63() -> None:
    body = (
        b'{"inputs":[{"name":"input_ids","shape":[1,1],"datatype":"INT64",'
        b'"data":[9223372036854775808]}]}'
    )
    fails(body, r"element 0 \(9223372036854775808\) is out of range for INT64", TOKENS64)


def test_bc03_int32_3e9() -> None:
    fails(tokens("INT32", [1, 3000000000]), r"\(3000000000\) is out of range for INT32", TOKENS32)


@pytest.mark.parametrize("config", [TOKENS32, TOKENS64], ids=["int32", "int64"])
def test_bc03_float_and_bool_in_integer_data(config: ModelConfig) -> None:
    datatype = config.inputs[0].datatype
    fails(tokens(datatype, [1, 1.5]), "must be JSON integers; element 1 is 1.5", config)
    fails(tokens(datatype, [True, 2]), "must be JSON integers; element 0 is true", config)


def test_bc03_uint32_vs_int32() -> None:
    config = model(
        [TensorSpec(name="input_ids", datatype="UINT32", shape=[-1])],
        [TensorSpec(name="o", datatype="UINT32", shape=[-1])],
    )
    fails(tokens("INT32", [1]), "datatype INT32 does not match the model's UINT32", config)
    fails(tokens("UINT32", [-1]), "out of range for UINT32", config)


def test_bf16_refused() -> None:
    fails({"inputs": [input0(datatype="BF16", data=[0] * 16)]}, "BF16 is not supported")


# --- BC-04: BYTES in JSON -----------------------------------------------------------------


def text(data: Any, shape: list[int]) -> dict[str, Any]:
    return {"inputs": [{"name": "TEXT", "shape": shape, "datatype": "BYTES", "data": data}]}


def test_bc04_flat_nested_and_regrouped_agree() -> None:
    a = decode(text(["a", "b"], [2, 1]), ECHO_BYTES).request.inputs["TEXT"]
    b = decode(text([["a"], ["b"]], [2, 1]), ECHO_BYTES).request.inputs["TEXT"]
    c = decode(text([["a", "b"]], [2, 1]), ECHO_BYTES).request.inputs["TEXT"]
    assert a.shape == b.shape == c.shape == (2, 1)
    assert a.tolist() == b.tolist() == c.tolist() == [[b"a"], [b"b"]]


def test_bc04_numeric_follows_the_same_nesting_rule() -> None:
    config = model(
        [TensorSpec(name="TEXT", datatype="INT32", shape=[1])],
        [TensorSpec(name="o", datatype="INT32", shape=[1])],
    )
    c = decode({"inputs": [dict(text([[1, 2]], [2, 1])["inputs"][0], datatype="INT32")]}, config)
    assert c.request.inputs["TEXT"].tolist() == [[1], [2]]


@pytest.mark.parametrize(
    ("value", "length"), [("héllo ✓", 10), ("", 0), ("a\u0000b", 3), ("aGVsbG8gd29ybGQ=", 16)]
)
def test_bc04_byte_exact(value: str, length: int) -> None:
    arr = decode(text([value], [1, 1]), ECHO_BYTES).request.inputs["TEXT"]
    assert arr.dtype == object and arr.shape == (1, 1)
    assert arr[0, 0] == value.encode("utf-8") and len(arr[0, 0]) == length


def test_bc04_escaped_unicode_json() -> None:
    body = (
        b'{"inputs":[{"name":"TEXT","shape":[1,1],"datatype":"BYTES","data":["h\\u00e9\\u0000"]}]}'
    )
    assert decode(body, ECHO_BYTES).request.inputs["TEXT"][0, 0] == b"h\xc3\xa9\x00"


def test_bc04_bare_string() -> None:
    fails(text("abc", [1]), r"'data' must be a JSON array, got string \"abc\"", ECHO_BYTES)


def test_bc04_numbers_in_bytes() -> None:
    fails(text([1, 2], [2, 1]), "BYTES data must be JSON strings; element 0 is 1", ECHO_BYTES)


# --- BC-06: binary tensor extension --------------------------------------------------------

HEADER = {
    "inputs": [
        {
            "name": "INPUT0",
            "shape": [1, 4],
            "datatype": "FP32",
            "parameters": {"binary_data_size": 16},
        }
    ]
}
VALUES = np.array([1.5, -2.0, 3.25, 1e-3], dtype="<f4")


def test_bc06_correct_header() -> None:
    body, length = binary_body(HEADER, VALUES.tobytes())
    arr = decode(body, DOUBLE4, header_length=length).request.inputs["INPUT0"]
    assert arr.shape == (1, 4) and arr.dtype == np.float32
    assert arr.tobytes() == VALUES.tobytes()
    assert np.shares_memory(arr, np.frombuffer(body, dtype=np.uint8))  # zero copy


def test_bc06_header_omitted() -> None:
    body, _ = binary_body(HEADER, VALUES.tobytes())
    fails(body, "data after the JSON document.*Inference-Header-Content-Length", DOUBLE4)


def test_bc06_header_omitted_pure_json_with_binary_size() -> None:
    body, _ = binary_body(HEADER)
    fails(
        body,
        "binary_data_size is set but the Inference-Header-Content-Length header is missing",
        DOUBLE4,
    )


def test_bc06_header_larger_than_body() -> None:
    body, _ = binary_body(HEADER, VALUES.tobytes())
    fails(
        body,
        f"Inference-Header-Content-Length {len(body) + 1} exceeds the request body size "
        f"{len(body)}",
        DOUBLE4,
        header_length=len(body) + 1,
    )


def test_bc06_header_cuts_json() -> None:
    body, length = binary_body(HEADER, VALUES.tobytes())
    fails(
        body,
        rf"first {length - 10} bytes.*Inference-Header-Content-Length: {length - 10}\) "
        r"is not valid JSON",
        DOUBLE4,
        header_length=length - 10,
    )


def test_bc06_header_too_long_takes_binary_as_json() -> None:
    body, length = binary_body(HEADER, VALUES.tobytes())
    fails(body, "must equal the JSON length exactly", DOUBLE4, header_length=length + 4)


@pytest.mark.parametrize("value", ["-5", "abc", "1.5", "+5", "", "1_0", "٣"])
def test_bc06_bad_header_values(value: str) -> None:
    with pytest.raises(
        InvalidInputError, match="Inference-Header-Content-Length must be a non-negative"
    ):
        parse_header_length(value)


def test_parse_header_length_ok() -> None:
    assert parse_header_length(None) is None
    assert parse_header_length("0") == 0
    assert parse_header_length(" 123 ") == 123


def test_bc06_truncated() -> None:
    body, length = binary_body(HEADER, VALUES.tobytes()[:12])
    fails(
        body,
        "binary data for input 'INPUT0' is truncated: binary_data_size 16 but only 12 bytes remain",
        DOUBLE4,
        header_length=length,
    )


def test_bc06_extra_tail() -> None:
    body, length = binary_body(HEADER, VALUES.tobytes() + b"\0\0\0\0")
    fails(body, "^4 unexpected bytes after the last binary input$", DOUBLE4, header_length=length)


def test_bc06_extra_bytes_without_binary_inputs() -> None:
    body, length = binary_body({"inputs": [input0((1, 4), [1, 2, 3, 4])]}, b"\0\0")
    fails(
        body,
        "2 unexpected bytes after the JSON \\(no input is binary\\)",
        DOUBLE4,
        header_length=length,
    )


def test_bc06_size_vs_shape() -> None:
    header = json.loads(json.dumps(HEADER))
    header["inputs"][0]["parameters"]["binary_data_size"] = 12
    body, length = binary_body(header, VALUES.tobytes()[:12])
    fails(
        body,
        r"input 'INPUT0': binary_data_size 12 does not match shape \[1, 4\] FP32 = 16 bytes",
        DOUBLE4,
        header_length=length,
    )


def test_bc06_both_data_and_binary() -> None:
    header = json.loads(json.dumps(HEADER))
    header["inputs"][0]["data"] = [1, 2, 3, 4]
    body, length = binary_body(header, VALUES.tobytes())
    fails(body, "both 'data' and binary_data_size", DOUBLE4, header_length=length)


def test_neither_data_nor_binary() -> None:
    fails(
        {"inputs": [input0((1, 4))]}, "has neither 'data' nor parameters.binary_data_size", DOUBLE4
    )
    fails({"inputs": [input0((1, 4), parameters={})]}, "has neither", DOUBLE4)


def test_data_null() -> None:
    fails(
        b'{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","data":null}]}',
        "got null",
        DOUBLE4,
    )


@pytest.mark.parametrize("size", [-1, 1.5, "16", True])
def test_bad_binary_data_size(size: Any) -> None:
    header = {"inputs": [input0((1, 4), parameters={"binary_data_size": size})]}
    body, length = binary_body(header, VALUES.tobytes())
    fails(body, "binary_data_size must be a non-negative integer", DOUBLE4, header_length=length)


def test_header_length_equal_to_body_without_binary() -> None:
    raw = orjson.dumps({"inputs": [input0((1, 4), [1, 2, 3, 4])]})
    arr = decode(raw, DOUBLE4, header_length=len(raw)).request.inputs["INPUT0"]
    assert arr.tolist() == [[1, 2, 3, 4]]


def test_binary_with_no_bytes_left() -> None:
    body, length = binary_body(HEADER)
    fails(
        body,
        "truncated: binary_data_size 16 but only 0 bytes remain",
        DOUBLE4,
        header_length=length,
    )


def test_several_binary_inputs_in_order_and_mixed_with_json() -> None:
    ids = np.array([[101, 2**53 + 1, 102]], dtype="<i8")
    mask = np.array([[1, 1, 0]], dtype="<i8")
    header = {
        "inputs": [
            {
                "name": "attention_mask",
                "shape": [1, 3],
                "datatype": "INT64",
                "parameters": {"binary_data_size": 24},
            },
            {"name": "token_type_ids", "shape": [1, 3], "datatype": "INT64", "data": [0, 0, 0]},
            {
                "name": "input_ids",
                "shape": [1, 3],
                "datatype": "INT64",
                "parameters": {"binary_data_size": 24},
            },
        ]
    }
    body, length = binary_body(header, mask.tobytes(), ids.tobytes())
    inputs = decode(body, TWO_INPUTS, header_length=length).request.inputs
    np.testing.assert_array_equal(inputs["input_ids"], ids)
    np.testing.assert_array_equal(inputs["attention_mask"], mask)
    np.testing.assert_array_equal(inputs["token_type_ids"], [[0, 0, 0]])


def test_binary_bytes_input() -> None:
    items = [b"a\x00b", "héllo ✓".encode(), b"", b"\xff\xfe"]
    wire = b"".join(len(x).to_bytes(4, "little") + x for x in items)
    header = {
        "inputs": [
            {
                "name": "TEXT",
                "shape": [4, 1],
                "datatype": "BYTES",
                "parameters": {"binary_data_size": len(wire)},
            }
        ]
    }
    body, length = binary_body(header, wire)
    arr = decode(body, ECHO_BYTES, header_length=length).request.inputs["TEXT"]
    assert arr.shape == (4, 1) and arr.ravel().tolist() == items


def test_binary_bytes_wrong_count() -> None:
    wire = b"".join(len(x).to_bytes(4, "little") + x for x in [b"a", b"b", b"c"])
    header = {
        "inputs": [
            {
                "name": "TEXT",
                "shape": [2, 1],
                "datatype": "BYTES",
                "parameters": {"binary_data_size": len(wire)},
            }
        ]
    }
    body, length = binary_body(header, wire)
    fails(
        body,
        "unexpected number of string elements 3 for inference input 'TEXT' for model ",
        ECHO_BYTES,
        header_length=length,
    )


def test_binary_wrong_datatype_is_refused_not_reinterpreted() -> None:
    ids = np.array([[1, 2, 3]], dtype="<i4")
    header = {
        "inputs": [
            {
                "name": "input_ids",
                "shape": [1, 3],
                "datatype": "INT32",
                "parameters": {"binary_data_size": 12},
            }
        ]
    }
    body, length = binary_body(header, ids.tobytes())
    fails(body, "datatype INT32 does not match the model's INT64", TOKENS64, header_length=length)
    header["inputs"][0]["datatype"] = "INT64"
    body, length = binary_body(header, ids.tobytes())
    fails(
        body,
        r"binary_data_size 12 does not match shape \[1, 3\] INT64 = 24 bytes",
        TOKENS64,
        header_length=length,
    )


def test_shared_memory_refused() -> None:
    header = {
        "inputs": [
            input0((1, 4), parameters={"shared_memory_region": "r", "shared_memory_byte_size": 16})
        ]
    }
    fails(header, "parameter .shared_memory_region.: Client shared memory is disabled", DOUBLE4)


# --- BC-07: zero-size tensors ---------------------------------------------------------------


def test_bc07_zero_size_non_batch_dim_json() -> None:
    arr = decode(
        {"inputs": [{"name": "X", "shape": [1, 0], "datatype": "FP32", "data": []}]}, VARLEN
    ).request.inputs["X"]
    assert arr.shape == (1, 0) and arr.dtype == np.float32


def test_bc07_zero_size_binary() -> None:
    header = {
        "inputs": [
            {
                "name": "X",
                "shape": [1, 0],
                "datatype": "FP32",
                "parameters": {"binary_data_size": 0},
            }
        ]
    }
    body, length = binary_body(header)
    arr = decode(body, VARLEN, header_length=length).request.inputs["X"]
    assert arr.shape == (1, 0)


@pytest.mark.parametrize("shape", [[0, 5], [0, 0]])
def test_bc07_batch_zero_refused(shape: list[int]) -> None:
    body = {"inputs": [{"name": "X", "shape": shape, "datatype": "FP32", "data": []}]}
    fails(body, r"batch dimension 0 is not allowed \(must be 1..max_batch_size", VARLEN)


def test_bc07_zero_dims_allowed_without_batching() -> None:
    body = {"inputs": [{"name": "X", "shape": [0, 5], "datatype": "FP32", "data": []}]}
    assert decode(body, VARLEN_UNBATCHED).request.inputs["X"].shape == (0, 5)


def test_bc07_bytes_batch_zero_refused() -> None:
    fails(text([], [0, 1]), "batch dimension 0 is not allowed", ECHO_BYTES)


# --- request id, parameters, outputs -------------------------------------------------------


def with_extra(**extra: Any) -> dict[str, Any]:
    return {"inputs": [input0(data=list(range(16)))], **extra}


def test_parameters_mapped_and_kept() -> None:
    params = {"priority": 2, "timeout": 150000, "binary_data_output": True, "custom": "x:y"}
    decoded = decode(with_extra(parameters=params))
    request = decoded.request
    assert request.priority == 2 and request.timeout_us == 150000
    assert request.parameters == params
    assert decoded.output_options.default_binary is True


def test_timeout_zero_means_default() -> None:
    assert decode(with_extra(parameters={"timeout": 0})).request.timeout_us is None


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"priority": -1}, "'priority' must be a non-negative integer, got -1"),
        ({"priority": 1.0}, "'priority' must be a non-negative integer, got 1.0"),
        ({"priority": True}, "'priority'"),
        ({"timeout": "100"}, "'timeout' must be a non-negative integer"),
        ({"binary_data_output": 1}, "'binary_data_output' must be true or false"),
    ],
)
def test_bad_request_parameters(params: dict[str, Any], match: str) -> None:
    fails(with_extra(parameters=params), match)


def test_parameters_must_be_object() -> None:
    fails(with_extra(parameters=[1]), "request 'parameters' must be a JSON object, got array")


def test_id_must_be_a_string() -> None:
    fails(with_extra(id=5), "request 'id' must be a string, got 5")
    assert decode(with_extra(id="")).request.id == ""


def test_outputs_requested_in_order_with_binary_flags() -> None:
    outputs = [
        {"name": "pooled", "parameters": {"binary_data": True}},
        {"name": "embedding"},
    ]
    ids = {"name": "input_ids", "shape": [1, 1], "datatype": "INT64", "data": [1]}
    mask = {"name": "attention_mask", "shape": [1, 1], "datatype": "INT64", "data": [1]}
    decoded = decode({"inputs": [ids, mask], "outputs": outputs}, TWO_INPUTS)
    assert decoded.request.requested_outputs == ["pooled", "embedding"]
    assert decoded.output_options.binary == {"pooled": True}
    assert decoded.output_options.is_binary("pooled") and not decoded.output_options.is_binary(
        "embedding"
    )


def test_empty_outputs_means_all() -> None:
    assert decode(with_extra(outputs=[])).request.requested_outputs is None


@pytest.mark.parametrize(
    ("outputs", "match"),
    [
        (
            [{"name": "NOPE"}],
            "output 'NOPE' is not an output of model 'm'; its outputs are 'OUTPUT0'",
        ),
        ({"name": "OUTPUT0"}, "'outputs' must be a JSON array"),
        (["OUTPUT0"], r"outputs\[0\] must be a JSON object"),
        ([{"name": 1}], r"outputs\[0\]: 'name' must be a string"),
        ([{"name": "OUTPUT0"}, {"name": "OUTPUT0"}], "already exists in request"),
        (
            [{"name": "OUTPUT0", "parameters": {"binary_data": "yes"}}],
            "'binary_data' must be true or false",
        ),
        ([{"name": "OUTPUT0", "parameters": []}], "'parameters' must be a JSON object"),
        (
            [{"name": "OUTPUT0", "parameters": {"classification": -3}}],
            "'classification' must be a non-negative integer",
        ),
        ([{"name": "OUTPUT0", "parameters": {"shared_memory_region": "r"}}], "shared memory"),
    ],
)
def test_bad_outputs(outputs: Any, match: str) -> None:
    fails(with_extra(outputs=outputs), match)


def test_unknown_keys_ignored() -> None:
    decoded = decode(with_extra(model_name="x", extra={"a": 1}))
    assert decoded.request.inputs["INPUT0"].shape == (1, 16)


def test_input_parameters_must_be_object() -> None:
    fails(
        {"inputs": [input0(data=[0] * 16, parameters=[1])]},
        "input 'INPUT0': 'parameters' must be a JSON object",
    )


def test_extra_bytes_after_zero_size_binary_input() -> None:
    header = {
        "inputs": [
            {
                "name": "X",
                "shape": [1, 0],
                "datatype": "FP32",
                "parameters": {"binary_data_size": 0},
            }
        ]
    }
    body, length = binary_body(header, b"\0" * 3)
    fails(body, "^3 unexpected bytes after the last binary input$", VARLEN, header_length=length)
