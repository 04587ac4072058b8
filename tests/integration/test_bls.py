"""Business-logic scripting against the real server: a Python model calls another model of
the repository in-process, through gpuserve's ``context.infer`` and Triton's
``pb_utils.InferenceRequest(...).exec()`` / ``async_exec()``; the callee's errors reach the
client naming it, and a model calling itself, a slow callee and a cycle of two models fail
within their timeout instead of hanging their instances."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from tests.fixtures.ensemble_models import bls_repository
from tests.helpers import InProcessServer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = InProcessServer(bls_repository(tmp_path_factory.mktemp("bls")))
    yield running
    running.stop()


def infer(server: InProcessServer, model: str, values: np.ndarray) -> httpx.Response:
    body = {
        "inputs": [
            {
                "name": "X",
                "datatype": "FP32",
                "shape": list(values.shape),
                "data": values.ravel().tolist(),
            }
        ]
    }
    return httpx.post(f"{server.url}/v2/models/{model}/infer", json=body, timeout=60)


def output(answer: httpx.Response) -> np.ndarray:
    out = answer.json()["outputs"][0]
    return np.array(out["data"], dtype=np.float32).reshape(out["shape"])


@pytest.mark.parametrize("model", ["bls_add", "pb_add", "pb_async"])
def test_a_model_calls_another_and_gets_its_result(server, model):
    values = np.arange(8, dtype=np.float32).reshape(2, 4)
    answer = infer(server, model, values)
    assert answer.status_code == 200, answer.text
    np.testing.assert_allclose(output(answer), (values + 1) * 100)


def test_calls_under_concurrency_batch_with_the_callees_traffic(server):
    before = httpx.get(f"{server.url}/v2/models/add_one/stats").json()["model_stats"][0]
    rows = [np.full((1, 4), float(i), np.float32) for i in range(24)]
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda v: infer(server, "pb_add", v), rows))
    for values, answer in zip(rows, answers, strict=True):
        assert answer.status_code == 200, answer.text
        np.testing.assert_allclose(output(answer), (values + 1) * 100)
    after = httpx.get(f"{server.url}/v2/models/add_one/stats").json()["model_stats"][0]
    assert after["inference_count"] - before["inference_count"] == 24


@pytest.mark.parametrize("model", ["bls_missing", "pb_missing"])
def test_the_callees_error_reaches_the_client(server, model):
    answer = infer(server, model, np.zeros((1, 4), np.float32))
    assert answer.status_code >= 400
    assert "'nope'" in answer.json()["error"]


def test_a_model_calling_itself_is_refused_at_once(server):
    started = time.monotonic()
    answer = infer(server, "bls_self", np.zeros((1, 4), np.float32))
    assert time.monotonic() - started < 5
    assert answer.status_code >= 400
    assert "calls itself" in answer.json()["error"]


@pytest.mark.parametrize("model", ["bls_slow", "pb_slow"])
def test_a_call_past_its_timeout_fails_and_the_instance_keeps_serving(server, model):
    answer = infer(server, model, np.zeros((1, 4), np.float32))
    assert answer.status_code >= 400
    assert "no answer within" in answer.json()["error"]
    again = infer(server, "bls_add", np.zeros((1, 4), np.float32))
    assert again.status_code == 200, again.text


def test_a_cycle_of_two_models_fails_within_its_timeouts(server):
    started = time.monotonic()
    answer = infer(server, "cycle_a", np.zeros((1, 4), np.float32))
    assert time.monotonic() - started < 10
    assert answer.status_code >= 400
    error = answer.json()["error"]
    assert "no answer within 0.3 s" in error and "cycle" in error
    # neither instance is stuck: each answers its next request within its timeouts
    for model in ("cycle_b", "cycle_a"):
        started = time.monotonic()
        again = infer(server, model, np.zeros((1, 4), np.float32))
        assert time.monotonic() - started < 10
        assert "no answer within 0.3 s" in again.json()["error"]


def test_a_timed_out_cycle_stops_calling(tmp_path_factory):
    """The hop of a cycle left running when its caller timed out is refused its own call at
    once, so the two models go quiet: stopping the server does not wait out its drain
    timeout (30 s) behind calls that ping-pong forever."""
    running = InProcessServer(bls_repository(tmp_path_factory.mktemp("cycle")))
    try:
        answer = infer(running, "cycle_a", np.zeros((1, 4), np.float32))
        assert "no answer within 0.3 s" in answer.json()["error"]
    finally:
        started = time.monotonic()
        running.stop()
    assert time.monotonic() - started < 10
