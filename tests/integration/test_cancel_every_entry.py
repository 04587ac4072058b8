"""A caller that goes away takes its queued rows out of the queue at once, whatever way it came.

For each entry (an HTTP client that closes its connection, a cancelled gRPC ``ModelInfer``, a
cancelled gRPC ``ModelStreamInfer`` stream, a BLS call whose caller's deadline passes), rows
are queued behind a request that holds the model's only instance; the caller goes away; the
test then checks, while the instance is still held, that the rows left the queue and were
counted ``cancelled`` in ``/metrics`` (so they were dropped when the caller left, not found
out later when their batch formed), and, once the instance is free, that they never ran.

BC-32 runs as the case gives it (a non-decoupled model with 2 instances, 8 requests on one
stream, the stream cancelled), with held requests instead of 1 s sleeps: the 6 queued never
run, the 2 running finish for nobody, and all 8 are counted cancelled, none a success.

The models record what they run as files in an events folder (``ran-<tag>``), and hold a row
marked ``1`` until the test creates ``release-<tag>`` (``started-<tag>`` says it holds).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import socket
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.helpers import InProcessServer, queue_state, wait_queue, wait_until

pytestmark = pytest.mark.timeout(60)

SLOW = "slow"  # one instance, dynamic batching
PAIR = "bc32"  # BC-32's model: two instances, no batching
CALLER = "caller"  # calls SLOW through context.infer with a deadline

#: The BLS caller's deadline, seconds (the callee's request is queued well within it).
CALL_TIMEOUT_S = 1.0

MODEL_CODE = """
import os
import time

from gpuserve.backends.python import PythonModel

EVENTS = {events!r}


def _touch(name):
    with open(os.path.join(EVENTS, name), "w"):
        pass


def _hold(name, deadline_s=30.0):
    path = os.path.join(EVENTS, name)
    end = time.monotonic() + deadline_s
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.002)


class Model(PythonModel):
    def forward(self, inputs):
        x = inputs["X"]
        for row in x.reshape(-1, 2):
            tag = int(row[0])
            _touch(f"ran-{{tag}}")
            if row[1] == 1:
                _touch(f"started-{{tag}}")
                _hold(f"release-{{tag}}")
        return {{"Y": x * 2}}
"""

CALLER_CODE = f"""
from gpuserve.backends.python import PythonModel


class Model(PythonModel):
    def forward(self, inputs):
        out = self.context.infer("{SLOW}", {{"X": inputs["X"]}}, timeout_s={CALL_TIMEOUT_S})
        return {{"Y": out["Y"]}}
"""

TENSORS = """\
backend: python
inputs: [{name: X, datatype: FP32, shape: [2]}]
outputs: [{name: Y, datatype: FP32, shape: [2]}]
"""

CONFIGS = {
    SLOW: TENSORS + "max_batch_size: 8\ndynamic_batching: {max_queue_delay_us: 0}\n"
    "instance_group: [{count: 1, kind: cpu}]\n",
    PAIR: TENSORS + "max_batch_size: 0\ninstance_group: [{count: 2, kind: cpu}]\n",
    CALLER: TENSORS + "max_batch_size: 8\ndynamic_batching: {max_queue_delay_us: 0}\n"
    "instance_group: [{count: 1, kind: cpu}]\n",
}

_tags = itertools.count(1)


class Served:
    """The server and its events folder."""

    def __init__(self, server: InProcessServer, events: Path) -> None:
        self.server = server
        self.events = events
        self.url = server.url

    def ran(self, tag: int) -> bool:
        return (self.events / f"ran-{tag}").exists()

    def started(self, tag: int) -> bool:
        return (self.events / f"started-{tag}").exists()

    def release(self, tag: int) -> None:
        (self.events / f"release-{tag}").touch()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    base = tmp_path_factory.mktemp("cancel_every_entry")
    events = base / "events"
    events.mkdir()
    for name, config in CONFIGS.items():
        (base / "repo" / name / "1").mkdir(parents=True)
        (base / "repo" / name / "config.yaml").write_text(config)
        code = CALLER_CODE if name == CALLER else MODEL_CODE.format(events=str(events))
        (base / "repo" / name / "1" / "model.py").write_text(textwrap.dedent(code).lstrip())
    server = InProcessServer(base / "repo")
    try:
        yield Served(server, events)
    finally:
        server.stop()


@pytest.fixture()
def pool() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    with concurrent.futures.ThreadPoolExecutor(4) as threads:
        yield threads


def row(tag: int, hold: bool = False) -> np.ndarray:
    return np.array([[tag, 1.0 if hold else 0.0]], dtype=np.float32)


def http_body(x: np.ndarray) -> dict:
    return {
        "inputs": [
            {"name": "X", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}
        ]
    }


def infer(served: Served, model: str, x: np.ndarray) -> httpx.Response:
    return httpx.post(f"{served.url}/v2/models/{model}/infer", json=http_body(x), timeout=30)


def grpc_inputs(x: np.ndarray) -> list[grpcclient.InferInput]:
    tensor = grpcclient.InferInput("X", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return [tensor]


def requests_total(served: Served, model: str, outcome: str, reason: str = "") -> float:
    """``gpuserve_requests_total`` of ``model`` version 1 for ``outcome`` / ``reason``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{served.url}/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith("gpuserve_requests_total")]
    wanted = {"model": model, "version": "1", "outcome": outcome, "reason": reason}
    total = 0.0
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            if sample.name == "gpuserve_requests_total" and sample.labels == wanted:
                total += sample.value
    return total


