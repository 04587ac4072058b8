"""Decoupled models (``model_transaction_policy: {decoupled: true}``) served end to end.

Against the real server with real clients: tritonclient.grpc streams (``ModelStreamInfer``),
httpx for the generate extension's server-sent events, and Triton's own
``simple_grpc_custom_repeat.py`` run unchanged against ``repeat_int32`` (a Triton Python
backend model with its ``config.pbtxt``). The fixture models are in
``tests/fixtures/decoupled``: ``counter`` (gpuserve's generator API, instrumented: what it
produced, whether it was closed) and ``twice`` (not decoupled).
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest

from tests.helpers import InProcessServer, wait_until

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

REPOSITORY = Path(__file__).parents[1] / "fixtures" / "decoupled"
#: ``counter``'s max_buffered_responses (its config.yaml).
BUFFERED = 4


@pytest.fixture(scope="module")
def server():
    running = InProcessServer(REPOSITORY)
    yield running
    running.stop()


def model_of(server: InProcessServer, name: str):
    """The user's model object of ``name``'s first instance (its module holds the records)."""
    return server.manager.runner(name, None).instances[0].backend.model


class Records:
    """``counter``'s RECORDS across its instances (each instance imports model.py anew)."""

    def __init__(self, server: InProcessServer) -> None:
        self.tables = [
            type(instance.backend.model).generate.__globals__["RECORDS"]
            for instance in server.manager.runner("counter", None).instances
        ]

    def get(self, tag: int):
        return next((table[tag] for table in self.tables if tag in table), None)

    def __getitem__(self, tag: int):
        found = self.get(tag)
        if found is None:
            raise KeyError(tag)
        return found


def records(server: InProcessServer) -> Records:
    return Records(server)


def counter_inputs(count: int, **extra: int) -> list:
    inputs = []
    for name, value in {"COUNT": count, **extra}.items():
        tensor = grpcclient.InferInput(name, [1], "INT32")
        tensor.set_data_from_numpy(np.array([value], dtype=np.int32))
        inputs.append(tensor)
    return inputs


class Collector:
    """A tritonclient stream callback that keeps (result, error) pairs in arrival order."""

    def __init__(self, on_result=None) -> None:
        self.items: queue.Queue = queue.Queue()
        self.on_result = on_result

    def __call__(self, result, error) -> None:
        if self.on_result is not None:
            self.on_result(result, error)
        self.items.put((result, error))

    def take(self, timeout_s: float = 30.0):
        return self.items.get(timeout=timeout_s)


def is_final(result) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


# -- Triton's own client ---------------------------------------------------------------------


