"""Per-tensor validation shared by the HTTP and gRPC codecs (gpuserve.protocol.tensors/binary)."""

from __future__ import annotations

import struct

import numpy as np
import orjson
import pytest

from gpuserve.config import ModelConfig, TensorSpec
from gpuserve.errors import BackendError, InvalidInputError
from gpuserve.protocol.binary import (
    bytes_as_text,
    bytes_elements,
    deserialize_bytes,
    serialize_bytes,
)
from gpuserve.protocol.tensors import (
    array_from_json,
    array_from_raw,
    build_input,
    check_datatype,
    check_shape,
    element_count,
    validate_request_shapes,
)


def spec(
    datatype: str = "FP32", shape: list[int] | None = None, name: str = "INPUT0"
) -> TensorSpec:
    return TensorSpec(name=name, datatype=datatype, shape=[16] if shape is None else shape)


def config(*inputs: TensorSpec, max_batch_size: int = 8) -> ModelConfig:
    return ModelConfig(
        inputs=list(inputs),
        outputs=[TensorSpec(name="OUT", datatype="FP32", shape=[-1])],
        max_batch_size=max_batch_size,
    )


def raises(match: str):
    return pytest.raises(InvalidInputError, match=match)


# --- datatype ---------------------------------------------------------------------------


def test_datatype_exact_match_passes() -> None:
    check_datatype(spec("INT64"), "input_ids", "INT64")


def test_datatype_mismatch_names_both() -> None:
    with raises(r"input 'input_ids': datatype INT32 does not match the model's INT64"):
        check_datatype(spec("INT64"), "input_ids", "INT32")


def test_datatype_uint_vs_int_mismatch() -> None:
    with raises("datatype INT32 does not match the model's UINT32"):
        check_datatype(spec("UINT32"), "x", "INT32")


def test_bf16_not_supported() -> None:
    with raises("BF16 is not supported"):
        check_datatype(spec("FP32"), "x", "BF16")


@pytest.mark.parametrize("value", ["FLOAT32", "fp32", "TYPE_FP32"])
def test_unknown_datatype_lists_valid_names(value: str) -> None:
    with raises(f'datatype "{value}" is not a KServe V2 datatype.*FP32'):
        check_datatype(spec("FP32"), "x", value)


@pytest.mark.parametrize("value", [None, 5, ["FP32"]])
def test_datatype_missing_or_not_a_string(value: object) -> None:
    with raises("'datatype'"):
        check_datatype(spec("FP32"), "x", value)


# --- shape ------------------------------------------------------------------------------


def test_batched_shape_ok() -> None:
    assert check_shape(spec(shape=[16]), "INPUT0", [3, 16], 8) == (3, 16)


def test_wildcard_dims_accept_any_including_zero() -> None:
    s = spec(shape=[-1, 4])
    assert check_shape(s, "X", [1, 0, 4], 8) == (1, 0, 4)
    assert check_shape(s, "X", [2, 100, 4], 8) == (2, 100, 4)


def test_negative_dimension_message() -> None:
    with raises(
        r"input 'INPUT0': shape \[1, -16\] has a negative dimension; shapes sent by a client "
        r"must be concrete non-negative integers"
    ):
        check_shape(spec(), "INPUT0", [1, -16], 8)


def test_client_wildcard_minus_one_refused() -> None:
    with raises(r"shape \[-1, 16\] has a negative dimension"):
        check_shape(spec(), "INPUT0", [-1, 16], 8)


@pytest.mark.parametrize(
    ("shape", "shown"),
    [
        ([1, 16.0], r"\[1, 16.0\].*16.0 is a number"),
        (["1", 16], r'\["1", 16\].*"1" is a string'),
        ([True, 16], r"\[true, 16\].*true is a boolean"),
        ([1, None], r"null is a null"),
    ],
)
def test_non_integer_dims_refused(shape: list[object], shown: str) -> None:
    with raises(shown):
        check_shape(spec(), "INPUT0", shape, 8)


@pytest.mark.parametrize("value", [None, "1,16", 16, {"0": 1}])
def test_shape_must_be_a_list(value: object) -> None:
    with raises("'shape'"):
        check_shape(spec(), "INPUT0", value, 8)


def test_empty_shape_on_batched_model() -> None:
    with raises(r"shape \[\] has 0 dimensions but the model expects 2: \[-1, 16\]"):
        check_shape(spec(), "INPUT0", [], 8)


