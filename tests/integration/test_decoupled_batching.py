"""Batches of decoupled requests: a Triton Python model with ``dynamic_batching`` gets several
requests in one ``execute(requests)``, each answered through its own response sender.

Against the real server with real clients (tritonclient.grpc streams, httpx server-sent
events) and ``tests/fixtures/decoupled_batch/batch_repeat`` (its ``config.pbtxt``; its model
records each call's request ids in ``CALLS``). Every request must get exactly its own
responses, in order, with its own id and final mark, while calls serve several requests; a
cancel stops only its request; an exception in ``execute`` fails every request of the call.
A blocking request first holds the one instance where a test needs requests to queue up and
share a call.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest

from tests.helpers import InProcessServer, wait_until

grpcclient = pytest.importorskip("tritonclient.grpc")

REPOSITORY = Path(__file__).parents[1] / "fixtures" / "decoupled_batch"
MODEL = "batch_repeat"


@pytest.fixture(scope="module")
def server():
    running = InProcessServer(REPOSITORY)
    yield running
    running.stop()


def module_state(server: InProcessServer, name: str) -> list:
    """The model's module-level list ``name`` (``CALLS`` or ``EVENTS``)."""
    model = server.manager.runner(MODEL, None).instances[0].backend.model
    return type(model).execute.__globals__[name]


def stats(server: InProcessServer) -> dict:
    return httpx.get(f"{server.url}/v2/models/{MODEL}/stats", timeout=10).json()["model_stats"][0]


def request_inputs(values: list[int], delay_ms: int) -> list:
    tensors = {
        "IN": np.array([values], dtype=np.int32),
        "DELAY": np.array([[delay_ms]], dtype=np.uint32),
    }
    inputs = []
    for name, array in tensors.items():
        tensor = grpcclient.InferInput(name, list(array.shape), str(array.dtype).upper())
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def is_final(result) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