@pytest.mark.slow  # the example waits 1 s before each of its 10 responses
def test_triton_simple_grpc_custom_repeat_passes_unchanged(server):
    folder = os.environ.get("GPUSERVE_TRITON_EXAMPLES")
    if not folder:
        pytest.skip(
            "GPUSERVE_TRITON_EXAMPLES is not set: point it at a folder holding Triton's "
            "src/python/examples (github.com/triton-inference-server/client)"
        )
    script = Path(folder) / "simple_grpc_custom_repeat.py"
    if not script.is_file():
        pytest.skip(f"{script} not found (copy Triton's client examples there)")
    done = subprocess.run(
        [sys.executable, str(script), "-u", server.grpc_url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS: Decoupled API" in done.stdout
    assert "100 : 100" in done.stdout and "109 : 109" in done.stdout


def test_repeat_int32_interleaves_two_requests_on_one_instance(server):
    """WAIT shorter than the DELAYs: execute returns early and the model's own threads send."""
    collector = Collector()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=collector)
    try:
        for request_id, base in (("a", 0), ("b", 100)):
            tensors = {
                "IN": np.arange(base, base + 4, dtype=np.int32),
                "DELAY": np.full(4, 30, dtype=np.uint32),
                "WAIT": np.array([5], dtype=np.uint32),
            }
            inputs = []
            for name, array in tensors.items():
                tensor = grpcclient.InferInput(name, list(array.shape), str(array.dtype).upper())
                tensor.set_data_from_numpy(array)
                inputs.append(tensor)
            client.async_stream_infer(
                "repeat_int32", inputs, request_id=request_id, enable_empty_final_response=True
            )
        got: dict[str, list[int]] = {"a": [], "b": []}
        finals = set()
        while len(finals) < 2:
            result, error = collector.take()
            assert error is None, error
            request_id = result.get_response().id
            if is_final(result):
                assert result.get_response().outputs == []  # the empty final
                finals.add(request_id)
                continue
            assert result.as_numpy("IDX")[0] == len(got[request_id])
            got[request_id].append(int(result.as_numpy("OUT")[0]))
    finally:
        client.stop_stream()
        client.close()
    assert got == {"a": [0, 1, 2, 3], "b": [100, 101, 102, 103]}


# -- order, back-pressure, bounded memory ---------------------------------------------------


def test_a_stream_of_1000_responses_arrives_in_order_with_a_slow_reader(server):
    """The client reads one 16 KiB response per millisecond at most; the generator could
    produce them all at once. It stays a bounded number of responses ahead (the model's
    buffer, the call's response queue and the socket's windows), not 1,000."""
    produced_ahead: list[int] = []
    record_of = records(server)

    def slow_reader(result, error):
        record = record_of.get(1)
        if record is not None and result is not None and not is_final(result):
            produced_ahead.append(record.produced - (int(result.as_numpy("INDEX")[0]) + 1))
        time.sleep(0.001)  # the slow client (the scenario, not synchronisation)

    collector = Collector(slow_reader)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=collector)
    try:
        client.async_stream_infer(
            "counter",
            counter_inputs(1000, PAD=16384, TAG=1),
            request_id="long",
            enable_empty_final_response=True,
        )
        indices = []
        while True:
            result, error = collector.take()
            assert error is None, error
            assert result.get_response().id == "long"
            if is_final(result):
                break
            indices.append(int(result.as_numpy("INDEX")[0]))
            assert result.as_numpy("PAYLOAD").shape == (16384,)
    finally:
        client.stop_stream()
        client.close()
    assert indices == list(range(1000))
    assert record_of[1].finished
    # Unbounded, the model would run ~1000 ahead of a reader this slow. Bounded, the lag
    # levels off at what the transport holds (HTTP/2 windows and socket buffers: ~150-260
    # responses of 16 KiB here) plus the server's few.
    assert max(produced_ahead) < 400, produced_ahead[::50]

    runner = server.manager.runner("counter", None)
    assert 1 <= runner.peak_buffered <= BUFFERED


def test_the_final_response_is_marked_and_the_empty_final_only_on_request(server):
    collector = Collector()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=collector)
    try:
        client.async_stream_infer("counter", counter_inputs(2), request_id="plain")
        first, second = collector.take(), collector.take()
        assert [r.as_numpy("INDEX")[0] for r, _ in (first, second)] == [0, 1]
        assert [is_final(r) for r, _ in (first, second)] == [False, False]
        # no empty final without triton_enable_empty_final_response: the next is "twice"'s
        x = grpcclient.InferInput("X", [1, 1], "FP32")
        x.set_data_from_numpy(np.array([[3.0]], dtype=np.float32))
        client.async_stream_infer("twice", [x], request_id="twice")
        result, error = collector.take()
        assert error is None and result.get_response().id == "twice"
        assert result.as_numpy("Y").tolist() == [[6.0]] and is_final(result)
    finally:
        client.stop_stream()
        client.close()


# -- cancellation stops the model -----------------------------------------------------------


