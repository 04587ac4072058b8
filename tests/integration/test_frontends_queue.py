"""The queue over HTTP and gRPC, each test once per protocol: a full queue refuses at once
with RESOURCE_EXHAUSTED (429) and retry-after; a client that gives up while its request waits
never has it run, and it is counted as cancelled; a request whose queue timeout passes is
refused with UNAVAILABLE (503) without running while a longer ``timeout`` parameter waits and
runs (BC-12); on shutdown, admitted calls finish while new ones get UNAVAILABLE "shutting down",
readiness turns false and liveness stays true.

Nothing here waits a fixed time: tests poll the queue gauges (``/metrics``) and statistics
with deadlines."""

from __future__ import annotations

import concurrent.futures
import re
import shutil
import threading
import time

import numpy as np
import pytest

from tests.conftest import FIXTURE_REPOSITORY
from tests.helpers import InProcessServer, held_rows, ran_rows, wait_queue, wait_until
from tests.integration.frontends import (
    FrontendError,
    Status,
    failure_reasons,
    open_frontend,
    tensor,
)

pytestmark = pytest.mark.timeout(120)

SMALL_QUEUE_CONFIG = """\
backend: python
max_batch_size: 1
inputs:
  - {name: INPUT0, datatype: FP32, shape: [16]}
outputs:
  - {name: OUTPUT0, datatype: FP32, shape: [16]}
dynamic_batching:
  max_queue_size: 1
parameters:
  delay_s: 0.4
"""
QUEUE_TIMEOUT_MODEL = "slow_fp32_queue_timeout"  # 1 s per row, max batch 1, 300 ms timeout
TAG = {"http": 7100.0, "grpc": 7200.0}  # the rows each protocol's tests send, told apart


def tagged(tag: float) -> list:
    """One FP32 [1, 16] input whose first element is ``tag`` (what the slow models log)."""
    return [tensor("INPUT0", np.array([[tag] + [0.0] * 15], np.float32))]


@pytest.fixture(scope="module")
def small_queue_repository(tmp_path_factory):
    repository = tmp_path_factory.mktemp("repository")
    model = repository / "small_queue"
    (model / "1").mkdir(parents=True)
    (model / "config.yaml").write_text(SMALL_QUEUE_CONFIG)
    shutil.copy(FIXTURE_REPOSITORY / "slow_fp32" / "1" / "model.py", model / "1" / "model.py")
    return repository


@pytest.fixture(scope="module")
def small_queue_server(small_queue_repository):
    running = InProcessServer(small_queue_repository, metrics_port=-1)
    yield running
    running.stop()


def test_queue_full_is_resource_exhausted_with_retry_after(small_queue_server, frontend_kind):
    frontend = open_frontend(frontend_kind, small_queue_server)
    url = small_queue_server.url
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            running = pool.submit(frontend.infer, "small_queue", tagged(1.0))
            wait_queue(url, "small_queue", executing=1)
            queued = pool.submit(frontend.infer, "small_queue", tagged(2.0))
            wait_queue(url, "small_queue", executing=1, queued=1)
            started = time.monotonic()
            with pytest.raises(FrontendError) as err:
                frontend.infer("small_queue", tagged(3.0))
            assert time.monotonic() - started < 0.3  # refused at once, not after a wait
            assert err.value.status == Status.RESOURCE_EXHAUSTED
            assert err.value.native in (429, "RESOURCE_EXHAUSTED")
            assert err.value.message == (
                "queue of model 'small_queue' is full (1 requests waiting); retry later"
            )
            assert err.value.retry_after_s is not None and err.value.retry_after_s >= 1
            assert running.result(10).outputs["OUTPUT0"][0, 0] == 2.0
            assert queued.result(10).outputs["OUTPUT0"][0, 0] == 4.0
    finally:
        frontend.close()


def test_a_request_whose_client_gave_up_in_the_queue_never_runs(server, frontend):
    """Over gRPC the deadline cancels the call; over HTTP the client closes the connection,
    seen when the request's batch forms (BC-11). Either way: counted as cancelled, never run.
    The batch ahead of it is held until then, so however slow the machine, the abandoned
    request is still queued when its cancellation arrives."""
    before = failure_reasons(server, "slow_fp32").get("cancelled", 0)
    first, late, after = (TAG[frontend.kind] + i for i in (1, 2, 3))

    def cancelled() -> bool:
        return failure_reasons(server, "slow_fp32").get("cancelled", 0) > before

    gate = threading.Event()
    held_rows(server, "slow_fp32")[first] = gate
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(frontend.infer, "slow_fp32", tagged(first))
            wait_queue(server.url, "slow_fp32", executing=1)  # held: the next one waits
            with pytest.raises(FrontendError) as err:
                frontend.infer("slow_fp32", tagged(late), client_timeout_s=0.2)
            assert err.value.status == Status.DEADLINE_EXCEEDED
            if frontend.kind == "grpc":  # the handler is cancelled while the batch is held
                wait_until(cancelled, 10.0, "the abandoned call counted as cancelled")
            gate.set()
            assert running.result(10).outputs["OUTPUT0"][0, 0] == 2 * first
    finally:
        gate.set()
        held_rows(server, "slow_fp32").pop(first, None)
    wait_until(cancelled, 10.0, "the abandoned request counted as cancelled")
    # a request sent now runs after anything queued before it: had the abandoned one been
    # kept, it would have run by the time this one is answered
    assert frontend.infer("slow_fp32", tagged(after)).outputs["OUTPUT0"][0, 0] == 2 * after
    ran = ran_rows(server, "slow_fp32")
    assert first in ran and after in ran and late not in ran
    assert failure_reasons(server, "slow_fp32").get("cancelled", 0) == before + 1


