"""Failure cases BC-01, BC-02, BC-03 (REST), BC-04, BC-06, BC-07, BC-09 and BC-14 of
shared/cases/README.md, over real HTTP. After each bad request the server must still serve a
valid request to the same model and to another model ("server alive")."""

from __future__ import annotations

import concurrent.futures
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


BC02_BODIES = [
    (fp32([1, 16], list(range(18))), ["16", "18"]),
    (fp32([1, 16], list(range(15))), ["16", "15"]),
    (fp32([2, 16], [ROW]), ["32", "16"]),
    (fp32([-1, 16], ROW), ["-1"]),
    (fp32([1, -16], ROW), ["-16"]),
    (fp32([1, 16.0], ROW), ["shape"]),
    (fp32(["1", 16], ROW), ["shape"]),
    (fp32([], ROW), ["shape"]),
    (fp32([4294967296, 4294967296], [1, 2]), ["shape"]),
    (fp32([9, 16], list(range(9 * 16))), ["max_batch_size", "8"]),
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


# -- BC-03 (REST): datatypes and integer precision -------------------------------------------


def ids(datatype, data, model="tokens_int64"):
    return model, {
        "inputs": [
            {"name": "input_ids", "shape": [1, len(data)], "datatype": datatype, "data": data}
        ]
    }


@pytest.mark.parametrize(
    ("model_body", "mentions"),
    [
        (ids("INT32", [101, 2023, 102]), ["INT32", "INT64"]),
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


def test_bc03_int64_beyond_2_pow_53_is_exact(client):
    body = (
        b'{"inputs":[{"name":"input_ids","shape":[1,1],"datatype":"INT64",'
        b'"data":[9007199254740993]}]}'
    )
    response = post_raw(client, "tokens_int64", body)
    assert response.status_code == 200, response.text
    assert b"9007199254740993" in response.content


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


@pytest.mark.parametrize(
    ("value", "length"), [("héllo ✓", 10), ("", 0), ("a\u0000b", 3), ("aGVsbG8=", 8)]
)
def test_bc04_bytes_round_trip_exactly(client, value, length):
    response = client.post("/v2/models/echo_bytes/infer", json=text([1, 1], [value]))
    assert response.status_code == 200, response.text
    outputs = {o["name"]: o for o in response.json()["outputs"]}
    assert outputs["TEXT_OUT"]["data"] == [value]
    assert outputs["LEN"]["data"] == [length]


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


# -- BC-07: zero-size dimensions ---------------------------------------------------------------


def test_bc07_zero_size_non_batch_dim_returns_empty_output(client):
    body = {"inputs": [{"name": "X", "shape": [1, 0], "datatype": "FP32", "data": []}]}
    response = client.post("/v2/models/varlen_fp32/infer", json=body)
    assert response.status_code == 200, response.text
    out = response.json()["outputs"][0]
    assert out["shape"] == [1, 0] and out["data"] == []


@pytest.mark.parametrize(
    ("model", "name", "datatype", "shape"),
    [
        ("varlen_fp32", "X", "FP32", [0, 5]),
        ("varlen_fp32", "X", "FP32", [0, 0]),
        ("echo_bytes", "TEXT", "BYTES", [0, 1]),
    ],
)
def test_bc07_empty_batch_is_a_documented_400(client, model, name, datatype, shape):
    body = {"inputs": [{"name": name, "shape": shape, "datatype": datatype, "data": []}]}
    response = client.post(f"/v2/models/{model}/infer", json=body)
    assert response.status_code == 400 and "batch" in error_of(response)
    assert_alive(client)


def test_bc07_binary_zero_bytes_and_neighbours_in_the_same_window(client):
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "X",
                    "shape": [1, 0],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 0},
                }
            ]
        }
    ).encode()

    def empty():
        return client.post(
            "/v2/models/varlen_fp32/infer",
            content=header,
            headers={"inference-header-content-length": str(len(header))},
        )

    def normal(i):
        return client.post(
            "/v2/models/varlen_fp32/infer",
            json={"inputs": [{"name": "X", "shape": [1, 5], "datatype": "FP32", "data": [i] * 5}]},
        )

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(empty)] + [pool.submit(normal, i) for i in range(3)]
        responses = [f.result() for f in futures]
    assert responses[0].status_code == 200 and responses[0].json()["outputs"][0]["shape"] == [1, 0]
    for i, response in enumerate(responses[1:]):
        assert response.status_code == 200
        assert response.json()["outputs"][0]["data"] == [i + 1.0] * 5