def test_wrong_rank() -> None:
    with raises(r"shape \[16\] has 1 dimensions but the model expects 2"):
        check_shape(spec(), "INPUT0", [16], 8)


def test_batch_zero_refused() -> None:
    with raises(r"batch dimension 0 is not allowed \(must be 1..max_batch_size, here 1..8\)"):
        check_shape(spec(shape=[-1]), "X", [0, 5], 8)


def test_batch_above_max_refused() -> None:
    with raises(r"shape \[9, 16\]: batch dimension 9 exceeds max_batch_size 8"):
        check_shape(spec(), "INPUT0", [9, 16], 8)


def test_fixed_dim_mismatch() -> None:
    with raises(
        r"shape \[1, 15\] does not match the model's \[-1, 16\]: dimension 1 is 15, expected 16"
    ):
        check_shape(spec(), "INPUT0", [1, 15], 8)


def test_unbatched_model_has_no_batch_dim() -> None:
    s = spec(shape=[-1, 4])
    assert check_shape(s, "X", [0, 4], 0) == (0, 4)
    with raises(r"shape \[1, 0, 4\] has 3 dimensions but the model expects 2: \[-1, 4\]"):
        check_shape(s, "X", [1, 0, 4], 0)
    with raises("dimension 1 is 5, expected 4"):
        check_shape(s, "X", [2, 5], 0)


def test_unbatched_scalar_shape() -> None:
    assert check_shape(spec(shape=[]), "X", [], 0) == ()


def test_huge_dims_are_checked_without_overflow() -> None:
    s = spec(shape=[-1, -1])
    assert check_shape(s, "X", [4294967296, 4294967296], 0) == (4294967296, 4294967296)
    assert element_count((4294967296, 4294967296)) == 2**64
    with raises("above 2"):
        check_shape(s, "X", [2**63, 1], 0)
    # what the JSON parser makes of 99999999999999999999999999 (beyond 64 bits)
    parsed = orjson.loads(b"[99999999999999999999999999, 1]")
    with raises(r"has a dimension above 2\^63-1"):
        check_shape(s, "X", parsed, 0)
    with raises("must hold only integers; 1.5 is a number"):
        check_shape(s, "X", [1.5, 1], 0)


def test_shape_tuple_accepted() -> None:
    assert check_shape(spec(), "INPUT0", (1, 16), 8) == (1, 16)


# --- JSON data --------------------------------------------------------------------------


def test_fp32_flat_list() -> None:
    arr = array_from_json(spec(), "INPUT0", (1, 16), list(range(16)))
    assert arr.dtype == np.float32 and arr.shape == (1, 16)
    assert arr[0, 15] == 15.0


def test_count_mismatch_message() -> None:
    with raises(r"input 'INPUT0': shape \[1, 16\] needs 16 elements, got 18"):
        array_from_json(spec(), "INPUT0", (1, 16), list(range(18)))
    with raises("needs 16 elements, got 15"):
        array_from_json(spec(), "INPUT0", (1, 16), list(range(15)))


def test_nested_one_row_for_two_rows() -> None:
    with raises(r"shape \[2, 16\] needs 32 elements, got 16"):
        array_from_json(spec(), "INPUT0", (2, 16), [list(range(16))])


def test_nested_data_flattened() -> None:
    arr = array_from_json(spec(shape=[2]), "X", (2, 2), [[1, 2], [3, 4]])
    assert arr.tolist() == [[1, 2], [3, 4]]


def test_nesting_is_flattened_whatever_its_shape() -> None:
    """Policy: only the total count must match (numeric and BYTES alike)."""
    s = spec("INT32", shape=[2])
    assert array_from_json(s, "X", (2, 2), [[1, 2, 3, 4]]).tolist() == [[1, 2], [3, 4]]
    assert array_from_json(s, "X", (2, 2), [[[1]], [2, [3, 4]]]).tolist() == [[1, 2], [3, 4]]
    assert array_from_json(s, "X", (2, 2), [[1], [2, 3], [4]]).tolist() == [[1, 2], [3, 4]]


def test_huge_shape_with_two_numbers_refused_without_allocating() -> None:
    with raises(r"needs 18446744073709551616 elements, got 2"):
        array_from_json(spec(shape=[-1, -1]), "X", (4294967296, 4294967296), [1.0, 2.0])


def test_data_must_be_a_list() -> None:
    with raises(r"'data' must be a JSON array, got object"):
        array_from_json(spec(), "INPUT0", (1, 16), {"a": 1})


