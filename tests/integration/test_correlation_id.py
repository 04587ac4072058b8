"""``request.correlation_id()`` in Triton Python models: the client's sequence id.

Real tritonclient.http and tritonclient.grpc clients send ``sequence_id`` (an integer or a
string) to models of ``tests/fixtures/correlation`` (one ``echo_model.py`` for all) that echo
``correlation_id()`` with its type: ``corrid_echo`` (not a sequence model: Triton passes the
id through all the same), ``corrid_sequence`` (oldest strategy), ``corrid_direct`` (direct
strategy, filler rows) and ``corrid_stream`` (decoupled). Concurrent requests check that each
row of a batch gets its own request's id."""

from __future__ import annotations

import queue
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.helpers import InProcessServer

grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")

FIXTURE = Path(__file__).parents[1] / "fixtures" / "correlation"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # each model folder holds its config.pbtxt; all four run the same echo_model.py
    repository = tmp_path_factory.mktemp("correlation")
    shutil.copytree(FIXTURE, repository, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.py"))
    for folder in repository.iterdir():
        (folder / "1").mkdir()
        shutil.copy(FIXTURE / "echo_model.py", folder / "1" / "model.py")
    running = InProcessServer(repository)
    yield running
    running.stop()


def echoed(result) -> tuple[str, str, int]:
    """(id as text, its type name, OUT) of one response."""
    ident = result.as_numpy("ID").reshape(-1)[0]
    kind = result.as_numpy("KIND").reshape(-1)[0]
    return ident.decode(), kind.decode(), int(result.as_numpy("OUT").reshape(-1)[0])


def call(kind: str, server, model: str, value: int, **sequence):
    """One infer over ``kind`` ("http" or "grpc") with ``IN = [[value]]``."""
    module = httpclient if kind == "http" else grpcclient
    tensor = module.InferInput("IN", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    if kind == "http":
        client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    else:
        client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        return echoed(client.infer(model, [tensor], **sequence))
    finally:
        client.close()


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_a_model_that_is_not_a_sequence_model_sees_the_id(server, kind):
    assert call(kind, server, "corrid_echo", 1, sequence_id=42) == ("42", "int", 1)
    assert call(kind, server, "corrid_echo", 2, sequence_id="user-7") == ("user-7", "str", 2)
    assert call(kind, server, "corrid_echo", 3, sequence_id="7") == ("7", "str", 3)
    assert call(kind, server, "corrid_echo", 4) == ("0", "int", 4)  # no id: 0, as Triton


def test_each_row_of_a_batch_gets_its_own_requests_id(server):
    """48 concurrent requests (integer ids, string ids, none) batch together (up to 8 rows,
    20 ms delay); every answer carries its own request's id and value."""

    def one(i: int):
        kind = "http" if i % 2 else "grpc"
        if i % 3 == 0:
            sequence: dict = {"sequence_id": 1000 + i}
            expected = (str(1000 + i), "int", i)
        elif i % 3 == 1:
            sequence = {"sequence_id": f"s{i}"}
            expected = (f"s{i}", "str", i)
        else:
            sequence = {}
            expected = ("0", "int", i)
        return call(kind, server, "corrid_echo", i, **sequence), expected

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(48)))
    assert all(got == expected for got, expected in results), [
        (got, expected) for got, expected in results if got != expected
    ]
    stats = httpx.get(f"{server.url}/v2/models/corrid_echo/stats", timeout=10).json()
    batch_sizes = [b["batch_size"] for b in stats["model_stats"][0]["batch_stats"]]
    assert max(batch_sizes) > 1  # rows of several requests did share a batch


@pytest.mark.parametrize("model", ["corrid_sequence", "corrid_direct"])
@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_every_request_of_a_sequence_sees_its_sequence_id(server, kind, model):
    ids = [7001, "alpha", 7002, "beta"]

    def run(sequence_id):
        got = []
        for step in range(3):
            got.append(
                call(
                    kind,
                    server,
                    model,
                    step,
                    sequence_id=sequence_id,
                    sequence_start=step == 0,
                    sequence_end=step == 2,
                )
            )
        return got

    with ThreadPoolExecutor(len(ids)) as pool:
        answers = dict(zip(ids, pool.map(run, ids), strict=True))
    for sequence_id, got in answers.items():
        kind_name = type(sequence_id).__name__
        assert got == [(str(sequence_id), kind_name, step) for step in range(3)]


def test_a_decoupled_model_sees_the_id_over_a_grpc_stream(server):
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for value, sequence_id in ((1, 99), (2, "stream-x")):
            tensor = grpcclient.InferInput("IN", [1], "INT32")
            tensor.set_data_from_numpy(np.array([value], dtype=np.int32))
            client.async_stream_infer("corrid_stream", [tensor], sequence_id=sequence_id)
            result, error = results.get(timeout=30)
            assert error is None
            assert echoed(result) == (str(sequence_id), type(sequence_id).__name__, value)
    finally:
        client.stop_stream()
        client.close()


def test_a_decoupled_model_sees_the_id_over_http_generate(server):
    body = {"IN": 5, "parameters": {"sequence_id": "gen-1"}}
    r = httpx.post(f"{server.url}/v2/models/corrid_stream/generate", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert (r.json()["ID"], r.json()["KIND"], r.json()["OUT"]) == ("gen-1", "str", 5)
