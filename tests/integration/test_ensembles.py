"""Ensembles against the real server: a 3-step DAG under 32 concurrent clients equals the
composition of its steps, a step failure fails only its request (naming the step), the steps
batch with their models' own traffic and count in their statistics, bad graphs fail to load
with the file, step, field and value, Triton's ``config.pbtxt`` form loads, and steps load on
demand."""

from __future__ import annotations

import asyncio
import random

import httpx
import numpy as np
import pytest

from tests.fixtures.ensemble_models import (
    expected,
    pipeline_repository,
    write_model,
    write_steps,
)
from tests.helpers import InProcessServer


def body(values: np.ndarray, name: str = "IN") -> dict:
    return {
        "inputs": [
            {
                "name": name,
                "datatype": "FP32",
                "shape": list(values.shape),
                "data": values.ravel().tolist(),
            }
        ]
    }


def outputs_of(answer: dict) -> dict[str, np.ndarray]:
    return {
        o["name"]: np.array(o["data"], dtype=np.float32).reshape(o["shape"])
        for o in answer["outputs"]
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = pipeline_repository(tmp_path_factory.mktemp("ensemble"))
    running = InProcessServer(root)
    yield running
    running.stop()


def test_32_concurrent_clients_get_the_composition_of_the_steps_and_failures_stay_their_own(
    server,
):
    rng = random.Random(7)
    plan = []
    for client in range(32):
        for turn in range(4):
            rows = rng.randint(1, 3)
            values = np.array(
                [[rng.uniform(-50, 50) for _ in range(4)] for _ in range(rows)], np.float32
            )
            bad = (client * 4 + turn) % 7 == 3
            if bad:
                values[rng.randrange(rows), rng.randrange(4)] = 5000.0
            plan.append((client, values, bad))

    async def client_run(client: int, http: httpx.AsyncClient) -> list[tuple]:
        results = []
        for owner, values, bad in plan:
            if owner != client:
                continue
            answer = await http.post("/v2/models/pipeline/infer", json=body(values))
            results.append((values, bad, answer.status_code, answer.json()))
        return results

    async def main() -> list[tuple]:
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as http:
            done = await asyncio.gather(*(client_run(c, http) for c in range(32)))
        return [item for per_client in done for item in per_client]

    results = asyncio.run(main())
    assert len(results) == 128
    failed = 0
    for values, bad, status, answer in results:
        if bad:
            failed += 1
            assert status == 500, answer
            assert "ensemble 'pipeline' ensemble.steps[2] (model 'double')" in answer["error"]
            assert "above 1000" in answer["error"]
            continue
        assert status == 200, answer
        got = outputs_of(answer)
        want = expected(values)
        assert set(got) == {"OUT", "DOUBLED"}
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6)
    assert 0 < failed < 128

    stats = httpx.get(f"{server.url}/v2/models/pipeline/stats").json()["model_stats"][0]
    assert stats["inference_stats"]["fail"]["count"] == failed
    steps = {s["model"]: s for s in stats["ensemble_steps"]}
    assert steps["add_one"]["success"]["count"] == 128
    assert steps["double"]["fail"]["count"] == failed
    assert steps["combine"]["success"]["count"] == 128 - failed
    # each step ran on its own model's scheduler: counted there, in batches of several requests
    own = httpx.get(f"{server.url}/v2/models/add_one/stats").json()["model_stats"][0]
    assert own["inference_count"] >= sum(len(v) for _, v, _ in plan)
    assert own["execution_count"] < 128


def test_requested_outputs_and_validation_against_the_ensembles_config(server):
    values = np.arange(8, dtype=np.float32).reshape(2, 4)
    answer = httpx.post(
        f"{server.url}/v2/models/pipeline/infer",
        json={**body(values), "outputs": [{"name": "OUT"}]},
    )
    assert answer.status_code == 200, answer.text
    got = outputs_of(answer.json())
    assert list(got) == ["OUT"]
    np.testing.assert_allclose(got["OUT"], expected(values)["OUT"])
    wrong = httpx.post(f"{server.url}/v2/models/pipeline/infer", json=body(values, "X"))
    assert wrong.status_code == 400
    assert "IN" in wrong.json()["error"]
    metadata = httpx.get(f"{server.url}/v2/models/pipeline").json()
    assert metadata["platform"] == "ensemble"


def test_tritonclient_grpc_runs_the_ensemble(server):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    client = grpcclient.InferenceServerClient(server.grpc_url)
    values = np.full((3, 4), 2.5, np.float32)
    tensor = grpcclient.InferInput("IN", [3, 4], "FP32")
    tensor.set_data_from_numpy(values)
    result = client.infer("pipeline", [tensor])
    np.testing.assert_allclose(result.as_numpy("OUT"), expected(values)["OUT"])
    np.testing.assert_allclose(result.as_numpy("DOUBLED"), expected(values)["DOUBLED"])
    stats = client.get_inference_statistics("pipeline", as_json=True)["model_stats"][0]
    assert int(stats["inference_count"]) >= 3
    config = client.get_model_config("pipeline", as_json=True)["config"]
    assert config["platform"] == "ensemble"


BAD = {
    "missing_step": ("nope", "{X: IN}", "{Y: OUT}", "FP32"),
    "wrong_input": ("add_one", "{WRONG: IN}", "{Y: OUT}", "FP32"),
    "wrong_datatype": ("add_one", "{X: IN}", "{Y: OUT}", "INT32"),
}