def test_bare_string_refused_with_hint() -> None:
    with raises(r"'data' must be a JSON array, got string \"abc\" \(wrap it in a list"):
        array_from_json(spec("BYTES", shape=[]), "TEXT", (1,), "abc")


def test_empty_tensor_from_json() -> None:
    arr = array_from_json(spec(shape=[-1]), "X", (1, 0), [])
    assert arr.shape == (1, 0) and arr.dtype == np.float32
    arr = array_from_json(spec(shape=[-1]), "X", (1, 0), [[]])
    assert arr.shape == (1, 0)


def test_empty_tensor_with_dims_beyond_numpy_limits() -> None:
    with raises("cannot be represented"):
        array_from_json(spec(shape=[-1, -1]), "X", (0, 2**62), [])


@pytest.mark.parametrize(
    ("datatype", "values"),
    [
        ("INT8", [-128, 127]),
        ("INT16", [-32768, 32767]),
        ("INT32", [-(2**31), 2**31 - 1]),
        ("INT64", [-(2**63), 2**63 - 1, 9007199254740993]),
        ("UINT8", [0, 255]),
        ("UINT16", [0, 65535]),
        ("UINT32", [0, 2**32 - 1]),
        ("UINT64", [0, 2**64 - 1, 2**63]),
    ],
)
def test_integer_limits_exact(datatype: str, values: list[int]) -> None:
    arr = array_from_json(spec(datatype, shape=[-1]), "x", (1, len(values)), values)
    assert [int(v) for v in arr.ravel()] == values


@pytest.mark.parametrize(
    ("datatype", "value"),
    [
        ("INT8", 128),
        ("INT8", -129),
        ("INT16", 32768),
        ("INT32", 3000000000),
        ("INT32", -(2**31) - 1),
        ("INT64", 2**63),
        ("UINT8", 256),
        ("UINT8", -1),
        ("UINT32", 2**32),
        ("UINT64", -1),
    ],
)
def test_integer_out_of_range(datatype: str, value: int) -> None:
    with raises(rf"element 1 \({value}\) is out of range for {datatype}"):
        array_from_json(spec(datatype, shape=[-1]), "x", (1, 2), [0, value])


def test_integer_beyond_uint64_parsed_as_float_is_out_of_range() -> None:
    # orjson reads 18446744073709551616 (2^64) as a float
    with raises("out of range for INT64"):
        array_from_json(spec("INT64", shape=[-1]), "x", (1, 1), [1.8446744073709552e19])


@pytest.mark.parametrize(
    ("value", "shown"), [(1.5, "1.5 .number."), (True, "true .boolean."), (2.0, "2.0 .number.")]
)
@pytest.mark.parametrize("datatype", ["INT32", "INT64", "UINT8"])
def test_integer_types_refuse_floats_and_bools(datatype: str, value: object, shown: str) -> None:
    with raises(rf"{datatype} data must be JSON integers; element 2 is {shown}"):
        array_from_json(spec(datatype, shape=[-1]), "x", (1, 3), [1, 2, value])


@pytest.mark.parametrize("bad", ["1", None, {"v": 1}])
def test_integer_types_refuse_other_json(bad: object) -> None:
    with raises("must be JSON integers"):
        array_from_json(spec("INT64", shape=[-1]), "x", (1, 2), [1, bad])


@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64"])
def test_floats_accept_ints_and_floats(datatype: str) -> None:
    arr = array_from_json(spec(datatype, shape=[-1]), "x", (1, 3), [1, 2.5, -3])
    assert arr.dtype.name == {"FP16": "float16", "FP32": "float32", "FP64": "float64"}[datatype]
    assert arr.tolist() == [[1.0, 2.5, -3.0]]


@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64"])
def test_floats_refuse_bools_and_strings(datatype: str) -> None:
    with raises(f"{datatype} data must be JSON numbers; element 1 is true"):
        array_from_json(spec(datatype, shape=[-1]), "x", (1, 2), [1.0, True])
    with raises('element 0 is "1.0" \\(string\\)'):
        array_from_json(spec(datatype, shape=[-1]), "x", (1, 1), ["1.0"])