# -- BC-09: batch scatter and output-count mismatch --------------------------------------------


def run_three(client, model):
    def call(args):
        rows, start = args
        data = (np.arange(rows * 16) + start).tolist()
        return client.post(
            f"/v2/models/{model}/infer",
            json={
                "inputs": [
                    {"name": "INPUT0", "shape": [rows, 16], "datatype": "FP32", "data": data}
                ]
            },
        )

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        return list(pool.map(call, [(1, 0), (3, 1000), (2, 5000)]))


def test_bc09_each_caller_gets_exactly_its_rows(client):
    for (rows, start), response in zip(
        [(1, 0), (3, 1000), (2, 5000)], run_three(client, "double_fp32_wide"), strict=True
    ):
        assert response.status_code == 200
        out = response.json()["outputs"][0]
        assert out["shape"] == [rows, 16]
        assert out["data"] == [2.0 * v for v in (np.arange(rows * 16) + start).tolist()]


def test_bc09_wrong_output_rows_fail_every_member_with_500(client):
    for response in run_three(client, "wrong_count"):
        assert response.status_code == 500
        assert "rows" in error_of(response) and "for a batch of" in error_of(response)
    response = client.post("/v2/models/scalar_out/infer", json=VALID)
    assert response.status_code == 500 and "scalar" in error_of(response)
    assert_alive(client)


# -- BC-14: one bad request in a batch ---------------------------------------------------------


def test_bc14_invalid_requests_are_refused_before_batching(client):
    bodies = [fp32([1, 16], [float(i)] * 16) for i in range(6)]
    bodies.append(
        {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": ROW}]}
    )
    bodies.append(fp32([1, 15], ROW[:15]))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(
            pool.map(lambda b: client.post("/v2/models/double_fp32/infer", json=b), bodies)
        )
    for i, response in enumerate(responses[:6]):
        assert response.status_code == 200
        assert response.json()["outputs"][0]["data"] == [2.0 * i] * 16
    assert [r.status_code for r in responses[6:]] == [400, 400]


def test_bc14_a_raising_batch_is_split_so_only_the_bad_request_fails(client):
    before = client.get("/v2/models/marker_fail/stats").json()["model_stats"][0]
    bodies = [fp32([1, 16], [float(i + 1)] * 16) for i in range(7)]
    bodies.insert(3, fp32([1, 16], [-999.0] + [0.0] * 15))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(
            pool.map(lambda b: client.post("/v2/models/marker_fail/infer", json=b), bodies)
        )
    statuses = [r.status_code for r in responses]
    assert statuses == [200, 200, 200, 500, 200, 200, 200, 200]
    assert "marker" in error_of(responses[3])
    for body, response in zip(bodies, responses, strict=True):
        if response.status_code == 200:
            expected = [2.0 * v for v in body["inputs"][0]["data"]]
            assert response.json()["outputs"][0]["data"] == expected
    after = client.get("/v2/models/marker_fail/stats").json()["model_stats"][0]
    assert (
        after["failure_reasons"].get("backend_error", 0)
        - before["failure_reasons"].get("backend_error", 0)
        == 1
    )


def test_bc14_per_row_error_fails_only_its_request(client):
    before = client.get("/v2/models/marker_fail_per_row/stats").json()["model_stats"][0]
    bodies = [fp32([1, 16], [float(i + 1)] * 16) for i in range(7)]
    bodies.insert(5, fp32([1, 16], [-999.0] + [0.0] * 15))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(
            pool.map(lambda b: client.post("/v2/models/marker_fail_per_row/infer", json=b), bodies)
        )
    assert [r.status_code for r in responses] == [200] * 5 + [500] + [200] * 2
    assert "marker" in error_of(responses[5])
    after = client.get("/v2/models/marker_fail_per_row/stats").json()["model_stats"][0]
    failed = after["inference_stats"]["fail"]["count"] - before["inference_stats"]["fail"]["count"]
    assert failed == 1
