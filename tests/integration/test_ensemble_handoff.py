"""The ensemble device hand-off against the real server: between two TorchScript steps on one
device the intermediate arrives at the second step's backend as a ``torch.Tensor`` (no host
round trip), results equal the composition of the steps, also under 16 concurrent clients
mixed with direct calls of the first step (which get numpy arrays); a torch -> python
ensemble still works and moves the intermediate to the host exactly once per request.

Runs on CPU (device ``cpu``); ``tests/gpu/test_ensemble_handoff_gpu.py`` runs the same
ensemble on ``cuda:0``."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from gpuserve.backends import tensors
from gpuserve.backends.torch_backend import TorchBackend
from tests.fixtures.handoff_models import (
    Recorder,
    body,
    handoff_repository,
    mixed_reference,
    output_of,
    pair_reference,
    scale_reference,
)
from tests.helpers import InProcessServer

pytestmark = pytest.mark.skipif(
    not TorchBackend.gives_tensors,
    reason="the torch backend does not give device tensors (TorchBackend.gives_tensors False)",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[InProcessServer]:
    running = InProcessServer(handoff_repository(tmp_path_factory.mktemp("handoff")))
    yield running
    running.stop()


def step_stats(server: InProcessServer, model: str) -> list[dict]:
    stats = httpx.get(f"{server.url}/v2/models/{model}/stats").json()["model_stats"][0]
    return stats["ensemble_steps"]


def test_the_intermediate_of_two_torch_steps_arrives_as_a_tensor(server):
    recorder = Recorder(server, "square")
    before = step_stats(server, "torch_pair")[1]["tensor_inputs"]
    try:
        for rows in (1, 3):
            values = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) - 5
            answer = httpx.post(f"{server.url}/v2/models/torch_pair/infer", json=body(values))
            assert answer.status_code == 200, answer.text
            np.testing.assert_allclose(output_of(answer.json()), pair_reference(values), rtol=1e-6)
    finally:
        recorder.close()
    assert recorder.seen == [("Tensor", "cpu"), ("Tensor", "cpu")]
    steps = step_stats(server, "torch_pair")
    assert steps[1]["tensor_inputs"] - before == 2
    assert steps[1]["host_copies"] == 0


def test_a_client_calling_the_torch_step_directly_still_gets_numpy(server):
    recorder = Recorder(server, "square")
    try:
        values = np.ones((2, 4), np.float32)
        answer = httpx.post(f"{server.url}/v2/models/square/infer", json=body(values, "INPUT__0"))
    finally:
        recorder.close()
    assert answer.status_code == 200, answer.text
    np.testing.assert_allclose(output_of(answer.json()), values * values)
    assert recorder.seen == [("ndarray", "cpu")]


def test_16_concurrent_clients_mixed_with_direct_calls_equal_the_reference(server):
    rng = random.Random(16)
    plans = [
        [
            np.array(
                [[rng.uniform(-9, 9) for _ in range(4)] for _ in range(rng.randint(1, 3))]
            ).astype(np.float32)
            for _ in range(6)
        ]
        for _ in range(16)
    ]

    async def client(index: int, http: httpx.AsyncClient) -> list[tuple[str, Any, Any]]:
        results = []
        for turn, values in enumerate(plans[index]):
            # every third call of odd clients goes to the first step itself: its batches then
            # mix client requests (numpy outputs) with ensemble steps (tensor outputs)
            direct = index % 2 == 1 and turn % 3 == 0
            if direct:
                answer = await http.post("/v2/models/scale/infer", json=body(values, "INPUT__0"))
                want = scale_reference(values)
            else:
                answer = await http.post("/v2/models/torch_pair/infer", json=body(values))
                want = pair_reference(values)
            results.append((answer.status_code, answer.json(), want))
        return results

    async def main() -> list[tuple[str, Any, Any]]:
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as http:
            done = await asyncio.gather(*(client(i, http) for i in range(16)))
        return [r for per_client in done for r in per_client]

    before = step_stats(server, "torch_pair")[1]["tensor_inputs"]
    recorder = Recorder(server, "square")
    try:
        results = asyncio.run(main())
    finally:
        recorder.close()
    assert len(results) == 96
    for status, answer, want in results:
        assert status == 200, answer
        np.testing.assert_allclose(output_of(answer), want, rtol=1e-5)
    ensemble_calls = sum(1 for i in range(16) for t in range(6) if not (i % 2 == 1 and t % 3 == 0))
    steps = step_stats(server, "torch_pair")
    assert steps[1]["tensor_inputs"] - before == ensemble_calls
    assert steps[1]["host_copies"] == 0
    # square's batches held several ensemble requests (its inputs torch.cat of tensors)
    assert len(recorder.seen) < ensemble_calls
    assert set(recorder.seen) == {("Tensor", "cpu")}


@pytest.fixture
def host_copies(monkeypatch) -> list[str]:
    """Counts the tensor -> numpy conversions (``tensors.to_host`` on a tensor)."""
    calls: list[str] = []
    original = tensors.to_host

    def counting(value: Any) -> np.ndarray:
        if isinstance(value, torch.Tensor):
            calls.append(str(value.device))
        return original(value)

    monkeypatch.setattr(tensors, "to_host", counting)
    return calls


def test_torch_then_python_works_and_converts_once_per_request(server, host_copies):
    recorder = Recorder(server, "shift")
    try:
        for rows in (1, 2, 3):
            values = np.full((rows, 4), rows, np.float32)
            answer = httpx.post(
                f"{server.url}/v2/models/torch_then_python/infer", json=body(values)
            )
            assert answer.status_code == 200, answer.text
            np.testing.assert_allclose(output_of(answer.json()), mixed_reference(values))
    finally:
        recorder.close()
    assert recorder.seen == [("ndarray", "cpu")] * 3  # the python step gets host data
    assert host_copies == ["cpu"] * 3  # once per request, in the torch step's postprocess


def test_torch_pair_converts_only_its_final_output(server, host_copies):
    for rows in (1, 2):
        values = np.full((rows, 4), 0.5, np.float32)
        answer = httpx.post(f"{server.url}/v2/models/torch_pair/infer", json=body(values))
        assert answer.status_code == 200, answer.text
        np.testing.assert_allclose(output_of(answer.json()), pair_reference(values))
    assert host_copies == ["cpu"] * 2  # the intermediate never left the tensor form