def test_cancelling_a_grpc_stream_stops_the_generator(server):
    collector = Collector()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=collector)
    try:
        client.async_stream_infer("counter", counter_inputs(-1, TAG=2), request_id="forever")
        for expected in range(5):
            result, error = collector.take()
            assert error is None and result.as_numpy("INDEX")[0] == expected
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    wait_until(lambda: records(server).get(2) is not None, 10.0, "the stream ran")
    record = records(server)[2]
    wait_until(lambda: record.closed, 10.0, "the generator closed")
    assert record.cancelled and not record.finished
    stopped_at = record.produced
    # closed and not finished: the endless generator stopped. Back-pressure bounded it
    # meanwhile: what the buffer and the transport's flow-control windows hold (tens to a
    # few hundred small responses, more on a loaded machine); unbounded, the generator's
    # loop would have made thousands in that time
    assert stopped_at < 5 + BUFFERED + 1024, stopped_at
    stats = httpx.get(f"{server.url}/v2/models/counter/stats", timeout=10).json()
    assert stats["model_stats"][0]["failure_reasons"].get("cancelled", 0) >= 1


def test_an_sse_client_that_goes_away_stops_the_generator(server):
    body = {"COUNT": -1, "TAG": 3}
    with (
        httpx.Client(base_url=server.url, timeout=30) as http,
        http.stream("POST", "/v2/models/counter/generate_stream", json=body) as r,
    ):
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(orjson.loads(line[6:]))
            if len(events) == 3:
                break
    assert [e["INDEX"] for e in events] == [0, 1, 2]
    record = records(server)[3]
    wait_until(lambda: record.closed, 10.0, "the generator closed after the client left")
    assert record.cancelled and not record.finished


def test_a_triton_model_sees_is_cancelled(server):
    events = type(model_of(server, "repeat_int32")).respond.__globals__["EVENTS"]
    collector = Collector()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=collector)
    try:
        tensors = {
            "IN": np.arange(200, dtype=np.int32),
            "DELAY": np.full(200, 20, dtype=np.uint32),
            "WAIT": np.array([0], dtype=np.uint32),
        }
        inputs = []
        for name, array in tensors.items():
            tensor = grpcclient.InferInput(name, list(array.shape), str(array.dtype).upper())
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        client.async_stream_infer("repeat_int32", inputs, request_id="to-cancel")
        for _ in range(2):
            _, error = collector.take()
            assert error is None
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    wait_until(lambda: ("to-cancel", "final") in events, 10.0, "the model stopped sending")
    assert ("to-cancel", "cancelled") in events
    sent = [what for rid, what in events if rid == "to-cancel" and what.startswith("sent")]
    assert len(sent) < 200


# -- errors end their own stream only -------------------------------------------------------


def test_a_failing_generator_ends_its_stream_with_an_error_and_others_carry_on(server):
    collector = Collector()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=collector)
    got: dict[str, list] = {"bad": [], "good": []}
    try:
        client.async_stream_infer("counter", counter_inputs(10, FAIL_AT=3, TAG=4), request_id="bad")
        client.async_stream_infer(
            "counter",
            counter_inputs(10, TAG=5),
            request_id="good",
            enable_empty_final_response=True,
        )
        while len(got["good"]) < 11 or len(got["bad"]) < 4:
            result, error = collector.take()
            if error is not None:
                got["bad"].append(str(error))
                continue
            request_id = result.get_response().id
            got[request_id].append("final" if is_final(result) else result.as_numpy("INDEX")[0])
    finally:
        client.stop_stream()
        client.close()
    assert got["bad"][:3] == [0, 1, 2]
    assert "asked to fail at response 3" in got["bad"][3]
    assert got["good"] == [*range(10), "final"]


