"""Sequence batching end to end: the real server on ``examples/sequence/model_repository``,
real clients (httpx, tritonclient HTTP and gRPC).

* 64 concurrent sequences of random lengths interleaved over the 2 instances of
  ``running_mean``: every answer equals the per-sequence reference, each sequence stays on one
  instance, and sequences share batches;
* the 400s (no sequence id; an id that is not live), a START that restarts a live sequence;
* idle sequences released after ``max_sequence_idle_us`` and counted in ``/metrics``;
* ``direct`` batches laid out by slot: ``slot_accumulator`` (a Triton Python model keeping a
  running sum per row position) under 12 concurrent sequences over its 4 slots, with the
  READY = 0 rows of idle slots it sees, and statistics that count only real requests;
* Triton's own sequence client examples, unchanged, when ``GPUSERVE_TRITON_EXAMPLES`` names
  the folder holding them (copied from github.com/triton-inference-server/client,
  ``src/python/examples``); skipped with a line saying so otherwise.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from prometheus_client import generate_latest
from tritonclient.utils import InferenceServerException

from tests.helpers import InProcessServer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sequence"
TRITON_EXAMPLES = (
    "simple_http_sequence_sync_infer_client.py",
    "simple_grpc_sequence_sync_infer_client.py",
    "simple_grpc_sequence_stream_infer_client.py",
    "simple_grpc_aio_sequence_stream_infer_client.py",
)
IDLE_US = 300_000

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The example repository, plus ``running_mean_idle``: running_mean with a short idle
    timeout (300 ms)."""
    repo = tmp_path_factory.mktemp("sequence") / "models"
    shutil.copytree(EXAMPLE / "model_repository", repo)
    idle = repo / "running_mean_idle"
    shutil.copytree(repo / "running_mean", idle)
    config = (idle / "config.yaml").read_text()
    (idle / "config.yaml").write_text(
        config.replace("max_sequence_idle_us: 10000000", f"max_sequence_idle_us: {IDLE_US}")
    )
    # The other models keep their sequences 120 s: a test machine under load may stall a
    # client for seconds between two requests of a sequence.
    for path in repo.glob("*/config.*"):
        if path.parent != idle:
            text = path.read_text().replace("_us: 10000000", "_us: 120000000")
            path.write_text(text.replace("microseconds: 5000000", "microseconds: 120000000"))
    running = InProcessServer(repo)
    yield running
    running.stop()


def body(value: float, **params) -> dict:
    return {
        "parameters": params,
        "inputs": [{"name": "VALUE", "datatype": "FP32", "shape": [1, 1], "data": [value]}],
    }


def scheduler(server: InProcessServer, model: str):
    return server.server.service.manager.version(model, None).runner