def cancelled(served: Served, model: str) -> float:
    return requests_total(served, model, "failure", "cancelled")


class Blocker:
    """A request holding ``model``'s instance until :meth:`release` (sent on a thread)."""

    def __init__(
        self, served: Served, model: str, pool: concurrent.futures.ThreadPoolExecutor
    ) -> None:
        self.served = served
        self.tag = next(_tags)
        self.answer = pool.submit(infer, served, model, row(self.tag, hold=True))
        wait_until(
            lambda: served.started(self.tag) or self.answer.done(),
            10,
            f"{model}: the blocking request holds the instance",
        )
        assert not self.answer.done(), self.answer.result().text

    def release(self) -> None:
        self.served.release(self.tag)


# -- the entries: each queues rows tagged ``tags`` behind the blocker and returns how its
# -- caller goes away (None: it goes by itself)


def queue_http_disconnect(served: Served, tags: list[int]) -> Callable[[], None] | None:
    """One raw connection per request, left waiting; the client then closes them."""
    sockets = []
    for tag in tags:
        payload = json.dumps(http_body(row(tag))).encode()
        sock = socket.create_connection(("127.0.0.1", served.server.port))
        sock.sendall(
            f"POST /v2/models/{SLOW}/infer HTTP/1.1\r\nHost: test\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        sockets.append(sock)
    wait_queue(served.url, SLOW, queued=len(tags))

    def close() -> None:
        for sock in sockets:
            sock.close()

    return close


def queue_grpc_unary(served: Served, tags: list[int]) -> Callable[[], None] | None:
    """One ``ModelInfer`` call per request (tritonclient's ``async_infer``); then cancelled."""
    client = grpcclient.InferenceServerClient(served.server.grpc_url)
    calls = [
        client.async_infer(SLOW, grpc_inputs(row(tag)), callback=lambda *_, **__: None)
        for tag in tags
    ]
    wait_queue(served.url, SLOW, queued=len(tags))

    def cancel() -> None:
        for call in calls:
            call.cancel()
        client.close()

    return cancel


def queue_grpc_stream(served: Served, tags: list[int]) -> Callable[[], None] | None:
    """Every request on one ``ModelStreamInfer`` stream; then the stream is cancelled."""
    client = grpcclient.InferenceServerClient(served.server.grpc_url)
    client.start_stream(callback=lambda *_, **__: None)
    for tag in tags:
        client.async_stream_infer(SLOW, grpc_inputs(row(tag)), request_id=str(tag))
    wait_queue(served.url, SLOW, queued=len(tags))

    def cancel() -> None:
        client.stop_stream(cancel_requests=True)
        client.close()

    return cancel


def queue_bls_deadline(served: Served, tags: list[int]) -> Callable[[], None] | None:
    """A model's call (``context.infer``) whose deadline passes while its request is queued
    (one call per caller request; the callers are answered with the timeout)."""
    pool = concurrent.futures.ThreadPoolExecutor(len(tags))
    answers = [pool.submit(infer, served, CALLER, row(tag)) for tag in tags]
    pool.shutdown(wait=False)
    # the deadline passes by itself; each caller gets its timeout error
    for answer in answers:
        response = answer.result(CALL_TIMEOUT_S + 20)
        assert response.status_code == 503, (response.status_code, response.text)
        assert "no answer within" in response.text, response.text
    return None


ENTRIES: dict[str, Callable[[Served, list[int]], Callable[[], None] | None]] = {
    "http_disconnect": queue_http_disconnect,
    "grpc_unary": queue_grpc_unary,
    "grpc_stream": queue_grpc_stream,
    "bls_deadline": queue_bls_deadline,
}


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_rows_of_a_caller_that_went_away_never_run_and_are_counted_cancelled(
    served: Served, entry: str, pool: concurrent.futures.ThreadPoolExecutor
):
    cancelled_before = cancelled(served, SLOW)
    success_before = requests_total(served, SLOW, "success")
    tags = [next(_tags) for _ in range(1 if entry == "bls_deadline" else 3)]
    blocker = Blocker(served, SLOW, pool)
    try:
        go_away = ENTRIES[entry](served, tags)
        if go_away is not None:
            go_away()
        # Counted while the blocker still holds the instance: the rows left the queue when
        # their caller went away, not when a batch would have formed.
        wait_until(
            lambda: cancelled(served, SLOW) >= cancelled_before + len(tags),
            10,
            f"{entry}: {len(tags)} requests counted cancelled while the instance is busy",
        )
        assert queue_state(served.url, SLOW).queued == 0
        assert not blocker.answer.done()
    finally:
        blocker.release()
    assert blocker.answer.result(30).status_code == 200
    # a row still queued would run before (or with) this one
    follow = next(_tags)
    assert infer(served, SLOW, row(follow)).status_code == 200
    assert [tag for tag in tags if served.ran(tag)] == [], f"{entry}: cancelled rows ran"
    assert served.ran(follow)
    assert cancelled(served, SLOW) == cancelled_before + len(tags)
    assert requests_total(served, SLOW, "success") == success_before + 2  # blocker, follow-up


def test_bc32_a_cancelled_stream_runs_none_of_its_queued_requests_and_counts_all_cancelled(
    served: Served,
):
    """8 requests on one stream to a non-decoupled model with 2 instances; the client cancels
    the stream while 2 run and 6 wait."""
    cancelled_before = cancelled(served, PAIR)
    success_before = requests_total(served, PAIR, "success")
    tags = [next(_tags) for _ in range(8)]
    client = grpcclient.InferenceServerClient(served.server.grpc_url)
    started: list[int] = []
    try:
        client.start_stream(callback=lambda *_, **__: None)
        for tag in tags:
            client.async_stream_infer(
                PAIR, grpc_inputs(row(tag, hold=True)[0]), request_id=str(tag)
            )
        wait_until(
            lambda: len([t for t in tags if served.started(t)]) == 2,
            10,
            "2 requests run, one per instance",
        )
        wait_queue(served.url, PAIR, queued=6)
        started = [t for t in tags if served.started(t)]
        client.stop_stream(cancel_requests=True)
        wait_until(
            lambda: cancelled(served, PAIR) >= cancelled_before + 6,
            10,
            "the 6 queued requests counted cancelled while the 2 others still run",
        )
        assert all(not served.ran(t) for t in tags if t not in started)
    finally:
        for tag in tags:
            served.release(tag)
        client.close()
    # the 2 that ran finish for nobody: counted cancelled too, never a success
    wait_until(
        lambda: cancelled(served, PAIR) >= cancelled_before + 8,
        10,
        "all 8 counted cancelled",
    )
    follow = next(_tags)
    assert infer(served, PAIR, row(follow)[0]).status_code == 200
    assert sorted(t for t in tags if served.ran(t)) == sorted(started)
    assert cancelled(served, PAIR) == cancelled_before + 8
    assert requests_total(served, PAIR, "success") == success_before + 1  # the follow-up
