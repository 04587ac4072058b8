"""Per-response statistics and metrics of decoupled models, end to end.

Triton's ``response_stats`` (statistics extension, HTTP JSON and gRPC ``ModelStatistics``)
read with tritonclient.http and tritonclient.grpc, which must agree, and gpuserve's
``gpuserve_responses_total`` / ``gpuserve_response_interval_seconds`` from ``/metrics``. The
models (``tests/fixtures/response_stats``): ``square_int32`` on Triton's Python API (after
Triton's own L0_response_statistics test model) and ``steps`` on gpuserve's generator API.
Statistics are cumulative, so every test compares before and after its streams.
"""

from __future__ import annotations

import queue
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import InProcessServer, wait_until

grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")

REPOSITORY = Path(__file__).parents[1] / "fixtures" / "response_stats"
FIELDS = ("compute_infer", "compute_output", "success", "fail", "empty_response", "cancel")


@pytest.fixture(scope="module")
def server():
    running = InProcessServer(REPOSITORY)
    yield running
    running.stop()


def _read_stats(server: InProcessServer, model: str) -> tuple[dict, dict]:
    """``response_stats`` of ``model`` over HTTP, and gRPC's normalised to the same form."""
    http = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        over_http = http.get_inference_statistics(model_name=model)["model_stats"][0]
        over_grpc = grpc.get_inference_statistics(model_name=model, as_json=True)["model_stats"][0]
    finally:
        http.close()
        grpc.close()
    from_grpc = {
        index: {
            name: {
                "count": int(entry.get(name, {}).get("count", 0)),
                "ns": int(entry.get(name, {}).get("ns", 0)),
            }
            for name in FIELDS
        }
        for index, entry in over_grpc.get("response_stats", {}).items()
    }
    from_http = {
        index: {name: entry[name] for name in FIELDS}
        for index, entry in over_http["response_stats"].items()
    }
    return from_http, from_grpc


def response_stats(server: InProcessServer, model: str) -> dict[str, dict[str, dict[str, int]]]:
    """``response_stats`` of ``model`` over HTTP, checked equal to gRPC's. The two reads are
    made one after the other, so a response counted between them (a cancel settles on the
    event loop after the client saw its stream end) may show in one only: read again until
    they agree (AssertionError with both after 10 s)."""
    reads: list[tuple[dict, dict]] = []

    def agree() -> bool:
        reads.append(_read_stats(server, model))
        return reads[-1][0] == reads[-1][1]

    try:
        wait_until(agree, 10.0, "HTTP and gRPC response_stats agree")
    except AssertionError:
        assert reads[-1][0] == reads[-1][1]  # shows the difference
        raise
    return reads[-1][0]


def counts_added(before: dict, after: dict) -> dict[int, dict[str, int]]:
    """Per response index, the count each field gained (indices that gained nothing left out)."""
    added: dict[int, dict[str, int]] = {}
    for index, entry in after.items():
        old = before.get(index, {})
        gained = {name: entry[name]["count"] - old.get(name, {}).get("count", 0) for name in FIELDS}
        if any(gained.values()):
            added[int(index)] = gained
    return added


def ns_added(before: dict, after: dict, index: int, name: str) -> int:
    old = before.get(str(index), {}).get(name, {}).get("ns", 0)
    return int(after[str(index)][name]["ns"]) - old


def expect(success=0, fail=0, empty=0, cancel=0) -> dict[str, int]:
    """The counts one response adds (Triton's rules: an empty final adds compute_infer only;
    a cancel adds nothing else)."""
    return {
        "compute_infer": success + fail + empty,
        "compute_output": success + fail,
        "success": success,
        "fail": fail,
        "empty_response": empty,
        "cancel": cancel,
    }


class Collector:
    def __init__(self) -> None:
        self.items: queue.Queue = queue.Queue()

    def __call__(self, result, error) -> None:
        self.items.put((result, error))

    def take(self, timeout_s: float = 30.0):
        return self.items.get(timeout=timeout_s)


def square_inputs(count: int, fail: int = 0, empty: int = 1, delay_ms: int = 0, wait_cancel=0):
    tensor = grpcclient.InferInput("IN", [5], "INT32")
    tensor.set_data_from_numpy(np.array([count, fail, empty, delay_ms, wait_cancel], np.int32))
    return [tensor]


def stream(server, model: str, inputs, expected: int, cancel_after: int | None = None) -> list:
    """Run one gRPC stream; wait for ``expected`` results (responses and errors), or cancel
    after ``cancel_after`` of them."""
    collector = Collector()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=collector)
    got = []
    try:
        client.async_stream_infer(model, inputs)
        for _ in range(expected if cancel_after is None else cancel_after):
            got.append(collector.take())
    finally:
        client.stop_stream(cancel_requests=cancel_after is not None)
        client.close()
    return got


