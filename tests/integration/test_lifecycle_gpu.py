"""GPU memory comes back when a version unloads or is replaced (skipped without CUDA).

A 64 MiB torch model is loaded on ``cuda:0``, swapped for a second version, rolled back and
unloaded, three times over; after each unload the bytes PyTorch has allocated return to the
level before the first load, and its reserved (cached) memory is handed back to the driver.
"""

from __future__ import annotations

import asyncio
import textwrap

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

MODEL_PY = textwrap.dedent(
    """
    import torch


    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)])

        def forward(self, x):
            return self.layers(x)
    """
)
CONFIG = textwrap.dedent(
    """
    backend: torch
    max_batch_size: 8
    inputs:
      - {name: INPUT0, datatype: FP32, shape: [2048]}
    outputs:
      - {name: OUTPUT0, datatype: FP32, shape: [2048]}
    instance_group:
      - {count: 1, kind: gpu, gpus: [0]}
    """
)


def test_gpu_memory_returns_after_unload_and_swaps(tmp_path):
    import numpy as np
    import torch

    from gpuserve.engine.request import InferenceRequest
    from gpuserve.repository.manager import ModelManager

    model = tmp_path / "repo" / "big"
    for version in (1, 2):
        (model / str(version)).mkdir(parents=True)
        (model / str(version) / "model.py").write_text(MODEL_PY)
    (model / "config.yaml").write_text(CONFIG)
    mib = 1024 * 1024

    async def main():
        torch.cuda.init()
        baseline = torch.cuda.memory_allocated(0)
        reserved = torch.cuda.memory_reserved(0)
        manager = ModelManager(model.parent, control_mode="explicit")
        await manager.load_all()
        for _ in range(3):
            await manager.load("big")  # version 2
            loaded = torch.cuda.memory_allocated(0)
            assert loaded - baseline >= 60 * mib
            mv = manager.version("big", None)
            x = np.ones((4, 2048), np.float32)
            await mv.runner.infer(InferenceRequest("big", None, {"INPUT0": x}))
            await manager.rollback("big")  # version 1 loads, version 2 drains and unloads
            assert manager.version("big", None).version == 1
            assert torch.cuda.memory_allocated(0) - baseline < loaded - baseline + 8 * mib
            await manager.unload("big")
            assert torch.cuda.memory_allocated(0) - baseline < 2 * mib
            assert torch.cuda.memory_reserved(0) - reserved < 32 * mib  # cache handed back
        await manager.close()

    asyncio.run(main())
