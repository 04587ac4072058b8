"""The JSON part of an HTTP request: parse errors and duplicate keys (protocol.json_header)."""

from __future__ import annotations

import json

import pytest

from gpuserve.errors import InvalidInputError
from gpuserve.protocol import json_header
from gpuserve.protocol.json_header import parse_json_header


def raises(match: str):
    return pytest.raises(InvalidInputError, match=match)


def test_valid_object() -> None:
    assert parse_json_header(b'{"inputs": [1]}') == {"inputs": [1]}


def test_empty_body() -> None:
    with raises("^request body is empty$"):
        parse_json_header(b"")


def test_empty_header_from_header_length_zero() -> None:
    with raises("Inference-Header-Content-Length is 0"):
        parse_json_header(b"", header_length=0, body_size=16)


def test_cut_off_json_has_position() -> None:
    with raises(
        r"request body is not valid JSON: unexpected end of data at line 1 column 13 \(char 12\)"
    ):
        parse_json_header(b'{"inputs": [')


def test_stray_bracket_has_position() -> None:
    body = b'{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"FP32","data":[0.5]]}'
    with raises(r"request body is not valid JSON: .* at line 1 column \d+ \(char \d+\)"):
        parse_json_header(body)


@pytest.mark.parametrize(
    ("body", "kind"),
    [(b"[]", "array"), (b'"hello"', "string"), (b"3", "integer"), (b"null", "null")],
)
def test_not_an_object(body: bytes, kind: str) -> None:
    with raises(f"^request body must be a JSON object, got {kind}$"):
        parse_json_header(body)


def test_invalid_utf8_names_the_byte() -> None:
    with raises(r"request body is not valid UTF-8: byte 0xff at position 10"):
        parse_json_header(b'{"inputs":\xff[]}')
    with raises(r"not valid UTF-8: byte 0xc3 at position 11 \(invalid continuation byte\)"):
        parse_json_header(b'{"inputs":"\xc3("}')


@pytest.mark.parametrize(
    "tail",
    [b"\x00\x00\x80?", b"garbage", b"\xff\xfe", b" \x00", b"\x00\xff", b'{"b":1}'],
)
def test_data_after_document_suggests_header(tail: bytes) -> None:
    with raises(
        r"request body has data after the JSON document \(from byte 1[34]\); if it carries "
        r"binary tensor data, send the Inference-Header-Content-Length header with the JSON "
        r"length \(the JSON appears to be 1[34] bytes\)"
    ):
        parse_json_header(b'{"inputs":[]}' + tail)


def test_trailing_offset_is_in_bytes() -> None:
    body = '{"id":"é✓"}'.encode() + b"\x00\x01"
    with raises("from byte 14"):  # 7 + 2 (é) + 3 (✓) + 2
        parse_json_header(body)


def test_header_length_errors_mention_the_header() -> None:
    with raises(r"first 8 bytes of the 30-byte body, per Inference-Header-Content-Length: 8"):
        parse_json_header(b'{"inputs', header_length=8, body_size=30)
    with raises("Inference-Header-Content-Length must equal the JSON length exactly"):
        parse_json_header(b'{"inputs":[]}\x00\x00', header_length=15, body_size=30)


@pytest.mark.parametrize(
    "body",
    [
        b'{"inputs": [], "inputs": []}',
        b'{"inputs": [{"name": "A", "name": "B", "data": [1]}]}',
        b'{"inputs": [{"name": "A", "parameters": {"binary_data_size": 4, '
        b'"binary_data_size": 8}}]}',
        b'{"id": "a:b", "id": "c"}',
        b'{"id": "x", "parameters": {"k": "v:w"}, "parameters": {}}',
        b'{"inputs": [{"name": "T", "data": ["a:b", "c"]}], "outputs": [], "outputs": []}',
        b'{"a": {"b": {"c": 1, "c": 2}}}',
        b'{"a": "\\u003a", "a": 1}',
        b'{"inputs":[{"data":[{"k":1,"k":2}]}]}',
    ],
)
def test_duplicate_keys_refused(body: bytes) -> None:
    with raises("request JSON repeats the key '.*' in one object"):
        parse_json_header(body)


def test_duplicate_key_named() -> None:
    with raises("repeats the key 'inputs'"):
        parse_json_header(b'{"inputs": [], "inputs": [1]}')


@pytest.mark.parametrize(
    "body",
    [
        b'{"id": "a:b:c", "inputs": [{"name": "T", "data": ["x:y", "::", "z"]}]}',
        b'{"id": "\\u003a", "inputs": []}',
        b'{"k:e:y": 1, "inputs": [[["a:"]], {"x": ":"}]}',
        b'{"inputs": [{"name": "A", "data": [1, ":"]}]}',
        b'{"inputs": [{"name": "A", "data": [{"k": 1}]}], "parameters": {"a": [{"b": 2}]}}',
    ],
)
def test_colons_in_strings_are_not_duplicates(body: bytes) -> None:
    assert parse_json_header(body) == json.loads(body)


def test_cheap_proof_skips_the_second_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = json.loads

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(json_header.json, "loads", spy)
    parse_json_header(b'{"inputs":[{"name":"A","shape":[1,3],"datatype":"INT64","data":[1,2,3]}]}')
    parse_json_header(b'{"id":"req:1","inputs":[{"name":"T","data":["a:b","c"]}]}')
    assert calls == []
    with raises("repeats the key"):
        parse_json_header(b'{"inputs":[],"inputs":[]}')
    assert len(calls) == 1


def test_tensor_data_not_walked_for_the_proof() -> None:
    data = list(range(100_000))
    body = json.dumps({"inputs": [{"name": "A", "data": data}]}).encode()
    assert json_header._count_keys(json.loads(body)) == 3


def test_too_deep_nesting_is_a_client_error() -> None:
    body = b'{"a":"x:y","b":' + b"[" * 5000 + b"]" * 5000 + b"}"
    with raises("nested too deeply|not valid JSON"):
        parse_json_header(body)


@pytest.mark.parametrize("depth", [300, 900])
def test_deep_nesting_with_string_colons_never_crashes(depth: int) -> None:
    body = b'{"a":"x:y","b":' + b"[" * depth + b"]" * depth + b"}"
    try:
        assert parse_json_header(body)["a"] == "x:y"
    except InvalidInputError as err:
        assert "nested too deeply" in str(err) or "not valid JSON" in str(err)
