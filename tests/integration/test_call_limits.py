"""One call's inputs, held to the same promises on every embeddings and retrieval route.

* **Input cap**: a call carrying more than the server's ``max_inputs_per_call`` (2,048 by
  default, OpenAI's limit) inputs is refused with 413 naming the cap and the count, in each
  API's error shape, and nothing of it is computed (the model sees no batch).
* **Interleaving**: a long call is queued a window of chunks at a time, so a 1-input call
  that arrives while it runs is answered before it, after at most a batch or two of its work.
  The model holds every batch until the test lets it through, so the order is decided by
  the batches run, not by timing.
* **A client that leaves**: the rest of its call is not computed.

One ``python`` model serves every kind (:mod:`tests.fixtures.gated_rows`), so each test is
the same on every route.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.fixtures import gated_rows
from tests.helpers import InProcessServer, queue_state, wait_queue, wait_until

Body = Callable[[str, list[str]], dict[str, Any]]

#: route -> (body of a call of ``rows`` texts, ``marker`` its query, error shape)
ROUTES: dict[str, tuple[Body, str]] = {
    "/v1/embeddings": (lambda m, rows: {"model": "rows", "input": rows}, "openai"),
    "/embed": (lambda m, rows: {"model": "rows", "inputs": rows}, "tei"),
    "/embed_sparse": (lambda m, rows: {"model": "rows", "inputs": rows}, "tei"),
    "/predict": (lambda m, rows: {"model": "rows", "inputs": rows}, "tei"),
    "/rerank": (lambda m, rows: {"model": "rows", "query": m, "texts": rows}, "tei"),
    "/v1/rerank": (lambda m, rows: {"model": "rows", "query": m, "documents": rows}, "cohere"),
    "/similarity": (
        lambda m, rows: {
            "model": "rows",
            "inputs": {"source_sentence": m, "sentences": rows[1:] or rows},
        },
        "tei",
    ),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("call_limits")
    gated_rows.write(root, "rows", gated=True)
    gated_rows.GATE.open()  # nothing runs in these tests unless it lets it
    running = InProcessServer(root)
    yield running
    gated_rows.GATE.open()
    running.stop()


def _message(shape: str, answer: httpx.Response) -> str:
    body = answer.json()
    if shape == "openai":
        return body["error"]["message"]
    if shape == "cohere":
        return body["message"]
    assert body["error_type"] == "Validation"
    return body["error"]


@pytest.mark.parametrize("route", list(ROUTES))
def test_past_the_cap_is_413_naming_cap_and_count_and_nothing_runs(server, route):
    gate = gated_rows.GATE
    gate.reset()
    gate.open()
    make, shape = ROUTES[route]
    answer = httpx.post(f"{server.url}{route}", json=make("A", ["A"] * 2049), timeout=30)
    assert answer.status_code == 413, answer.text
    message = _message(shape, answer)
    assert "2049" in message and "2048" in message and "max_inputs_per_call" in message
    assert gate.ran() == 0  # refused before anything was queued
    at_cap = httpx.post(f"{server.url}{route}", json=make("A", ["A"] * 8), timeout=30)
    assert at_cap.status_code == 200, at_cap.text  # the model serves the route


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_one_input_call_is_answered_before_a_long_call_on_the_same_model(server, route):
    gate = gated_rows.GATE
    gate.reset()
    make, _ = ROUTES[route]
    done: list[str] = []  # completion order
    answers: dict[str, httpx.Response] = {}

    def call(name: str, body: dict[str, Any]) -> None:
        answers[name] = httpx.post(f"{server.url}{route}", json=body, timeout=60)
        done.append(name)

    # 64 rows: 16 chunks of 4 (max_batch_size), each a batch the gate holds
    long_call = threading.Thread(target=call, args=("long", make("A", ["A"] * 64)))
    long_call.start()
    short_call = threading.Thread(target=call, args=("short", make("B", ["B"])))
    try:
        wait_until(lambda: gate.ran() >= 1, what="the long call's first batch runs")
        wait_queue(server.url, "rows", queued=1)  # its next chunk waits behind it
        short_call.start()
        wait_queue(server.url, "rows", queued=2)  # the one input is queued too
        for released in range(1, 5):  # a batch at a time, until the one input's has run
            gate.release()
            wait_until(lambda n=released: gate.ran() >= n + 1, what=f"batch {released + 1}")
            if any("B" in batch for batch in gate.batches):
                break
        ran = [i for i, batch in enumerate(gate.batches) if "B" in batch]
        assert ran and ran[0] <= 2, [batch[:1] for batch in gate.batches]
        gate.release()  # the one input's batch returns; the long call's next is held
        wait_until(lambda: "short" in done, what="the one-input call's answer")
        assert done == ["short"]  # answered while the long call still waits on the gate
    finally:
        gate.open()
        long_call.join(60)
        if short_call.ident is not None:
            short_call.join(60)
    assert done == ["short", "long"]
    assert answers["short"].status_code == 200, answers["short"].text
    assert answers["long"].status_code == 200, answers["long"].text
    assert max(len(batch) for batch in gate.batches) <= 4


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_call_whose_client_has_gone_stops_being_computed(server, route):
    gate = gated_rows.GATE
    gate.reset()
    make, _ = ROUTES[route]
    body = json.dumps(make("A", ["A"] * 64)).encode()
    client = socket.create_connection(("127.0.0.1", server.port))
    client.sendall(
        f"POST {route} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    try:
        wait_until(lambda: gate.ran() >= 1, what="the call's first batch runs")
    finally:
        client.close()
    connections = server.server.http.connections
    wait_until(lambda: all(c.closed for c in list(connections)), what="the server sees it")
    gate.open()
    wait_until(
        lambda: (lambda q: q.queued == 0 and q.executing == 0)(queue_state(server.url, "rows")),
        what="the model is idle",
    )
    assert gate.ran() <= 3, gate.ran()  # not the 16 batches of the whole call