class Stream:
    """One tritonclient gRPC stream carrying one request; keeps what came back, in order."""

    def __init__(self, server: InProcessServer) -> None:
        self.items: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.client.start_stream(callback=lambda result, error: self.items.put((result, error)))

    def send(self, request_id: str, values: list[int], delay_ms: int) -> None:
        self.client.async_stream_infer(
            MODEL,
            request_inputs(values, delay_ms),
            request_id=request_id,
            enable_empty_final_response=True,
        )

    def take(self, timeout_s: float = 60.0):
        return self.items.get(timeout=timeout_s)

    def collect(self) -> tuple[list[tuple[str, int, int]], str | None]:
        """(id, IDX, OUT) of every response until the final one; the error that ended the
        stream instead, if any."""
        got = []
        while True:
            result, error = self.take()
            if error is not None:
                return got, str(error)
            response = result.get_response()
            if is_final(result):
                assert response.outputs == []  # the empty final
                return got, None
            got.append(
                (response.id, int(result.as_numpy("IDX")[0, 0]), int(result.as_numpy("OUT")[0, 0]))
            )

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def block(server: InProcessServer, request_id: str, ms: int = 600) -> Stream:
    """Hold the model's one instance for about ``ms`` milliseconds (10 rounds); the request's
    first response has arrived when this returns."""
    stream = Stream(server)
    stream.send(request_id, list(range(10)), ms // 10)
    result, error = stream.take()
    assert error is None and result.get_response().id == request_id
    return stream


def calls_with(server: InProcessServer, ids: set[str]) -> list[list[str]]:
    return [call for call in module_state(server, "CALLS") if ids & set(call)]


def test_16_grpc_streams_and_4_sse_streams_get_their_own_responses_from_shared_calls(server):
    before = stats(server)
    results: dict[str, tuple[list, str | None]] = {}
    expected: dict[str, list[tuple[str, int, int]]] = {}

    def grpc_client(i: int) -> None:
        request_id = f"g{i}"
        values = [1000 * i + k for k in range(3 + i % 5)]
        expected[request_id] = [(request_id, k, v) for k, v in enumerate(values)]
        stream = Stream(server)
        try:
            stream.send(request_id, values, 5)
            results[request_id] = stream.collect()
        finally:
            stream.close()

    def sse_client(i: int) -> None:
        request_id = f"h{i}"
        values = [-(1000 * i + k) for k in range(2 + i)]
        expected[request_id] = [(request_id, k, v) for k, v in enumerate(values)]
        body = {"IN": values, "DELAY": 5, "id": request_id}
        answer = httpx.post(
            f"{server.url}/v2/models/{MODEL}/generate_stream", json=body, timeout=60
        )
        assert answer.status_code == 200, answer.text
        events = [
            orjson.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data:")
        ]
        got = [(e["id"], e["IDX"], e["OUT"]) for e in events if "error" not in e]
        errors = [e["error"] for e in events if "error" in e]
        results[request_id] = (got, errors[0] if errors else None)

    threads = [threading.Thread(target=grpc_client, args=(i,)) for i in range(16)]
    threads += [threading.Thread(target=sse_client, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert sorted(results) == sorted(expected)
    for request_id, (got, error) in results.items():
        assert error is None, (request_id, error)
        assert got == expected[request_id], request_id
    calls = calls_with(server, set(expected))
    assert sorted(rid for call in calls for rid in call) == sorted(expected)  # each ran once
    assert max(len(call) for call in calls) > 1, calls  # requests shared execute calls
    assert all(len(call) <= 8 for call in calls)  # max_batch_size (one row per request)
    assert len(calls) < 20

    def counted() -> bool:  # each execution once, each request once (the loop counts them)
        after = stats(server)
        executions = after["execution_count"] - before["execution_count"]
        return (
            executions == len(calls) and after["inference_count"] - before["inference_count"] == 20
        )

    wait_until(counted, 10.0, "the statistics counted the calls and the requests")
    after = stats(server)
    # response_stats stay per request: index 0 once for each of the 20 requests
    first = [s.get("response_stats", {}).get("0", {}) for s in (before, after)]
    counts = [entry.get("success", {}).get("count", 0) for entry in first]
    assert counts[1] - counts[0] == 20

    runner = server.manager.runner(MODEL, None)
    assert runner.core.batcher.max_batch_size == 8  # batches of streams, by the dynamic batcher
    assert 1 <= runner.peak_buffered <= 16  # each request's own bounded buffer (default 16)


def test_cancelling_one_request_of_a_call_stops_only_its_sender(server):
    events = module_state(server, "EVENTS")
    blocker = block(server, "c-block")
    streams = {f"c{i}": Stream(server) for i in range(4)}
    try:
        for request_id, stream in streams.items():
            stream.send(request_id, list(range(40)), 20)
        for stream in streams.values():  # each is streaming now (after the blocker's call)
            for _ in range(3):
                _, error = stream.take()
                assert error is None
        streams["c1"].close(cancel=True)
        rest = {rid: streams[rid].collect() for rid in ("c0", "c2", "c3")}
    finally:
        for request_id, stream in streams.items():
            if request_id != "c1":
                stream.close()
        blocker.collect()
        blocker.close()
    assert [sorted(call) for call in calls_with(server, set(streams))] == [sorted(streams)]
    for request_id, (got, error) in rest.items():
        assert error is None
        assert [idx for _, idx, _ in got] == list(range(3, 40))
        assert {rid for rid, _, _ in got} == {request_id}
    assert ("c1", "cancelled") in events and ("c1", "final") not in events
    assert all((rid, "final") in events for rid in rest)
    assert stats(server)["failure_reasons"].get("cancelled", 0) >= 1


def test_an_exception_in_execute_fails_every_request_of_that_call(server):
    blocker = block(server, "f-block")
    streams = {f"f{i}": Stream(server) for i in range(3)}
    try:
        streams["f0"].send("f0", [-999, 1, 2], 20)
        streams["f1"].send("f1", [10, 11, 12], 20)
        streams["f2"].send("f2", [20, 21, 22], 20)
        outcomes = {rid: stream.collect() for rid, stream in streams.items()}
        blocker_got, blocker_error = blocker.collect()
    finally:
        for stream in streams.values():
            stream.close()
        blocker.close()
    assert [sorted(call) for call in calls_with(server, set(streams))] == [sorted(streams)]
    for request_id, (got, error) in outcomes.items():
        assert len(got) == 1 and got[0][:2] == (request_id, 0)  # its first round, then:
        assert error is not None and "asked to fail the whole call" in error
    assert blocker_error is None and len(blocker_got) == 9  # another call: unaffected
    # the server goes on serving the model
    after = Stream(server)
    try:
        after.send("after", [7, 8], 1)
        assert after.collect() == ([("after", 0, 7), ("after", 1, 8)], None)
    finally:
        after.close()


def test_unary_generate_and_infer_get_the_one_response_of_a_batched_call(server):
    """Concurrent unary calls (HTTP ``/generate``) share calls too; each answers its own."""
    blocker = block(server, "u-block")
    try:
        bodies = [{"IN": [i], "DELAY": 1, "id": f"u{i}"} for i in range(4)]
        answers: dict[str, dict] = {}

        def generate(body: dict) -> None:
            url = f"{server.url}/v2/models/{MODEL}/generate"
            answers[body["id"]] = httpx.post(url, json=body, timeout=60).json()

        threads = [threading.Thread(target=generate, args=(body,)) for body in bodies]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        blocker.collect()
        blocker.close()
    assert answers == {
        f"u{i}": {"model_name": MODEL, "model_version": "1", "id": f"u{i}", "OUT": i, "IDX": 0}
        for i in range(4)
    }
    assert max(len(call) for call in calls_with(server, set(answers))) > 1
