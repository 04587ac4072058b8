"""GPU checks of the execution engine (skipped without CUDA): CUDA graphs match eager, the
pipelined instance copies on a side stream, and a real out-of-memory batch is split."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from gpuserve.backends.base import LoadContext
from gpuserve.backends.torch_backend import TorchBackend
from gpuserve.config import ModelConfig
from gpuserve.engine.instance import Instance
from gpuserve.engine.request import InferenceRequest
from gpuserve.engine.runners.batching import ModelScheduler

pytestmark = pytest.mark.gpu

MLP = """
import torch


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                       torch.nn.Linear(256, 16))

    def forward(self, x):
        return self.net(x)
"""

HOG = '''
import torch


class Model(torch.nn.Module):
    """Allocates about MB_PER_ROW MiB of device memory per row, so big batches run out."""

    MB_PER_ROW = 4096

    def forward(self, x):
        rows = x.shape[0]
        scratch = torch.empty((rows, self.MB_PER_ROW, 256, 1024), dtype=torch.float32,
                              device=x.device)
        del scratch
        return x * 2
'''


def backend(tmp_path: Path, source: str, max_batch: int = 8, **config) -> TorchBackend:
    folder = tmp_path / "m" / "1"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(source)
    width = 64 if source is MLP else 16
    cfg = ModelConfig(
        name="m",
        backend="torch",
        max_batch_size=max_batch,
        inputs=[{"name": "x", "datatype": "FP32", "shape": [width]}],
        outputs=[{"name": "y", "datatype": "FP32", "shape": [16]}],
        **config,
    )
    b = TorchBackend()
    b.load(LoadContext(config=cfg, version_path=folder, version=1, device="cuda:0"))
    b.warmup()
    return b


def run(b: TorchBackend, x: np.ndarray) -> np.ndarray:
    return b.postprocess(b.forward(b.preprocess({"x": x})))["y"]


def test_cuda_graphs_match_eager_for_every_batch_size(tmp_path):
    eager = backend(tmp_path, MLP)
    graphed = backend(tmp_path, MLP, optimization={"cuda_graphs": True})
    assert graphed.graphs is not None and sorted(graphed.graphs.graphs) == [1, 2, 4, 8]
    rng = np.random.default_rng(0)
    for rows in (1, 3, 5, 8):
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        np.testing.assert_allclose(run(graphed, x), run(eager, x), atol=1e-5)


def test_fp16_keeps_fp32_outputs(tmp_path):
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    ref = run(backend(tmp_path, MLP), x)
    got = run(backend(tmp_path, MLP, precision="fp16"), x)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, ref, atol=2e-2, rtol=2e-2)


def test_real_out_of_memory_batch_is_split_and_server_recovers(tmp_path):
    total = torch.cuda.get_device_properties(0).total_memory
    mib_per_row = int(total / 2**20 / 6)  # 8 rows never fit, 2 rows do
    source = HOG.replace("MB_PER_ROW = 4096", f"MB_PER_ROW = {mib_per_row // 1024 or 1}")
    source = source.replace(
        "(rows, self.MB_PER_ROW, 256, 1024)", f"(rows, {mib_per_row}, 256, 1024)"
    )

    async def main() -> None:
        b = backend(tmp_path, source)
        config = b.config
        scheduler = ModelScheduler(config, "1")
        ctx = LoadContext(config=config, version_path=tmp_path, version=1, device="cuda:0")
        instance = Instance("m:1#0", b, ctx, scheduler.on_batch_done, pipeline_depth=3)
        instance._load = lambda: (instance._loaded.set(), True)[1]  # already loaded
        instance.start()
        scheduler.attach([instance], asyncio.get_running_loop())
        values = [float(i) for i in range(8)]
        results = await asyncio.gather(
            *(
                scheduler.infer(InferenceRequest("m", None, {"x": np.full((1, 16), v, np.float32)}))
                for v in values
            )
        )
        for v, result in zip(values, results, strict=True):
            np.testing.assert_array_equal(result.outputs["y"], np.full((1, 16), 2 * v))
        await scheduler.close()

    asyncio.run(main())
