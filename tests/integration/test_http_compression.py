"""BC-26: compressed request bodies and ``Accept-Encoding`` (gzip, deflate; 415 for others; a
decompression bomb stops at the body limit), with httpx and Triton's own HTTP client."""

from __future__ import annotations

import gzip
import json
import time
import zlib

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.conftest import FIXTURE_REPOSITORY
from tests.helpers import InProcessServer

LIMIT = 8 * 1024 * 1024  # a small body limit keeps the bomb cheap to refuse


@pytest.fixture(scope="module")
def server():
    running = InProcessServer(FIXTURE_REPOSITORY, max_request_body_bytes=LIMIT)
    yield running
    running.stop()


def body(start: float = 0.0) -> bytes:
    data = (np.arange(16, dtype=np.float32) + start).tolist()
    doc = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": data}]}
    return json.dumps(doc).encode()


def doubled(response: httpx.Response, start: float = 0.0) -> bool:
    expected = 2 * (np.arange(16, dtype=np.float32) + start)
    return response.json()["outputs"][0]["data"] == expected.tolist()


def raw_deflate(data: bytes) -> bytes:
    compressor = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
    return compressor.compress(data) + compressor.flush()


def post(server, content: bytes, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v2/models/double_fp32/infer",
        content=content,
        headers={"content-type": "application/json", **headers},
        timeout=30,
    )


@pytest.mark.parametrize(
    ("coding", "compress"),
    [
        ("gzip", gzip.compress),
        ("GZIP", gzip.compress),
        ("deflate", zlib.compress),
        ("deflate", raw_deflate),  # raw deflate streams are accepted too
        ("identity", lambda data: data),
        ("gzip, identity", gzip.compress),
    ],
)
def test_compressed_request_bodies_are_decoded(server, coding, compress):
    response = post(server, compress(body(3.0)), **{"content-encoding": coding})
    assert response.status_code == 200, response.text
    assert doubled(response, 3.0)


@pytest.mark.parametrize("coding", ["br", "zstd", "compress"])
def test_an_unsupported_coding_is_415_naming_the_supported_ones(server, coding):
    response = post(server, body(), **{"content-encoding": coding})
    assert response.status_code == 415
    message = response.json()["error"]
    assert repr(coding) in message and "gzip" in message and "deflate" in message
    assert doubled(post(server, body()))  # the connection's server is fine


def test_a_body_that_is_not_what_its_coding_says_is_400(server):
    response = post(server, b"this is not gzip", **{"content-encoding": "gzip"})
    assert response.status_code == 400 and "not valid gzip" in response.json()["error"]
    cut = gzip.compress(body())[:-12]
    response = post(server, cut, **{"content-encoding": "gzip"})
    assert response.status_code == 400 and "gzip" in response.json()["error"]


def test_a_decompression_bomb_stops_at_the_body_limit(server):
    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = b"\0" * (1 << 20)
    bomb = b"".join(compressor.compress(block) for _ in range(300)) + compressor.flush()
    assert len(bomb) < 400_000  # ~300 kB that expands to 300 MB
    started = time.monotonic()
    response = post(server, bomb, **{"content-encoding": "gzip"})
    assert response.status_code == 413
    assert "once decompressed" in response.json()["error"] and str(LIMIT) in response.text
    assert time.monotonic() - started < 10
    assert doubled(post(server, body(1.0)), 1.0)  # and the server is alive


def test_accept_encoding_compresses_the_answer(server):
    # a large enough answer: 64 rows of 16 floats
    data = np.arange(64 * 16, dtype=np.float32)
    doc = {
        "inputs": [
            {
                "name": "INPUT0",
                "shape": [8, 16],
                "datatype": "FP32",
                "data": data[: 8 * 16].tolist(),
            }
        ]
    }
    with httpx.Client() as client:  # httpx decodes the answer it asked for
        response = client.post(
            f"{server.url}/v2/models/double_fp32/infer",
            content=json.dumps(doc).encode(),
            headers={"content-type": "application/json", "accept-encoding": "gzip"},
        )
    assert response.status_code == 200
    assert response.headers["content-encoding"] == "gzip"
    assert "accept-encoding" in response.headers["vary"].lower()
    got = np.array(response.json()["outputs"][0]["data"], dtype=np.float32)
    np.testing.assert_array_equal(got, 2 * data[: 8 * 16])
    refused = httpx.post(
        f"{server.url}/v2/models/double_fp32/infer",
        content=json.dumps(doc).encode(),
        headers={"content-type": "application/json", "accept-encoding": "gzip;q=0, br"},
    )
    assert "content-encoding" not in refused.headers and refused.status_code == 200


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_tritonclient_compression_both_ways(server, algorithm):
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    rows = np.arange(4 * 16, dtype=np.float32).reshape(4, 16)
    inp = httpclient.InferInput("INPUT0", list(rows.shape), "FP32")
    inp.set_data_from_numpy(rows, binary_data=True)
    out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
    result = client.infer(
        "double_fp32",
        [inp],
        outputs=[out],
        request_compression_algorithm=algorithm,
        response_compression_algorithm=algorithm,
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * rows)
    client.close()
