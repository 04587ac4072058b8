"""Failure cases BC-16, BC-17, BC-18 and BC-25 of shared/cases/README.md over real HTTP:
readiness that tells the truth through failed loads, slow loads and unloads; unload/load
cycles under traffic; and a shutdown that finishes admitted requests and refuses the rest."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import pytest

from tests.fixtures.lifecycle_support import Traffic, infer_body, make_repository
from tests.helpers import InProcessServer, wait_until

pytestmark = pytest.mark.timeout(120)


def status(client: httpx.Client, path: str) -> int:
    return client.get(path).status_code


def wait_in_flight(server, count: int, futures=(), timeout_s: float = 20.0) -> None:
    """Wait until ``count`` requests are admitted into the models' queues."""
    end = time.monotonic() + timeout_s
    while True:
        done = [f.result() for f in futures if f.done()]
        assert not done, f"requests answered before the stop: {done}"
        admitted = sum(
            mv.runner.in_flight_requests
            for model in list(server.manager.models.values())
            for mv in list(model.versions.values())
            if mv.runner is not None
        )
        if admitted >= count:
            return
        assert time.monotonic() < end, f"only {admitted} of {count} requests admitted"
        time.sleep(0.01)


def wait_answered(traffic: Traffic, code: int, count: int, timeout_s: float = 10.0) -> None:
    """Wait until ``traffic`` has recorded ``count`` more answers with status ``code``."""

    def answered() -> int:
        return sum(r.status == code for r in traffic.snapshot())

    target = answered() + count
    wait_until(lambda: answered() >= target, timeout_s, f"{count} more {code} answers")