def test_float_overflow_refused_not_turned_into_infinity() -> None:
    with raises(r"element 1 \(70000.0\) is out of range for FP16"):
        array_from_json(spec("FP16", shape=[-1]), "x", (1, 2), [1.0, 70000.0])
    with raises("out of range for FP32"):
        array_from_json(spec("FP32", shape=[-1]), "x", (1, 1), [1e39])
    assert array_from_json(spec("FP64", shape=[-1]), "x", (1, 1), [1e300])[0, 0] == 1e300


def test_float_limits_round_like_ieee() -> None:
    fp16 = array_from_json(spec("FP16", shape=[-1]), "x", (1, 2), [65519.0, -65504])
    assert fp16.tolist() == [[65504.0, -65504.0]]
    with raises("out of range for FP16"):
        array_from_json(spec("FP16", shape=[-1]), "x", (1, 1), [-65520])
    fp32 = array_from_json(spec("FP32", shape=[-1]), "x", (1, 1), [3.4028235e38])
    assert fp32[0, 0] == np.finfo(np.float32).max
    with raises("out of range for FP32"):
        array_from_json(spec("FP32", shape=[-1]), "x", (1, 1), [3.4028236e38])


def test_large_float_tensor_overflow_checked_in_numpy() -> None:
    values = [0.5] * 5000
    arr = array_from_json(spec("FP16", shape=[-1]), "x", (1, 5000), values)
    assert arr.dtype == np.float16 and arr.shape == (1, 5000)
    values[4321] = 1e6
    with raises(r"element 4321 \(1000000.0\) is out of range for FP16"):
        array_from_json(spec("FP16", shape=[-1]), "x", (1, 5000), values)


def test_fp32_values_exact() -> None:
    values = [0.1, 1 / 3, 3.4028234663852886e38, 1e-45]
    arr = array_from_json(spec("FP32", shape=[-1]), "x", (1, 4), values)
    np.testing.assert_array_equal(arr[0], np.array(values, dtype=np.float32))


def test_bool_only_true_false() -> None:
    arr = array_from_json(spec("BOOL", shape=[-1]), "x", (1, 2), [True, False])
    assert arr.dtype == np.bool_ and arr.tolist() == [[True, False]]
    with raises("BOOL data must be JSON booleans"):
        array_from_json(spec("BOOL", shape=[-1]), "x", (1, 2), [True, 1])
    with raises("BOOL data must be JSON booleans"):
        array_from_json(spec("BOOL", shape=[-1]), "x", (1, 1), [0.0])


def test_bytes_from_json_strings() -> None:
    arr = array_from_json(spec("BYTES", shape=[1]), "TEXT", (3, 1), ["héllo ✓", "", "a\x00b"])
    assert arr.dtype == object and arr.shape == (3, 1)
    assert arr[0, 0] == "héllo ✓".encode() and len(arr[0, 0]) == 10
    assert arr[1, 0] == b""
    assert arr[2, 0] == b"a\x00b"
    assert all(type(x) is bytes for x in arr.ravel())


def test_bytes_nested_and_flat_agree() -> None:
    s = spec("BYTES", shape=[1])
    flat = array_from_json(s, "TEXT", (2, 1), ["a", "b"])
    nested = array_from_json(s, "TEXT", (2, 1), [["a"], ["b"]])
    other = array_from_json(s, "TEXT", (2, 1), [["a", "b"]])
    assert flat.tolist() == nested.tolist() == other.tolist() == [[b"a"], [b"b"]]


def test_bytes_refuse_numbers() -> None:
    with raises(r"BYTES data must be JSON strings; element 0 is 1 \(integer\)"):
        array_from_json(spec("BYTES", shape=[1]), "TEXT", (2, 1), [1, 2])


def test_bytes_base64_looking_string_unchanged() -> None:
    arr = array_from_json(spec("BYTES", shape=[1]), "TEXT", (1, 1), ["aGVsbG8="])
    assert arr[0, 0] == b"aGVsbG8="


def test_bytes_empty_tensor() -> None:
    arr = array_from_json(spec("BYTES", shape=[-1]), "TEXT", (1, 0), [])
    assert arr.shape == (1, 0) and arr.dtype == object


# --- raw (binary) data ------------------------------------------------------------------


def test_raw_fp32_zero_copy() -> None:
    values = np.arange(4, dtype="<f4")
    buffer = b"prefix" + values.tobytes()
    raw = memoryview(buffer)[6:]
    arr = array_from_raw(spec(shape=[4]), "INPUT0", (1, 4), raw)
    np.testing.assert_array_equal(arr, values.reshape(1, 4))
    assert np.shares_memory(arr, np.frombuffer(buffer, dtype=np.uint8))