def test_n_responses_then_an_empty_final_count_once_per_index(server):
    before = response_stats(server, "square_int32")
    got = stream(server, "square_int32", square_inputs(4, delay_ms=20), expected=4)
    assert all(error is None for _, error in got)
    wait_until(lambda: 4 in counts_added(before, response_stats(server, "square_int32")))
    after = response_stats(server, "square_int32")
    assert counts_added(before, after) == {
        0: expect(success=1),
        1: expect(success=1),
        2: expect(success=1),
        3: expect(success=1),
        4: expect(empty=1),
    }
    for index in range(4):  # each response waited 20 ms before its send
        assert 20e6 <= ns_added(before, after, index, "compute_infer") < 5e9
        assert ns_added(before, after, index, "success") >= ns_added(
            before, after, index, "compute_infer"
        )
    assert ns_added(before, after, 4, "empty_response") >= 20e6

    # A second request aggregates with the first; the final flag on its last response
    # means no empty final.
    again = stream(server, "square_int32", square_inputs(2, empty=0), expected=2)
    assert all(error is None for _, error in again)
    wait_until(lambda: counts_added(after, response_stats(server, "square_int32")).get(1))
    final = response_stats(server, "square_int32")
    assert counts_added(after, final) == {0: expect(success=1), 1: expect(success=1)}
    assert (
        final["0"]["success"]["count"] == before.get("0", {}).get("success", {}).get("count", 0) + 2
    )


def test_error_responses_and_an_empty_final_as_tritons_own_test(server):
    """Triton's L0_response_statistics case: 4 responses, the last 2 failing, then empty."""
    before = response_stats(server, "square_int32")
    got = stream(server, "square_int32", square_inputs(4, fail=2), expected=4)
    assert [error is None for _, error in got] == [True, True, False, False]
    assert "response 2 fails as asked" in str(got[2][1])
    wait_until(lambda: 4 in counts_added(before, response_stats(server, "square_int32")))
    assert counts_added(before, response_stats(server, "square_int32")) == {
        0: expect(success=1),
        1: expect(success=1),
        2: expect(fail=1),
        3: expect(fail=1),
        4: expect(empty=1),
    }


def test_a_generator_that_fails_mid_stream_counts_a_fail_at_that_index(server):
    before = response_stats(server, "steps")
    body = {"COUNT": 10, "FAIL_AT": 3}
    r = httpx.post(f"{server.url}/v2/models/steps/generate_stream", json=body, timeout=30)
    events = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert len(events) == 4 and "asked to fail at response 3" in events[3]
    wait_until(lambda: 3 in counts_added(before, response_stats(server, "steps")))
    assert counts_added(before, response_stats(server, "steps")) == {
        0: expect(success=1),
        1: expect(success=1),
        2: expect(success=1),
        3: expect(fail=1),
    }


def test_a_stream_cancelled_by_its_client_counts_one_cancel_where_it_stopped(server):
    events = type(
        server.manager.runner("square_int32", None).instances[0].backend.model
    ).execute.__globals__["EVENTS"]
    seen = len(events)
    before = response_stats(server, "square_int32")
    got = stream(
        server, "square_int32", square_inputs(2, delay_ms=10, wait_cancel=1), 2, cancel_after=2
    )
    assert all(error is None for _, error in got)
    wait_until(lambda: len(events) > seen, 30.0, "the model saw the cancel")
    assert events[seen] == ("cancelled", True)
    wait_until(lambda: 2 in counts_added(before, response_stats(server, "square_int32")))
    after = response_stats(server, "square_int32")
    assert counts_added(before, after) == {
        0: expect(success=1),
        1: expect(success=1),
        2: expect(cancel=1),
    }
    assert ns_added(before, after, 2, "cancel") >= 10e6  # its clean-up sleep


# -- metrics ---------------------------------------------------------------------------------


def scrape(server) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric(samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_metrics_count_responses_by_outcome(server):
    mv = {"model": "square_int32", "version": "1"}
    before = scrape(server)
    for outcome in ("success", "fail", "empty", "cancel"):  # present from load, at 0 or more
        assert ("gpuserve_responses_total", frozenset({**mv, "outcome": outcome}.items())) in before
    stream(server, "square_int32", square_inputs(3, fail=1), expected=3)  # 2 ok, 1 fail, empty
    stream(server, "square_int32", square_inputs(1, wait_cancel=1), 1, cancel_after=1)

    def added(outcome: str) -> float:
        return metric(scrape(server), "gpuserve_responses_total", **mv, outcome=outcome) - metric(
            before, "gpuserve_responses_total", **mv, outcome=outcome
        )

    wait_until(lambda: added("cancel") == 1, 30.0, "the cancel was counted")
    assert [added(o) for o in ("success", "fail", "empty", "cancel")] == [3, 1, 1, 1]
    after = scrape(server)
    count = "gpuserve_response_interval_seconds_count"
    assert metric(after, count, **mv) - metric(before, count, **mv) == 4  # success + fail
    inf = "gpuserve_response_interval_seconds_bucket"
    assert metric(after, inf, **mv, le="+Inf") == metric(after, count, **mv)