def write_doubling_torchscript(path) -> None:
    import torch

    class Double(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    torch.jit.save(torch.jit.script(Double()), str(path))


# -- BC-16: a failed load does not take readiness down for good --------------------------------


def test_bc16_failed_model_is_reported_and_the_others_serve(tmp_path):
    repo = make_repository(tmp_path / "repo", "double_fp32", "broken_model")
    server = InProcessServer(repo)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            broken = client.get("/v2/models/broken_model/ready")
            assert broken.status_code == 503 and "failed to load" in broken.json()["reason"]
            assert status(client, "/v2/models/double_fp32/ready") == 200
            assert status(client, "/v2/health/ready") == 200  # rule: any READY version
            index = client.post("/v2/repository/index").json()
            (row,) = [r for r in index if r["name"] == "broken_model"]
            assert row["state"] == "UNAVAILABLE" and "failed to load" in row["reason"]
            infer = client.post("/v2/models/broken_model/infer", json=infer_body())
            assert infer.status_code == 503 and "failed to load" in infer.json()["error"]
            assert client.post("/v2/models/double_fp32/infer", json=infer_body()).status_code == 200
    finally:
        server.stop()


def test_bc16_explicit_load_failure_then_unload_fix_and_load(tmp_path):
    repo = make_repository(tmp_path / "repo", "double_fp32", "broken_model")
    server = InProcessServer(
        repo, model_control_mode="explicit", load_model=["double_fp32"], strict_readiness=True
    )
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            load = client.post("/v2/repository/models/broken_model/load")
            assert load.status_code == 400
            error = load.json()["error"]
            assert "broken_model" in error and "failed to load" in error
            ready = client.get("/v2/models/broken_model/ready")
            assert ready.status_code == 503 and "failed to load" in ready.json()["reason"]
            assert status(client, "/v2/models/double_fp32/ready") == 200
            # strict readiness: a model that never served is not required, so still ready
            assert status(client, "/v2/health/ready") == 200
            assert client.post("/v2/models/double_fp32/infer", json=infer_body()).status_code == 200
            assert client.post("/v2/repository/models/broken_model/unload").status_code == 200
            assert status(client, "/v2/health/ready") == 200
            write_doubling_torchscript(repo / "broken_model" / "1" / "model.pt")
            assert client.post("/v2/repository/models/broken_model/load").status_code == 200
            assert status(client, "/v2/models/broken_model/ready") == 200
            out = client.post("/v2/models/broken_model/infer", json=infer_body())
            assert out.status_code == 200 and out.json()["outputs"][0]["data"][1] == 2.0
    finally:
        server.stop()


def test_bc16_strict_readiness_recovers_when_the_failed_model_is_unloaded(tmp_path):
    repo = make_repository(tmp_path / "repo", "double_fp32", "broken_model")
    server = InProcessServer(
        repo, model_control_mode="explicit", load_model=["*"], strict_readiness=True
    )
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert status(client, "/v2/health/ready") == 503  # a required model failed
            assert client.post("/v2/repository/models/broken_model/unload").status_code == 200
            assert status(client, "/v2/health/ready") == 200  # no restart needed
    finally:
        server.stop()


# -- BC-17: readiness is never "all of an empty set", and does not flap during a load ----------


@pytest.mark.parametrize("models", [("broken_model",), ()])
def test_bc17_only_broken_or_empty_repository_is_not_ready(tmp_path, models):
    repo = make_repository(tmp_path / "repo", *models)
    server = InProcessServer(repo)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert status(client, "/v2/health/ready") == 503
            assert status(client, "/v2/health/live") == 200
    finally:
        server.stop()


def test_bc17_a_slow_explicit_load_does_not_disturb_what_serves(tmp_path):
    repo = make_repository(tmp_path / "repo", "double_fp32", "slow_load")
    server = InProcessServer(repo, model_control_mode="explicit", load_model=["double_fp32"])
    try:
        loaded = threading.Event()
        load_status = []

        def load():
            response = httpx.post(f"{server.url}/v2/repository/models/slow_load/load", timeout=30)
            load_status.append(response.status_code)
            loaded.set()

        thread = threading.Thread(target=load)
        samples = []
        with httpx.Client(base_url=server.url, timeout=30) as client:
            started = time.monotonic()
            thread.start()
            after = 0
            while after < 3 and time.monotonic() < started + 10:
                done_before = loaded.is_set()
                samples.append(
                    (
                        time.monotonic() - started,
                        status(client, "/v2/health/live"),
                        status(client, "/v2/health/ready"),
                        status(client, "/v2/models/double_fp32/ready"),
                        status(client, "/v2/models/slow_load/ready"),
                        client.post("/v2/models/double_fp32/infer", json=infer_body()).status_code,
                    )
                )
                after += done_before
                time.sleep(0.1)  # the sampling period of this watch, not a wait for a state
        thread.join()
        assert load_status == [200]
        assert all(s[1:4] == (200, 200, 200) and s[5] == 200 for s in samples), samples
        slow = [s[4] for s in samples]
        assert slow[-1] == 200 and set(slow) == {503, 200}, samples
        first_ready = slow.index(200)
        assert slow[first_ready:] == [200] * (len(slow) - first_ready)  # no flapping
        assert samples[first_ready][0] >= 1.9, samples  # not before the 2 s load is done
        assert len([s for s in samples if s[0] < 1.5]) >= 5  # it was watched during the load
    finally:
        server.stop()


# -- BC-18: unload/load cycles under traffic ---------------------------------------------------


def test_bc18_unload_load_cycles_under_traffic_answer_every_request_cleanly(tmp_path):
    repo = make_repository(tmp_path / "repo", "double_fp32")
    server = InProcessServer(repo, model_control_mode="explicit", load_model=["double_fp32"])
    path = "/v2/repository/models/double_fp32"
    try:
        with (
            httpx.Client(base_url=server.url, timeout=60) as client,
            Traffic(
                server.url, "/v2/models/double_fp32/infer", threads=16, rate=200, versioned=False
            ) as traffic,
        ):
            traffic.wait_for(50)
            for _ in range(5):
                wait_answered(traffic, 200, 40)  # the loaded version serves the traffic
                assert client.post(f"{path}/unload").status_code == 200
                assert status(client, "/v2/models/double_fp32/ready") == 503
                wait_answered(traffic, 503, 10)  # the traffic meets the unloaded model
                assert client.post(f"{path}/load").status_code == 200
                assert status(client, "/v2/models/double_fp32/ready") == 200
            traffic.wait_for(50)
            for first, second in (("unload", "load"), ("load", "unload")):
                with concurrent.futures.ThreadPoolExecutor(2) as pool:
                    a = pool.submit(client.post, f"{path}/{first}")
                    time.sleep(0.002)  # a stagger, not a wait: either order is accepted below
                    b = pool.submit(client.post, f"{path}/{second}")
                    assert a.result().status_code == 200 and b.result().status_code == 200
                index = client.post("/v2/repository/index").json()
                state = {r["version"]: r["state"] for r in index}["1"]
                ready = status(client, "/v2/models/double_fp32/ready")
                assert (state, ready) in (("READY", 200), ("UNAVAILABLE", 503)), (state, ready)
        results = traffic.snapshot()
        codes = {r.status for r in results}
        assert codes <= {200, 503}, [r.error for r in results if r.status not in (200, 503)][:3]
        # each loaded phase served (wait_answered above); how many of all answers were 200
        # depends on how long loads take on the machine, so no share is asserted
        assert sum(r.status == 200 for r in results) >= 50 + 5 * 40
        assert not [r for r in results if r.error == "wrong rows"]
        refused = [r.error for r in results if r.status == 503]
        assert all("double_fp32" in e and ("not ready" in e or "unload" in e) for e in refused)
    finally:
        server.stop()


# -- BC-25: shutdown finishes what was admitted and refuses the rest cleanly -------------------


def test_bc25_stop_finishes_admitted_requests_and_refuses_new_ones_with_503(tmp_path):
    repo = make_repository(tmp_path / "repo", "slow_fp32")
    server = InProcessServer(repo)
    url = f"{server.url}/v2/models/slow_fp32/infer"
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        admitted = [pool.submit(httpx.post, url, json=infer_body(), timeout=30) for _ in range(10)]
        wait_in_flight(server, 10, admitted)
        server.server.stop()  # what SIGTERM does
        wait_until(lambda: server.manager.shutting_down, what="the stop reached the server")
        checks = []
        with httpx.Client(base_url=server.url, timeout=10) as client:
            for look in range(6):
                if look:  # the next look after 0.2 s, or at once when all are answered
                    concurrent.futures.wait(admitted, timeout=0.2)
                if all(f.done() for f in admitted):
                    break
                try:
                    checks.append(
                        (
                            status(client, "/v2/health/live"),
                            status(client, "/v2/health/ready"),
                            client.post("/v2/models/slow_fp32/infer", json=infer_body()),
                        )
                    )
                except httpx.ConnectError:  # closed: only once the admitted ones are done
                    assert server.manager.shutting_down
                    assert all(f.result(timeout=5).status_code == 200 for f in admitted)
                    break
        answers = [f.result() for f in admitted]
    assert [a.status_code for a in answers] == [200] * 10
    assert checks, "the server stopped before the admitted requests finished"
    for live, ready, late in checks:
        assert (live, ready) == (200, 503)
        assert late.status_code == 503 and "shutting down" in late.json()["error"]
    server.thread.join(30)
    assert not server.thread.is_alive()


def test_bc25_an_exit_timeout_shorter_than_the_work_refuses_what_is_queued(tmp_path):
    repo = make_repository(tmp_path / "repo", "slow_fp32_1s")
    server = InProcessServer(repo, shutdown_timeout_s=0.3)
    url = f"{server.url}/v2/models/slow_fp32_1s/infer"

    def send():
        response = httpx.post(url, json=infer_body(), timeout=30)
        return response, time.monotonic()

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        sent = [pool.submit(send) for _ in range(12)]
        wait_in_flight(server, 12, sent)  # 1 s per batch of up to 8: about 2 s of work
        stopped = time.monotonic()
        server.server.stop()
        answers = [f.result() for f in sent]
    codes = sorted(r.status_code for r, _ in answers)
    assert set(codes) == {200, 503}, codes
    for response, at in answers:
        if response.status_code == 503:  # refused at the timeout, not after the work
            assert "slow_fp32_1s" in response.json()["error"]
            assert at - stopped < 1.0
    server.thread.join(30)
    assert not server.thread.is_alive()