def bad_ensemble(step: str, input_map: str, output_map: str, datatype: str) -> str:
    return (
        "backend: ensemble\nmax_batch_size: 8\n"
        f"inputs: [{{name: IN, datatype: {datatype}, shape: [4]}}]\n"
        "outputs: [{name: OUT, datatype: FP32, shape: [4]}]\n"
        f"ensemble: {{steps: [{{model_name: {step}, input_map: {input_map}, "
        f"output_map: {output_map}}}]}}\n"
    )


def test_bad_graphs_fail_to_load_naming_file_step_field_and_value(tmp_path):
    write_steps(tmp_path)
    for name, parts in BAD.items():
        write_model(tmp_path, name, bad_ensemble(*parts), None)
    cycle = (
        "backend: ensemble\nmax_batch_size: 8\ninputs: [{name: IN, datatype: FP32, shape: [4]}]\n"
        "outputs: [{name: OUT, datatype: FP32, shape: [4]}]\n"
        "ensemble: {steps: [{model_name: add_one, input_map: {X: b}, output_map: {Y: a}},\n"
        "  {model_name: combine, input_map: {A: IN, B: a}, output_map: {Y: b}},\n"
        "  {model_name: double, input_map: {X: a}, output_map: {Y: OUT}}]}\n"
    )
    write_model(tmp_path, "cycle", cycle, None)
    running = InProcessServer(tmp_path)
    try:
        rows = httpx.post(f"{running.url}/v2/repository/index", json={}).json()
        reasons = {row["name"]: row.get("reason", "") for row in rows}
        states = {row["name"]: row.get("state", "") for row in rows}
        assert states["add_one"] == "READY"
        expect = {
            "missing_step": ["missing_step/config.yaml", "ensemble.steps[0].model_name", "'nope'"],
            "wrong_input": [
                "wrong_input/config.yaml",
                "ensemble.steps[0] (model 'add_one'): input_map.WRONG",
                "has no input 'WRONG'",
            ],
            "wrong_datatype": ["input_map.X", "ensemble input 'IN' is INT32, but FP32"],
            "cycle": ["cycle/config.yaml", "cycle", "ensemble.steps[0] (model 'add_one')"],
        }
        for name, parts in expect.items():
            assert states[name] != "READY", rows
            for part in parts:
                assert part in reasons[name], (name, reasons[name])
            answer = httpx.post(
                f"{running.url}/v2/models/{name}/infer", json=body(np.zeros((1, 4), np.float32))
            )
            assert answer.status_code in (400, 503), answer.text
    finally:
        running.stop()


PBTXT = """
name: "tri"
platform: "ensemble"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling {
  step [
    {
      model_name: "add_one"
      model_version: -1
      input_map { key: "X" value: "IN" }
      output_map { key: "Y" value: "a" }
    },
    {
      model_name: "double"
      model_version: 1
      input_map { key: "X" value: "a" }
      output_map { key: "Y" value: "OUT" }
    }
  ]
}
"""


def test_a_triton_config_pbtxt_ensemble_serves_and_its_steps_load_on_demand(tmp_path):
    write_steps(tmp_path)
    (tmp_path / "tri" / "1").mkdir(parents=True)
    (tmp_path / "tri" / "config.pbtxt").write_text(PBTXT)
    running = InProcessServer(tmp_path, load_on_demand=True)
    try:
        index = httpx.post(f"{running.url}/v2/repository/index", json={}).json()
        assert not [row for row in index if row.get("state") == "READY"]
        values = np.ones((2, 4), np.float32)
        answer = httpx.post(f"{running.url}/v2/models/tri/infer", json=body(values), timeout=60)
        assert answer.status_code == 200, answer.text
        np.testing.assert_allclose(outputs_of(answer.json())["OUT"], (values + 1) * 2)
        index = httpx.post(f"{running.url}/v2/repository/index", json={}).json()
        ready = {row["name"] for row in index if row.get("state") == "READY"}
        assert {"tri", "add_one", "double"} <= ready
        assert "combine" not in ready
    finally:
        running.stop()


def test_a_step_that_is_unloaded_fails_the_request_naming_it(tmp_path):
    pipeline_repository(tmp_path)
    running = InProcessServer(tmp_path, model_control_mode="explicit", load_model=["pipeline"])
    try:
        values = np.zeros((1, 4), np.float32)
        first = httpx.post(f"{running.url}/v2/models/pipeline/infer", json=body(values))
        assert first.status_code == 200, first.text  # its steps were loaded with it
        unloaded = httpx.post(f"{running.url}/v2/repository/models/double/unload", json={})
        assert unloaded.status_code == 200, unloaded.text
        answer = httpx.post(f"{running.url}/v2/models/pipeline/infer", json=body(values))
        assert answer.status_code == 503, answer.text
        assert "ensemble.steps[2] (model 'double')" in answer.json()["error"]
        ready = httpx.get(f"{running.url}/v2/models/pipeline/ready")
        assert ready.status_code != 200  # its readiness follows its steps
        loaded = httpx.post(f"{running.url}/v2/repository/models/double/load", json={})
        assert loaded.status_code == 200, loaded.text
        again = httpx.post(f"{running.url}/v2/models/pipeline/infer", json=body(values))
        assert again.status_code == 200, again.text
        assert httpx.get(f"{running.url}/v2/models/pipeline/ready").status_code == 200
    finally:
        running.stop()
