"""Model lifecycle over real HTTP: a zero-downtime load / promote / rollback under a steady
stream of requests, a canary split, poll mode with a broken version, the repository API's
config override, and its access control."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.fixtures.lifecycle_support import (
    Traffic,
    add_version,
    infer_body,
    make_repository,
    version_of,
)
from tests.helpers import InProcessServer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture()
def explicit_server(tmp_path):
    repo = make_repository(tmp_path / "repo", "versioned", versions={"versioned": [1]})
    server = InProcessServer(repo, model_control_mode="explicit", load_model=["versioned"])
    server.repo = repo
    yield server
    server.stop()


def post(client: httpx.Client, path: str, body: dict | None = None, **kw) -> httpx.Response:
    return client.post(f"/v2/repository/models/versioned/{path}", json=body or {}, **kw)


def timed(call):
    started = time.monotonic()
    response = call()
    return started, time.monotonic(), response


def test_load_promote_rollback_under_traffic_fails_no_request(explicit_server):
    """Version 2 is loaded (as a canary at weight 0: loaded and warm, no traffic), promoted,
    then rolled back to 1, which unloads it; zero failed requests, and each response comes
    from the version that was serving when it was sent."""
    server = explicit_server
    with httpx.Client(base_url=server.url, timeout=60) as client, Traffic(server.url) as traffic:
        traffic.wait_for(100)
        add_version(server.repo, 2)
        load = timed(lambda: post(client, "canary", {"version": 2, "weight": 0.0}))
        assert load[2].status_code == 200, load[2].text
        assert load[2].json()["versions"][1] == {
            "name": "versioned",
            "version": "2",
            "state": "READY",
            "reason": "",
            "traffic": 0.0,
        }
        traffic.wait_for(100)
        promote = timed(lambda: post(client, "canary/promote"))
        assert promote[2].status_code == 200, promote[2].text
        traffic.wait_for(100)
        rollback = timed(lambda: post(client, "rollback"))
        assert rollback[2].status_code == 200, rollback[2].text
        assert rollback[2].json()["served_version"] == "1"
        traffic.wait_for(100)
    results = traffic.snapshot()
    assert {r.status for r in results} == {200}, [r.error for r in results if r.status != 200][:3]
    for r in results:
        if r.done_s < promote[0]:
            assert r.version == 1, r
        elif promote[1] < r.sent_s and r.done_s < rollback[0]:
            assert r.version == 2, r
        elif r.sent_s > rollback[1]:
            assert r.version == 1, r
        else:
            assert r.version in (1, 2)
    assert {r.version for r in results if promote[1] < r.sent_s < rollback[0]} == {2}
    index = httpx.post(f"{server.url}/v2/repository/index").json()
    (v2,) = [row for row in index if row["version"] == "2"]
    assert v2["state"] == "UNAVAILABLE" and "rolled back" in v2["reason"]


def test_canary_at_10_percent_takes_10_percent_of_2000_requests(explicit_server):
    server = explicit_server
    add_version(server.repo, 2)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        response = post(client, "canary", {"version": 2, "weight": 0.1})
        assert response.status_code == 200, response.text
        assert response.json()["canary"] == {"version": "2", "weight": 0.1}

    def send(ids):
        got = {}
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for rid in ids:
                response = client.post("/v2/models/versioned/infer", json=infer_body(rid))
                assert response.status_code == 200, response.text
                got[rid] = version_of(response)
        return got

    import concurrent.futures

    ids = [f"req-{i}" for i in range(2000)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        parts = list(pool.map(send, [ids[i::8] for i in range(8)]))
    versions = {rid: v for part in parts for rid, v in part.items()}
    share = sum(v == 2 for v in versions.values()) / len(versions)
    assert abs(share - 0.10) <= 0.03, share
    again = send(ids[:100])
    assert all(again[rid] == versions[rid] for rid in again)  # same id, same version
    with httpx.Client(base_url=server.url, timeout=60) as client:
        pinned = client.post("/v2/models/versioned/versions/1/infer", json=infer_body("x"))
        assert version_of(pinned) == 1
        assert post(client, "canary/abort").status_code == 200
        assert {
            version_of(client.post("/v2/models/versioned/infer", json=infer_body(f"q{i}")))
            for i in range(50)
        } == {1}


def test_poll_mode_broken_version_leaves_the_serving_one(tmp_path):
    repo = make_repository(tmp_path / "repo", "versioned")
    server = InProcessServer(repo, model_control_mode="poll", repository_poll_interval_s=0.1)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert version_of(client.post("/v2/models/versioned/infer", json=infer_body())) == 2
            add_version(repo, 3, truncated=True)
            deadline = time.monotonic() + 10
            while True:
                index = client.post("/v2/repository/index").json()
                rows = {row["version"]: row for row in index}
                if "3" in rows and "failed to load" in rows["3"]["reason"]:
                    break
                assert time.monotonic() < deadline, index
                time.sleep(0.05)
            assert rows["3"]["state"] == "UNAVAILABLE" and "weights" not in rows["2"]["reason"]
            assert rows["2"]["state"] == "READY" and rows["2"]["traffic"] == 1.0
            assert version_of(client.post("/v2/models/versioned/infer", json=infer_body())) == 2
            assert client.get("/v2/health/ready").status_code == 200
            ready = client.post("/v2/repository/index", json={"ready": True}).json()
            assert [row["version"] for row in ready] == ["2"]
            # no load or unload by API in poll mode; rollback still works
            assert post(client, "unload").status_code == 400  # Triton says 503; permanent here
            assert post(client, "rollback").json()["served_version"] == "1"
    finally:
        server.stop()


def test_load_with_a_config_override_and_errors(explicit_server):
    server = explicit_server
    config = {
        "backend": "python",
        "max_batch_size": 4,
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [16]}],
        "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [16]}],
    }
    with httpx.Client(base_url=server.url, timeout=60) as client:
        body = {"parameters": {"config": json.dumps(config)}}
        assert post(client, "load", body).status_code == 200
        assert client.get("/v2/models/versioned/config").json()["max_batch_size"] == 4
        bad = post(client, "load", {"parameters": {"config": "{not json"}})
        assert bad.status_code == 400 and "config" in bad.json()["error"]
        wrong = post(client, "load", {"parameters": {"config": json.dumps({"max_batch_size": -1})}})
        assert wrong.status_code == 400 and "max_batch_size" in wrong.json()["error"]
        assert client.get("/v2/models/versioned/config").json()["max_batch_size"] == 4
        assert post(client, "load").status_code == 200  # config.yaml again
        assert client.get("/v2/models/versioned/config").json()["max_batch_size"] == 8
        missing = client.post("/v2/repository/models/nope/load")
        assert missing.status_code == 404 and "nope" in missing.json()["error"]
        assert client.post("/v2/repository/models/versioned/bogus").status_code == 404
        canary = post(client, "canary", {"version": "x", "weight": 0.1})
        assert canary.status_code == 400 and "version" in canary.json()["error"]
        metadata = client.get("/v2/models/versioned").json()
        assert metadata["versions"] == ["1"]
        assert [(r["version"], r["state"]) for r in metadata["version_states"]] == [("1", "READY")]


def test_management_token_and_disabled_management(tmp_path):
    repo = make_repository(tmp_path / "repo", "versioned")
    server = InProcessServer(repo, model_control_mode="explicit", management_token="s3cret")
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            refused = post(client, "load")
            assert refused.status_code == 401 and "Bearer" in refused.json()["error"]
            assert refused.headers["www-authenticate"] == "Bearer"
            wrong = post(client, "load", headers={"authorization": "Bearer nope"})
            assert wrong.status_code == 401
            assert client.post("/v2/repository/index").status_code == 200
            ok = post(client, "load", headers={"authorization": "Bearer s3cret"})
            assert ok.status_code == 200 and ok.json()["served_version"] == "2"
    finally:
        server.stop()
    server = InProcessServer(repo, disable_management=True)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for action in ("load", "unload", "rollback", "canary", "canary/promote"):
                response = post(client, action)
                assert response.status_code == 403 and "disabled" in response.json()["error"]
            assert client.post("/v2/repository/index").status_code == 200
            assert post(client, "status").json()["served_version"] == "2"
    finally:
        server.stop()
