"""Health, metadata, config, stats and infer over real HTTP against the fixture repository."""

from __future__ import annotations

import concurrent.futures

import numpy as np


def double_body(rows: int = 1, start: float = 0.0) -> dict:
    data = (np.arange(rows * 16, dtype=np.float32) + start).tolist()
    return {"inputs": [{"name": "INPUT0", "shape": [rows, 16], "datatype": "FP32", "data": data}]}


def test_health_and_server_metadata(client):
    assert client.get("/v2/health/live").status_code == 200
    ready = client.get("/v2/health/ready")
    assert ready.status_code == 200 and ready.json() == {"ready": True}
    meta = client.get("/v2").json()
    assert meta["name"] == "gpuserve" and "binary_tensor_data" in meta["extensions"]


def test_model_metadata_ready_and_config(client):
    meta = client.get("/v2/models/double_fp32").json()
    assert meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 16]}]
    assert client.get("/v2/models/double_fp32/versions/1").json()["name"] == "double_fp32"
    assert client.get("/v2/models/double_fp32/ready").status_code == 200
    assert client.get("/v2/models/double_fp32/versions/1/ready").status_code == 200
    config = client.get("/v2/models/double_fp32/config").json()
    assert config["max_batch_size"] == 8
    assert config["dynamic_batching"]["max_queue_delay_us"] == 50000


def test_infer_by_model_and_by_version_echoes_id(client):
    body = {**double_body(2, 1.0), "id": "req-42"}
    for path in ("/v2/models/double_fp32/infer", "/v2/models/double_fp32/versions/1/infer"):
        response = client.post(path, json=body)
        assert response.status_code == 200, response.text
        out = response.json()
        assert out["id"] == "req-42" and out["model_version"] == "1"
        (tensor,) = out["outputs"]
        assert tensor["shape"] == [2, 16]
        np.testing.assert_array_equal(tensor["data"], (np.arange(32) + 1.0) * 2)
        assert int(response.headers["x-queue-time-us"]) >= 0


def test_unknown_model_and_version_are_404(client):
    response = client.post("/v2/models/nope/infer", json=double_body())
    assert response.status_code == 404 and "nope" in response.json()["error"]
    response = client.post("/v2/models/double_fp32/versions/7/infer", json=double_body())
    assert response.status_code == 404 and "version" in response.json()["error"]
    assert client.get("/v2/models/nope").status_code == 404
    assert client.get("/v2/models/nope/ready").status_code == 404


def test_failed_model_is_reported_but_server_stays_ready(client):
    ready = client.get("/v2/models/broken_model/ready")
    assert ready.status_code == 503
    response = client.post("/v2/models/broken_model/infer", json=double_body())
    assert response.status_code == 503 and "not ready" in response.json()["error"]
    index = client.post("/v2/repository/index").json()
    broken = [row for row in index if row["name"] == "broken_model"]
    assert broken and broken[0]["state"] == "UNAVAILABLE" and broken[0]["reason"]
    assert client.get("/v2/health/ready").status_code == 200
    assert client.post("/v2/models/double_fp32/infer", json=double_body()).status_code == 200


def test_concurrent_requests_are_batched_and_each_caller_gets_its_rows(client, server):
    before = client.get("/v2/models/double_fp32/stats").json()["model_stats"][0]

    def call(i: int):
        rows = 1 + i % 3
        response = client.post("/v2/models/double_fp32/infer", json=double_body(rows, 1000.0 * i))
        return i, rows, response

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(call, range(32)))
    for i, rows, response in results:
        assert response.status_code == 200, response.text
        data = np.array(response.json()["outputs"][0]["data"])
        np.testing.assert_array_equal(data, (np.arange(rows * 16) + 1000.0 * i) * 2)
    after = client.get("/v2/models/double_fp32/stats").json()["model_stats"][0]
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == sum(rows for _, rows, _ in results)
    assert executions < 32, f"{executions} executions for 32 requests: nothing was batched"
    assert (
        after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"]
        == 32
    )


def test_torch_backend_module(client):
    body = {
        "inputs": [
            {"name": "x", "shape": [2, 4], "datatype": "FP32", "data": [1, 1, 1, 1, 0, 0, 0, 1]}
        ]
    }
    response = client.post("/v2/models/torch_linear/infer", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == [10.5, -0.5, 4.5, -0.5]
