"""The ensemble device hand-off on a GPU (skipped without CUDA): two TorchScript steps on
cuda:0 hand their intermediate on as a CUDA tensor (no host round trip), results equal the
composition under 16 concurrent clients, and the only device-to-host copy per request is
the ensemble's final output. The same checks on CPU: tests/integration/test_ensemble_handoff.py.
"""

from __future__ import annotations

import asyncio
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
)
from tests.helpers import InProcessServer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not TorchBackend.gives_tensors,
        reason="the torch backend does not give device tensors (TorchBackend.gives_tensors)",
    ),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[InProcessServer]:
    root = handoff_repository(tmp_path_factory.mktemp("handoff_gpu"), "KIND_GPU gpus: [ 0 ]")
    running = InProcessServer(root)
    yield running
    running.stop()


def test_the_intermediate_stays_a_cuda_tensor_and_only_the_output_is_copied(server, monkeypatch):
    copies: list[str] = []
    original = tensors.to_host

    def counting(value: Any) -> np.ndarray:
        if isinstance(value, torch.Tensor):
            copies.append(str(value.device))
        return original(value)

    monkeypatch.setattr(tensors, "to_host", counting)
    recorder = Recorder(server, "square")
    try:
        for rows in (1, 4):
            values = np.linspace(-3, 3, rows * 4, dtype=np.float32).reshape(rows, 4)
            answer = httpx.post(f"{server.url}/v2/models/torch_pair/infer", json=body(values))
            assert answer.status_code == 200, answer.text
            np.testing.assert_allclose(output_of(answer.json()), pair_reference(values), rtol=1e-5)
    finally:
        recorder.close()
    assert recorder.seen == [("Tensor", "cuda:0"), ("Tensor", "cuda:0")]
    assert copies == ["cuda:0", "cuda:0"]  # the final output of each request, nothing else


def test_16_concurrent_clients_on_the_gpu_equal_the_reference(server):
    rng = np.random.default_rng(16)
    plans = [[rng.uniform(-9, 9, (int(rng.integers(1, 4)), 4)).astype(np.float32) for _ in range(6)]
             for _ in range(16)]  # fmt: skip

    async def client(index: int, http: httpx.AsyncClient) -> list[tuple[int, dict, np.ndarray]]:
        out = []
        for turn, values in enumerate(plans[index]):
            model = "torch_then_python" if turn % 3 == 2 else "torch_pair"
            want = (
                mixed_reference(values) if model == "torch_then_python" else pair_reference(values)
            )
            answer = await http.post(f"/v2/models/{model}/infer", json=body(values))
            out.append((answer.status_code, answer.json(), want))
        return out

    async def main() -> list[tuple[int, dict, np.ndarray]]:
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as http:
            done = await asyncio.gather(*(client(i, http) for i in range(16)))
        return [r for per in done for r in per]

    results = asyncio.run(main())
    assert len(results) == 96
    for status, answer, want in results:
        assert status == 200, answer
        np.testing.assert_allclose(output_of(answer), want, rtol=1e-5)


DOUBLE = """
import torch


class Model(torch.nn.Module):
    def forward(self, x):
        return x * 2
"""


def test_a_kept_output_of_a_cuda_graph_is_not_overwritten_by_the_next_replay(tmp_path):
    from gpuserve.backends.base import LoadContext
    from gpuserve.config import ModelConfig

    folder = tmp_path / "m" / "1"
    folder.mkdir(parents=True)
    (folder / "model.py").write_text(DOUBLE)
    config = ModelConfig(
        name="m",
        backend="torch",
        max_batch_size=4,
        inputs=[{"name": "x", "datatype": "FP32", "shape": [4]}],
        outputs=[{"name": "y", "datatype": "FP32", "shape": [4]}],
        optimization={"cuda_graphs": True},
    )
    backend = TorchBackend()
    backend.load(LoadContext(config=config, version_path=folder, version=1, device="cuda:0"))
    backend.warmup()
    assert backend.graphs is not None
    first = backend.postprocess_tensors(
        backend.forward(backend.preprocess({"x": torch.ones(2, 4)}))
    )
    backend.postprocess_tensors(backend.forward(backend.preprocess({"x": torch.zeros(2, 4)})))
    assert first["y"].device.type == "cuda"
    assert first["y"].cpu().tolist() == [[2.0] * 4] * 2