def test_bc12_expired_requests_never_run_and_a_longer_timeout_runs(server, frontend):
    before = failure_reasons(server, QUEUE_TIMEOUT_MODEL)
    a, b, c, d = (TAG[frontend.kind] + i for i in (11, 12, 13, 14))

    def timed(tag: float, **options):
        started = time.monotonic()
        try:
            outcome = frontend.infer(QUEUE_TIMEOUT_MODEL, tagged(tag), **options)
        except FrontendError as err:
            outcome = err
        return outcome, time.monotonic() - started

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        running = pool.submit(timed, a)  # runs about 1 s
        wait_queue(server.url, QUEUE_TIMEOUT_MODEL, executing=1)
        deadline = pool.submit(timed, b, client_timeout_s=0.2)  # the client's deadline
        expired = pool.submit(timed, c)  # the model's queue timeout: 300 ms
        longer = pool.submit(timed, d, parameters={"timeout": 2_000_000})  # 2 s, microseconds
        a_outcome, _ = running.result()
        b_outcome, _ = deadline.result()
        c_outcome, c_elapsed = expired.result()
        d_outcome, d_elapsed = longer.result()
    assert a_outcome.outputs["OUTPUT0"][0, 0] == 2 * a
    assert b_outcome.status == Status.DEADLINE_EXCEEDED
    assert c_outcome.status == Status.UNAVAILABLE and c_outcome.native in (503, "UNAVAILABLE")
    waited = re.fullmatch(
        rf"request timed out in the queue of model '{QUEUE_TIMEOUT_MODEL}' after (\d+) ms "
        r"without running",
        c_outcome.message,
    )
    assert waited, c_outcome.message
    assert 290 <= int(waited.group(1)) < 700, c_outcome.message
    assert 0.25 < c_elapsed < 0.9, c_elapsed  # refused at its timeout, not after A finished
    assert d_outcome.outputs["OUTPUT0"][0, 0] == 2 * d
    assert d_elapsed > 1.5  # it waited for A, then ran
    ran = ran_rows(server, QUEUE_TIMEOUT_MODEL)
    assert a in ran and d in ran and b not in ran and c not in ran
    after = failure_reasons(server, QUEUE_TIMEOUT_MODEL)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("cancelled", "timeout")}
    assert delta["timeout"] >= 1 and delta["cancelled"] + delta["timeout"] == 2, delta


def test_shutdown_finishes_admitted_calls_and_refuses_new_ones(
    small_queue_repository, frontend_kind
):
    running = InProcessServer(small_queue_repository, metrics_port=-1)
    frontend = open_frontend(frontend_kind, running)
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            first = pool.submit(frontend.infer, "small_queue", tagged(1.0))
            wait_queue(running.url, "small_queue", executing=1)
            second = pool.submit(frontend.infer, "small_queue", tagged(2.0))
            wait_queue(running.url, "small_queue", executing=1, queued=1)
            stopping = pool.submit(running.stop)  # what SIGTERM does
            wait_until(lambda: not frontend.server_ready(), 10.0, "readiness false on stop")
            with pytest.raises(FrontendError) as err:
                frontend.infer("small_queue", tagged(3.0))
            assert not second.done(), "the refusal came after the drain"
            assert frontend.server_live()
            assert err.value.status == Status.UNAVAILABLE
            assert err.value.message == "server is shutting down; retry on another replica"
            assert first.result(10).outputs["OUTPUT0"][0, 0] == 2.0
            assert second.result(10).outputs["OUTPUT0"][0, 0] == 4.0
            stopping.result(30)
        assert not running.thread.is_alive()
        with pytest.raises(FrontendError) as err:  # the listener is closed
            frontend.infer("small_queue", tagged(4.0), client_timeout_s=5)
        assert err.value.status == Status.UNAVAILABLE
    finally:
        frontend.close()
        running.stop()