def test_sse_error_after_the_first_event_is_a_last_error_event(server):
    r = httpx.post(
        f"{server.url}/v2/models/counter/generate_stream", json={"COUNT": 5, "FAIL_AT": 2}
    )
    assert r.status_code == 200
    events = [orjson.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data:")]
    assert [e.get("INDEX") for e in events[:2]] == [0, 1]
    assert "asked to fail at response 2" in events[2]["error"]
    assert len(events) == 3
    before = httpx.post(
        f"{server.url}/v2/models/counter/generate_stream", json={"COUNT": 5, "FAIL_AT": 0}
    )
    assert before.status_code == 500
    assert "asked to fail at response 0" in before.json()["error"]


# -- unary calls, the generate extension ----------------------------------------------------


def test_unary_infer_answers_a_decoupled_model_only_with_exactly_one_response(server):
    def infer(count: int) -> httpx.Response:
        body = {"inputs": [{"name": "COUNT", "shape": [1], "datatype": "INT32", "data": [count]}]}
        return httpx.post(f"{server.url}/v2/models/counter/infer", json=body, timeout=30)

    one = infer(1)
    assert one.status_code == 200 and one.json()["outputs"][0]["data"] == [0]
    for count in (0, 3):
        refused = infer(count)
        assert refused.status_code == 400
        assert "model_transaction_policy.decoupled" in refused.json()["error"]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        assert client.infer("counter", counter_inputs(1)).as_numpy("INDEX").tolist() == [0]
        with pytest.raises(InferenceServerException) as caught:
            client.infer("counter", counter_inputs(2))
        assert "decoupled" in caught.value.message()
        assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    finally:
        client.close()


def test_generate_and_generate_stream_on_a_model_that_is_not_decoupled(server):
    r = httpx.post(f"{server.url}/v2/models/twice/generate", json={"X": 2.5, "id": "g"})
    assert r.status_code == 200, r.text
    assert r.json() == {"model_name": "twice", "model_version": "1", "id": "g", "Y": 5.0}
    stream = httpx.post(f"{server.url}/v2/models/twice/versions/1/generate_stream", json={"X": 1})
    assert stream.status_code == 200
    assert stream.text == 'data: {"model_name":"twice","model_version":"1","Y":2.0}\n\n'
    bad = httpx.post(f"{server.url}/v2/models/twice/generate", json={"Z": 1})
    assert bad.status_code == 400 and "'X'" in bad.json()["error"]
    unknown = httpx.post(f"{server.url}/v2/models/nope/generate_stream", json={"X": 1})
    assert unknown.status_code == 404


def test_generate_on_a_decoupled_model(server):
    one = httpx.post(f"{server.url}/v2/models/counter/generate", json={"COUNT": 1})
    assert one.status_code == 200 and one.json()["INDEX"] == 0
    many = httpx.post(f"{server.url}/v2/models/counter/generate", json={"COUNT": 2})
    assert many.status_code == 400 and "generate_stream" in many.json()["error"]


def test_a_stream_counts_once_in_statistics_with_its_responses(server):
    def stats() -> dict:
        body = httpx.get(f"{server.url}/v2/models/counter/stats", timeout=10).json()
        return body["model_stats"][0]

    runner = server.manager.runner("counter", None)
    responses_before = runner.responses_total
    before = stats()
    r = httpx.post(f"{server.url}/v2/models/counter/generate_stream", json={"COUNT": 7})
    assert r.text.count("data:") == 7
    wait_until(lambda: stats()["inference_count"] == before["inference_count"] + 1)
    after = stats()
    assert after["inference_stats"]["success"]["count"] == (
        before["inference_stats"]["success"]["count"] + 1
    )
    assert after["execution_count"] == before["execution_count"] + 1
    assert runner.responses_total - responses_before == 8  # + final


def test_streams_beyond_the_instances_wait_and_all_finish(server):
    """counter has 2 instances; 6 concurrent streams of 50 responses all complete in order."""
    results: dict[int, list[int]] = {}

    def one(tag: int) -> None:
        r = httpx.post(
            f"{server.url}/v2/models/counter/generate_stream",
            json={"COUNT": 50, "TAG": 100 + tag},
            timeout=60,
        )
        results[tag] = [
            orjson.loads(line[6:])["INDEX"] for line in r.text.splitlines() if line[:5] == "data:"
        ]

    threads = [threading.Thread(target=one, args=(tag,)) for tag in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == {tag: list(range(50)) for tag in range(6)}


# -- unloading drains running streams -------------------------------------------------------


def test_unloading_a_model_lets_its_running_stream_finish():
    """The unload waits (up to its drain timeout) for a stream that is still running: it
    answers only after the stream's last response was read."""
    running = InProcessServer(REPOSITORY, enable_management=True, model_control_mode="explicit")
    try:
        loaded = httpx.post(f"{running.url}/v2/repository/models/counter/load", timeout=60)
        assert loaded.status_code == 200, loaded.text
        unloaded: list[tuple[httpx.Response, float]] = []
        body = {"COUNT": 300, "PAD": 65536, "TAG": 7}
        with (
            httpx.Client(base_url=running.url, timeout=60) as http,
            http.stream("POST", "/v2/models/counter/generate_stream", json=body) as r,
        ):
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            indices = [orjson.loads(next(lines)[6:])["INDEX"]]

            def unload() -> None:
                url = f"{running.url}/v2/repository/models/counter/unload"
                answer = httpx.post(url, timeout=60)
                unloaded.append((answer, time.monotonic()))

            worker = threading.Thread(target=unload)
            worker.start()
            # the version stops taking requests while the stream is blocked on its reader
            wait_until(
                lambda: httpx.get(f"{running.url}/v2/models/counter/ready").status_code != 200,
                30.0,
                "the unload began",
            )
            refused = httpx.post(
                f"{running.url}/v2/models/counter/generate_stream", json={"COUNT": 1}
            )
            assert refused.status_code in (404, 503)
            read_when_unloaded = None
            for line in lines:
                indices.append(orjson.loads(line[6:])["INDEX"])
                if unloaded and read_when_unloaded is None:
                    read_when_unloaded = len(indices)
                time.sleep(0.001)  # a slow reader (the scenario, not synchronisation)
        worker.join(60)
        assert indices == list(range(300))
        assert unloaded and unloaded[0][0].status_code == 200, unloaded
        # The unload answered once the server had sent the stream's end: only what the
        # socket holds (~100 responses of 64 KiB) was left to read, not nearly all of it.
        assert read_when_unloaded is None or read_when_unloaded > 150, read_when_unloaded
    finally:
        running.stop()


# -- long server-sent event streams and the keep-alive timeout ------------------------------


@pytest.fixture(scope="module")
def short_keep_alive():
    running = InProcessServer(REPOSITORY, http_keep_alive_timeout_s=1.0)
    yield running
    running.stop()


@pytest.mark.slow  # ~6 s of a slow reader
def test_a_stream_longer_than_the_keep_alive_timeout_is_not_cut(short_keep_alive):
    """400 responses of 64 KiB read at 10 ms each: ~4 s of a socket that is often full, four
    times the 1 s keep-alive timeout; every event arrives and the chunked body ends."""
    url = f"{short_keep_alive.url}/v2/models/counter/generate_stream"
    indices = []
    with httpx.stream("POST", url, json={"COUNT": 400, "PAD": 65536}, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                indices.append(orjson.loads(line[6:])["INDEX"])
                time.sleep(0.01)  # a slow reader (the scenario)
    assert indices == list(range(400))


def test_a_client_that_stops_reading_is_dropped_and_sees_a_cut_stream(short_keep_alive):
    url = f"{short_keep_alive.url}/v2/models/counter/generate_stream"
    body = {"COUNT": -1, "PAD": 65536, "TAG": 8}
    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream("POST", url, json=body, timeout=30) as r,
    ):
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        record = records(short_keep_alive)
        wait_until(lambda: record.get(8) is not None and record[8].closed, 10.0, "dropped")
        for _ in lines:  # what the socket still held, then the cut (no last chunk)
            pass
    assert record[8].cancelled and not record[8].finished


def test_a_decoupled_models_admission_step_runs_before_its_stream(server):
    url = f"{server.url}/v2/models/capped/generate_stream"
    capped = httpx.post(url, json={"COUNT": 10})
    assert capped.status_code == 200
    events = [orjson.loads(line[6:]) for line in capped.text.splitlines() if line[:5] == "data:"]
    assert [e["INDEX"] for e in events] == [0, 1, 2]
    refused = httpx.post(url, json={"COUNT": -1})
    assert refused.status_code == 400 and "'COUNT' must be >= 0" in refused.json()["error"]
    collector = Collector()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=collector)
    try:
        client.async_stream_infer("capped", counter_inputs(-2), request_id="neg")
        result, error = collector.take()
        assert result is None and "'COUNT' must be >= 0" in str(error)
    finally:
        client.stop_stream()
        client.close()