def test_raw_size_mismatch_message() -> None:
    with raises(
        r"input 'INPUT0': binary_data_size 12 does not match shape \[1, 4\] FP32 = 16 bytes"
    ):
        array_from_raw(spec(shape=[4]), "INPUT0", (1, 4), b"\0" * 12)


def test_raw_size_label_for_grpc() -> None:
    with raises("raw_input_contents size 60 does not match shape .1, 16. FP32 = 64 bytes"):
        array_from_raw(spec(), "INPUT0", (1, 16), b"\0" * 60, "raw_input_contents size")


def test_raw_int32_sent_for_int64_is_a_size_error() -> None:
    with raises("binary_data_size 12 does not match shape .1, 3. INT64 = 24 bytes"):
        array_from_raw(spec("INT64", shape=[-1]), "input_ids", (1, 3), b"\0" * 12)


def test_raw_huge_shape_no_allocation() -> None:
    with raises("binary_data_size 8 does not match shape .4294967296, 4294967296. FP32"):
        array_from_raw(spec(shape=[-1, -1]), "X", (4294967296, 4294967296), b"\0" * 8)


def test_raw_empty_tensor() -> None:
    arr = array_from_raw(spec(shape=[-1]), "X", (1, 0), b"")
    assert arr.shape == (1, 0) and arr.dtype == np.float32


@pytest.mark.parametrize("datatype", ["BOOL", "UINT16", "INT64", "FP16", "FP64"])
def test_raw_round_trip_dtypes(datatype: str) -> None:
    rng = np.random.default_rng(0)
    dtype = {"BOOL": "?", "UINT16": "<u2", "INT64": "<i8", "FP16": "<f2", "FP64": "<f8"}[datatype]
    values = (rng.standard_normal(6) * 1000).astype(dtype)
    arr = array_from_raw(spec(datatype, shape=[3]), "x", (2, 3), values.tobytes())
    assert arr.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(arr.ravel(), values)


def test_raw_bool_bytes_must_be_zero_or_one() -> None:
    with raises("BOOL bytes must be 0 or 1, got 2"):
        array_from_raw(spec("BOOL", shape=[-1]), "x", (1, 2), b"\x01\x02")


def bytes_wire(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(x)) + x for x in items)


def test_raw_bytes_elements() -> None:
    wire = bytes_wire(b"abc", b"", "é✓".encode(), b"\x00\xff")
    arr = array_from_raw(spec("BYTES", shape=[1]), "TEXT", (4, 1), wire)
    assert arr.dtype == object and arr.shape == (4, 1)
    assert arr.ravel().tolist() == [b"abc", b"", "é✓".encode(), b"\x00\xff"]


def test_raw_bytes_count_mismatch() -> None:
    wire = bytes_wire(b"a", b"b", b"c")
    with raises(
        r"unexpected number of string elements 3 for inference input 'TEXT' for model 'm', "
        r"expecting 2 \(binary_data_size 15, 2 elements use 10 bytes\)"
    ):
        array_from_raw(spec("BYTES", shape=[1]), "TEXT", (2, 1), wire, model="m")
    with raises(r"2 BYTES elements use 10 bytes but binary_data_size is 13; 3 bytes are left"):
        array_from_raw(spec("BYTES", shape=[1]), "TEXT", (2, 1), wire[:13])
    with raises(
        r"expected 4 string elements for inference input 'TEXT' for model 'm', got 3 "
        r"\(binary_data_size 15\)"
    ):
        array_from_raw(spec("BYTES", shape=[1]), "TEXT", (4, 1), wire, model="m")
    with raises("BYTES element 3 starts at byte 15"):
        array_from_raw(spec("BYTES", shape=[1]), "TEXT", (4, 1), wire + b"\0\0")


def test_raw_bytes_length_runs_past_end() -> None:
    wire = struct.pack("<I", 100) + b"short"
    with raises("BYTES element 0 declares 100 bytes but only 5 remain of binary_data_size 9"):
        array_from_raw(spec("BYTES", shape=[1]), "TEXT", (1, 1), wire)


def test_raw_bytes_impossible_count_refused_before_looping() -> None:
    # refused at once: what is counted is the buffer's elements (two empty ones), not 2**64
    with raises("expected 18446744073709551616 string elements for inference input 'T' .* got 2"):
        array_from_raw(spec("BYTES", shape=[-1, -1]), "T", (4294967296, 4294967296), b"\0" * 8)


