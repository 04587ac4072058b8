"""The JSON- and binary-extension-specific parts of failure cases BC-01, BC-02, BC-03 (REST),
BC-04 and BC-06 of shared/cases/README.md, over real HTTP: malformed JSON, JSON types and
nesting, JSON numbers out of range, BYTES in JSON, and the binary tensor extension's framing.
After each bad request the server must still serve a valid request to the same model and to
another model ("server alive").

What HTTP and gRPC share (shapes, datatypes, counts, empty batches, BYTES and INT64 round
trips, batch scatter and failures: BC-02/03/04/07/09/14) is in the parametrised suite,
``tests/integration/test_frontends_errors.py`` and ``test_frontends_infer.py``."""

from __future__ import annotations

import json

import numpy as np
import pytest

ROW = list(range(16))
VALID = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": ROW}]}


def assert_alive(client):
    response = client.post("/v2/models/double_fp32/infer", json=VALID)
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == [2.0 * v for v in ROW]
    other = client.post(
        "/v2/models/varlen_fp32/infer",
        json={"inputs": [{"name": "X", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]},
    )
    assert other.status_code == 200, other.text


def post_raw(client, model, body: bytes, headers=None):
    return client.post(
        f"/v2/models/{model}/infer",
        content=body,
        headers={"content-type": "application/json", **(headers or {})},
    )


def error_of(response) -> str:
    assert response.headers["content-type"].startswith("application/json")
    return response.json()["error"]


# -- BC-01: malformed JSON bodies are 400, never 500 ----------------------------------------

BC01_BODIES = [
    (b'{"inputs": [', "JSON"),
    (b'{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"FP32","data":[0.5]]}', "JSON"),
    (b"", "empty"),
    (b"[]", "object"),
    (b'"hello"', "object"),
    (b'{"inputs": {}}', "inputs"),
    (b'{"inputs":[{"name":"INPUT0","datatype":"FP32","data":[1,2]}]}', "shape"),
    (
        json.dumps(
            {"inputs": [{"name": "NOPE", "shape": [1, 16], "datatype": "FP32", "data": ROW}]}
        ).encode(),
        "INPUT0",
    ),
    (
        b'{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"FP32","data":'
        + str(ROW).encode()
        + b'}], "inputs": []}',
        "inputs",
    ),
    (json.dumps(VALID).encode().replace(b"INPUT0", b"INPUT\xff0"), "UTF-8"),
]


@pytest.mark.parametrize(("body", "mentions"), BC01_BODIES)
def test_bc01_malformed_json_is_400_with_reason(client, body, mentions):
    before = client.get("/v2/models/double_fp32/stats").json()["model_stats"][0]
    response = post_raw(client, "double_fp32", body)
    assert response.status_code == 400, response.text
    assert mentions.lower() in error_of(response).lower()
    after = client.get("/v2/models/double_fp32/stats").json()["model_stats"][0]
    assert (
        after["failure_reasons"].get("invalid", 0)
        == before["failure_reasons"].get("invalid", 0) + 1
    )
    assert after["execution_count"] == before["execution_count"]  # the model was never called
    assert_alive(client)


# -- BC-02: data/shape mismatch and bad dims ------------------------------------------------


def fp32(shape, data):
    return {"inputs": [{"name": "INPUT0", "shape": shape, "datatype": "FP32", "data": data}]}


BC02_BODIES = [  # JSON-specific: nested data, shapes that are not lists of integers
    (fp32([2, 16], [ROW]), ["32", "16"]),
    (fp32([1, 16.0], ROW), ["shape"]),
    (fp32(["1", 16], ROW), ["shape"]),
]


@pytest.mark.parametrize(("body", "mentions"), BC02_BODIES)
def test_bc02_shape_and_count_errors_are_400(client, body, mentions):
    response = client.post("/v2/models/double_fp32/infer", json=body)
    assert response.status_code == 400, response.text
    message = error_of(response)
    assert "INPUT0" in message
    for word in mentions:
        assert word in message, message
    assert_alive(client)


# -- BC-03 (REST): JSON numbers out of range or of the wrong kind -----------------------------


def ids(datatype, data, model="tokens_int64"):
    return model, {
        "inputs": [
            {"name": "input_ids", "shape": [1, len(data)], "datatype": datatype, "data": data}
        ]
    }


@pytest.mark.parametrize(
    ("model_body", "mentions"),
    [
        (ids("INT64", [9223372036854775808]), ["range"]),
        (ids("INT32", [3000000000], "tokens_int32"), ["range"]),
        (ids("INT64", [1.5]), ["input_ids"]),
        (ids("INT64", [True]), ["input_ids"]),
    ],
)
def test_bc03_wrong_datatype_or_value_is_400(client, model_body, mentions):
    model, body = model_body
    response = client.post(f"/v2/models/{model}/infer", json=body)
    assert response.status_code == 400, response.text
    for word in mentions:
        assert word in error_of(response)
    assert_alive(client)


# -- BC-04: BYTES in JSON ---------------------------------------------------------------------


def text(shape, data):
    return {"inputs": [{"name": "TEXT", "shape": shape, "datatype": "BYTES", "data": data}]}


def test_bc04_flat_and_nested_bytes_agree(client):
    flat = client.post("/v2/models/echo_bytes/infer", json=text([2, 1], ["a", "b"]))
    nested = client.post("/v2/models/echo_bytes/infer", json=text([2, 1], [["a"], ["b"]]))
    assert flat.status_code == nested.status_code == 200
    assert flat.json()["outputs"] == nested.json()["outputs"]
    # [1,2] nesting for a [2,1] shape follows the numeric rule: nesting is flattened
    odd = client.post("/v2/models/echo_bytes/infer", json=text([2, 1], [["a", "b"]]))
    numeric = client.post(
        "/v2/models/varlen_fp32/infer",
        json={"inputs": [{"name": "X", "shape": [2, 1], "datatype": "FP32", "data": [[1.0, 2.0]]}]},
    )
    assert odd.status_code == numeric.status_code == 200


@pytest.mark.parametrize("body", [text([1], "abc"), text([2, 1], [1, 2])])
def test_bc04_non_string_bytes_data_is_400(client, body):
    response = client.post("/v2/models/echo_bytes/infer", json=body)
    assert response.status_code == 400 and "TEXT" in error_of(response)
    assert_alive(client)


# -- BC-06: binary tensor extension ------------------------------------------------------------

HEADER = json.dumps(
    {
        "inputs": [
            {
                "name": "INPUT0",
                "shape": [1, 4],
                "datatype": "FP32",
                "parameters": {"binary_data_size": 16},
            }
        ]
    }
).encode()
PAYLOAD = np.array([1.5, -2.0, 3.25, 0.0], dtype="<f4").tobytes()


def post_binary(client, header: bytes, payload: bytes, length) -> object:
    headers = {"content-type": "application/octet-stream"}
    if length is not None:
        headers["inference-header-content-length"] = str(length)
    return client.post("/v2/models/double4_fp32/infer", content=header + payload, headers=headers)


def test_bc06_binary_round_trip_is_bit_exact(client):
    out_header = json.loads(HEADER)
    out_header["outputs"] = [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]
    header = json.dumps(out_header).encode()
    response = post_binary(client, header, PAYLOAD, len(header))
    assert response.status_code == 200, response.text
    length = int(response.headers["inference-header-content-length"])
    meta = json.loads(response.content[:length])
    assert meta["outputs"][0]["parameters"]["binary_data_size"] == 16
    tail = response.content[length:]
    assert len(tail) == 16
    np.testing.assert_array_equal(np.frombuffer(tail, "<f4"), np.frombuffer(PAYLOAD, "<f4") * 2)


def with_size(size: int) -> bytes:
    return HEADER.replace(b'"binary_data_size": 16', f'"binary_data_size": {size}'.encode())


@pytest.mark.parametrize(
    ("header", "payload", "length", "mentions"),
    [
        (HEADER, PAYLOAD, None, "inference-header-content-length"),
        (HEADER, PAYLOAD, len(HEADER) + 100, "inference-header-content-length"),
        (HEADER, PAYLOAD, len(HEADER) - 10, "inference-header-content-length"),
        (HEADER, PAYLOAD, -5, "inference-header-content-length"),
        (HEADER, PAYLOAD, "abc", "inference-header-content-length"),
        (HEADER, PAYLOAD[:12], len(HEADER), "12"),
        (HEADER, PAYLOAD + b"\0" * 4, len(HEADER), "4"),
        (with_size(12), PAYLOAD[:12], len(with_size(12)), "16"),
        (
            HEADER.replace(b'"parameters"', b'"data": [1, 2, 3, 4], "parameters"'),
            PAYLOAD,
            len(HEADER.replace(b'"parameters"', b'"data": [1, 2, 3, 4], "parameters"')),
            "data",
        ),
    ],
)
def test_bc06_binary_errors_are_400_and_name_the_problem(client, header, payload, length, mentions):
    response = post_binary(client, header, payload, length)
    assert response.status_code == 400, response.text
    assert mentions.lower() in error_of(response).lower()
    assert_alive(client)