def test_64_interleaved_sequences_over_2_instances_match_their_references(server):
    sched = scheduler(server, "running_mean")
    assert len(sched.instances) == 2
    placed: dict[int, set[str]] = defaultdict(set)
    batch_rows: list[int] = []
    originals = {}
    for instance in sched.instances:  # record which instance ran which sequence's rows
        originals[instance] = instance.submit

        def submit(batch, instance=instance, submit=instance.submit):
            batch_rows.append(batch.rows)
            for item in batch.items:
                placed[item.request.parameters["sequence_id"]].add(instance.name)
            submit(batch)

        instance.submit = submit
    rng = random.Random(16)
    sequences = {
        1000 + n: [rng.uniform(-50, 50) for _ in range(rng.randint(1, 12))] for n in range(64)
    }

    async def run(
        client: httpx.AsyncClient, sid: int, values: list[float]
    ) -> list[tuple[float, int]]:
        got = []
        for index, value in enumerate(values):
            params = {
                "sequence_id": sid,
                "sequence_start": index == 0,
                "sequence_end": index == len(values) - 1,
            }
            response = await client.post(
                "/v2/models/running_mean/infer", json=body(value, **params)
            )
            assert response.status_code == 200, response.text
            outputs = {o["name"]: o["data"][0] for o in response.json()["outputs"]}
            got.append((outputs["MEAN"], outputs["COUNT"]))
        return got

    async def main() -> list[list[tuple[float, int]]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
            return await asyncio.gather(*(run(client, s, v) for s, v in sequences.items()))

    try:
        results = asyncio.run(main())
    finally:
        for instance, submit in originals.items():
            instance.submit = submit
    for (sid, values), got in zip(sequences.items(), results, strict=True):
        reference = np.cumsum(np.float32(values), dtype=np.float64) / np.arange(1, len(values) + 1)
        assert [count for _, count in got] == list(range(1, len(values) + 1)), sid
        assert np.allclose([mean for mean, _ in got], reference, rtol=1e-5, atol=1e-4), sid
    assert all(len(names) == 1 for names in placed.values()), placed  # one instance per life
    assert {name for names in placed.values() for name in names} == {
        i.name for i in sched.instances
    }
    assert max(batch_rows) > 1  # sequences ran together
    stats = sched.batcher.sequence_stats()
    assert stats.live == 0 and stats.ended >= 64


def test_requests_without_a_live_sequence_get_400_naming_the_id(server):
    url = f"{server.url}/v2/models/running_mean/infer"
    missing = httpx.post(url, json=body(1.0))
    assert missing.status_code == 400
    assert "needs parameter 'sequence_id'" in missing.json()["error"]
    unknown = httpx.post(url, json=body(1.0, sequence_id=424242))
    assert unknown.status_code == 400
    assert (
        "sequence id 424242" in unknown.json()["error"]
        and "sequence_start" in unknown.json()["error"]
    )
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        value = grpcclient.InferInput("VALUE", [1, 1], "FP32")
        value.set_data_from_numpy(np.ones((1, 1), np.float32))
        with pytest.raises(InferenceServerException) as caught:
            client.infer("running_mean", [value], sequence_id="no-such-sequence")
        assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "sequence id 'no-such-sequence'" in caught.value.message()
        with pytest.raises(InferenceServerException) as caught:
            client.infer("running_mean", [value])
        assert "sequence model" in caught.value.message()


def test_start_on_a_live_sequence_restarts_it_and_end_closes_it(server):
    url = f"{server.url}/v2/models/running_mean/infer"

    def mean(value: float, **params) -> float:
        response = httpx.post(url, json=body(value, sequence_id="restart-me", **params))
        assert response.status_code == 200, response.text
        return response.json()["outputs"][0]["data"][0]

    assert [mean(4.0, sequence_start=True), mean(8.0)] == [4.0, 6.0]
    assert [mean(1.0, sequence_start=True), mean(3.0, sequence_end=True)] == [1.0, 2.0]
    after = httpx.post(url, json=body(1.0, sequence_id="restart-me"))
    assert after.status_code == 400 and "ended" in after.json()["error"]


def test_idle_sequences_are_released_and_counted_in_metrics(server):
    url = f"{server.url}/v2/models/running_mean_idle/infer"
    for sid in ("idle-1", "idle-2"):
        response = httpx.post(url, json=body(1.0, sequence_id=sid, sequence_start=True))
        assert response.status_code == 200, response.text
    batcher = scheduler(server, "running_mean_idle").batcher
    deadline = time.monotonic() + 10
    while batcher.sequence_stats().released_idle < 2:  # the server's idle timer releases them
        assert time.monotonic() < deadline, batcher.sequence_stats()
        time.sleep(0.05)
    late = httpx.post(url, json=body(1.0, sequence_id="idle-1"))
    assert late.status_code == 400
    assert "sequence id 'idle-1'" in late.json()["error"] and "idle" in late.json()["error"]
    text = generate_latest(server.server.metrics.registry).decode()
    line = (
        'gpuserve_sequences_released_total{model="running_mean_idle",reason="idle",version="1"} 2.0'
    )
    assert line in text, [row for row in text.splitlines() if "sequences" in row]
    assert 'gpuserve_sequences_live{model="running_mean_idle",version="1"} 0.0' in text


def test_triton_python_model_with_implicit_state_over_grpc(server):
    with grpcclient.InferenceServerClient(server.grpc_url) as client:

        def send(sid: str, value: int, **flags) -> dict:
            tensor = grpcclient.InferInput("INPUT", [1, 1], "INT32")
            tensor.set_data_from_numpy(np.array([[value]], np.int32))
            result = client.infer("triton_running_sum", [tensor], sequence_id=sid, **flags)
            return {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}

        got: dict[str, list[int]] = {"x": [], "y": []}
        for step, (a, b) in enumerate([(1, 10), (2, 20), (3, 30)]):
            for sid, value in (("x", a), ("y", b)):
                outputs = send(sid, value, sequence_start=step == 0, sequence_end=step == 2)
                assert set(outputs) == {"OUTPUT"}  # the state stays in the server
                got[sid].append(int(outputs["OUTPUT"][0, 0]))
    assert got == {"x": [1, 3, 6], "y": [10, 30, 60]}


def test_example_client_prints_running_means(server):
    done = subprocess.run(
        [sys.executable, str(EXAMPLE / "client.py"), "--url", f"127.0.0.1:{server.port}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "102: 5 6 7" in done.stdout and "sensor-c: 100 50 50 50 45" in done.stdout


@pytest.mark.parametrize("dyna", [False, True], ids=["simple_sequence", "dyna"])
@pytest.mark.parametrize("script", TRITON_EXAMPLES)
def test_triton_sequence_client_examples_pass_unchanged(server, script, dyna):
    folder = os.environ.get("GPUSERVE_TRITON_EXAMPLES")
    if not folder:
        pytest.skip(
            "GPUSERVE_TRITON_EXAMPLES is not set: point it at a folder holding Triton's "
            f"{script} (triton-inference-server/client src/python/examples) to run it"
        )
    path = Path(folder) / script
    if not path.is_file():
        pytest.skip(f"{path} does not exist (GPUSERVE_TRITON_EXAMPLES={folder})")
    address = f"127.0.0.1:{server.port if 'http' in script else server.grpc_port}"
    command = [sys.executable, str(path), "-u", address] + (["-d"] if dyna else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "PASS" in done.stdout, done.stdout + done.stderr


def test_direct_batches_are_laid_out_by_slot_for_a_model_that_keeps_state_per_row(server):
    """``slot_accumulator`` (a Triton Python model, ``direct``, 4 slots on 1 instance) keeps a
    running sum per row position: 12 concurrent sequences over its 4 slots each get their own
    sums, always from the same row; an idle slot is a READY = 0 row the model sees."""
    import tritonclient.grpc.aio as aioclient

    model = "slot_accumulator"
    rng = random.Random(23)
    sequences = {
        500 + n: [rng.randint(-100, 100) for _ in range(rng.randint(1, 10))] for n in range(12)
    }
    pauses = {sid: [rng.uniform(0, 0.004) for _ in values] for sid, values in sequences.items()}

    def tensor(value: int) -> aioclient.InferInput:
        value_in = aioclient.InferInput("INPUT", [1, 1], "INT32")
        value_in.set_data_from_numpy(np.array([[value]], np.int32))
        return value_in

    async def run(client, sid: int, values: list[int]) -> list[tuple[int, int, int]]:
        got = []
        for index, value in enumerate(values):
            result = await client.infer(
                model,
                [tensor(value)],
                sequence_id=sid,
                sequence_start=index == 0,
                sequence_end=index == len(values) - 1,
            )
            got.append(
                tuple(int(result.as_numpy(n)[0, 0]) for n in ("OUTPUT", "SLOT", "IDLE_SLOTS"))
            )
            await asyncio.sleep(pauses.get(sid, [0.0] * len(values))[index])
        return got

    async def main():
        async with aioclient.InferenceServerClient(server.grpc_url) as client:
            together = await asyncio.gather(*(run(client, s, v) for s, v in sequences.items()))
            # Two sequences take slots 0 and 1 of the idle instance; then only the one in
            # slot 1 sends: its batch has row 0 as an idle (READY = 0) slot.
            first = await run(client, 1, [5])  # 1 request: START and END, slot 0 then free
            a = await client.infer(model, [tensor(7)], sequence_id=2, sequence_start=True)
            b = await client.infer(model, [tensor(3)], sequence_id=3, sequence_start=True)
            b2 = await client.infer(model, [tensor(4)], sequence_id=3, sequence_end=True)
            a2 = await client.infer(model, [tensor(1)], sequence_id=2, sequence_end=True)
            alone = [
                tuple(int(r.as_numpy(n)[0, 0]) for n in ("OUTPUT", "SLOT", "IDLE_SLOTS"))
                for r in (a, b, b2, a2)
            ]
            return together, first, alone

    together, first, alone = asyncio.run(main())
    for (sid, values), got in zip(sequences.items(), together, strict=True):
        assert [sums for sums, _, _ in got] == list(np.cumsum(values)), sid
        assert len({slot for _, slot, _ in got}) == 1, (sid, got)  # one row for its life
        assert all(0 <= slot < 4 and idle < 4 for _, slot, idle in got), got
    assert first == [(5, 0, 0)]
    # sequence 2 holds slot 0 and sequence 3 slot 1; 3 runs alone behind an idle row 0
    assert alone == [(7, 0, 0), (3, 1, 1), (7, 1, 1), (8, 0, 0)]
    total = sum(len(v) for v in sequences.values()) + 5
    stats = httpx.get(f"{server.url}/v2/models/{model}/stats").json()["model_stats"][0]
    assert stats["inference_count"] == total  # requests only: READY = 0 rows are no inference
    executed = sum(int(b["batch_size"]) * b["compute_infer"]["count"] for b in stats["batch_stats"])
    assert executed > total  # the executed batch sizes count the idle rows
    assert scheduler(server, model).batcher.sequence_stats().live == 0