def test_raw_bytes_empty() -> None:
    arr = array_from_raw(spec("BYTES", shape=[-1]), "TEXT", (1, 0), b"")
    assert arr.shape == (1, 0)


def test_bytes_serialize_round_trip() -> None:
    items = [b"", b"a", "héllo ✓".encode(), bytes(range(256))]
    wire = serialize_bytes(items, "OUT")
    assert wire == bytes_wire(*items)
    assert deserialize_bytes(memoryview(wire), 4, "OUT") == items


def test_bytes_elements_from_str_bytes_and_fixed_arrays() -> None:
    mixed = np.array([b"a", "é", np.bytes_(b"z")], dtype=object)
    assert bytes_elements(mixed, "O") == [b"a", "é".encode(), b"z"]
    assert bytes_elements(np.array([b"ab", b"c"]), "O") == [b"ab", b"c"]
    assert bytes_elements(np.array(["ab", "é"]), "O") == [b"ab", "é".encode()]
    with pytest.raises(BackendError, match="type int"):
        bytes_elements(np.array([b"a", 3], dtype=object), "O")
    with pytest.raises(BackendError, match="declared BYTES but the model returned a float32"):
        bytes_elements(np.zeros(2, dtype=np.float32), "O")


def test_bytes_as_text() -> None:
    arr = np.array([[b"a\x00b"], ["é"], [np.str_("s")]], dtype=object)
    assert bytes_as_text(arr, "O") == ["a\x00b", "é", "s"]
    with pytest.raises(BackendError, match=r"not valid UTF-8.*binary_data"):
        bytes_as_text(np.array([b"\xff"], dtype=object), "O")


# --- build_input and cross-input checks -------------------------------------------------


def test_build_input_checks_in_order() -> None:
    cfg = config(spec())
    with raises("datatype INT32 does not match"):
        build_input(cfg.inputs[0], "INPUT0", "INT32", [-1], json_data=[1], config=cfg)
    with raises("negative dimension"):
        build_input(cfg.inputs[0], "INPUT0", "FP32", [-1, 16], json_data=[1], config=cfg)
    with raises("needs 16 elements, got 1"):
        build_input(cfg.inputs[0], "INPUT0", "FP32", [1, 16], json_data=[1], config=cfg)
    with raises("no data"):
        build_input(cfg.inputs[0], "INPUT0", "FP32", [1, 16], config=cfg)
    raw = np.ones(16, "<f4").tobytes()
    arr = build_input(cfg.inputs[0], "INPUT0", "FP32", [1, 16], raw=raw, config=cfg)
    assert arr.shape == (1, 16)


def test_validate_request_shapes_batch_agreement() -> None:
    cfg = config(spec(name="A", shape=[-1]), spec(name="B", shape=[2]))
    assert validate_request_shapes({"A": (3, 5), "B": (3, 2)}, cfg) == 3
    with raises(r"inputs disagree on the batch dimension \('A' has 3, 'B' has 2\)"):
        validate_request_shapes({"A": (3, 5), "B": (2, 2)}, cfg)


def test_validate_request_shapes_missing_required() -> None:
    optional = TensorSpec(name="MASK", datatype="INT64", shape=[-1], optional=True)
    cfg = config(spec(name="A", shape=[-1]), spec(name="B", shape=[2]), optional)
    cfg = cfg.model_copy(update={"name": "m"})
    with raises(
        r"^expected number of inputs between 2 and 3 but got 1 inputs for model 'm'\. Got "
        r"input\(s\) \['A'\], but missing required input\(s\) \['B'\]\. Please provide all "
        r"required input\(s\)\.$"
    ):
        validate_request_shapes({"A": (1, 5)}, cfg)
    every = config(spec(name="A", shape=[-1]), spec(name="B", shape=[2]))
    every = every.model_copy(update={"name": "m"})
    with raises(r"^expected 2 inputs but got 1 inputs for model 'm'\. Got input\(s\) \['B'\], "):
        validate_request_shapes({"B": (1, 2)}, every)
    assert validate_request_shapes({"A": (1, 5), "B": (1, 2)}, cfg) == 1


def test_validate_request_shapes_unbatched() -> None:
    cfg = config(spec(name="A", shape=[-1]), max_batch_size=0)
    assert validate_request_shapes({"A": (7,)}, cfg) is None
