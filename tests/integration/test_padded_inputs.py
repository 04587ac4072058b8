"""Variable-length tensor inputs with ``pad_value``: requests of different lengths share a
batch (padded to the longest, grouped by length), and outputs with ``unpad`` come back cut to
each request's own length. A python model sums the real tokens of each row (it sees the
padding as 0s, as declared) and returns per-token values."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from tests.helpers import InProcessServer

pytestmark = pytest.mark.slow

CONFIG = """\
backend: python
max_batch_size: 16
inputs:
  - {name: IDS, datatype: INT64, shape: [-1], pad_value: 0}
outputs:
  - {name: PER_TOKEN, datatype: INT64, shape: [-1], unpad: IDS}
  - {name: TOTAL, datatype: INT64, shape: [1]}
  - {name: WIDTH, datatype: INT64, shape: [1]}
dynamic_batching: {max_queue_delay_us: 20000, max_batch_tokens: 4096}
instance_group: [{count: 1, kind: cpu}]
"""

MODEL = """\
import numpy as np
from gpuserve.backends.python import PythonModel

class Model(PythonModel):
    def forward(self, inputs):
        ids = inputs["IDS"]                      # [B, longest]: padded with 0
        width = np.full((ids.shape[0], 1), ids.shape[1], dtype=np.int64)
        return {"PER_TOKEN": ids * 10, "TOTAL": ids.sum(axis=1, keepdims=True), "WIDTH": width}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("padded-repo")
    folder = repository / "padded"
    (folder / "1").mkdir(parents=True)
    (folder / "config.yaml").write_text(CONFIG)
    (folder / "1" / "model.py").write_text(MODEL)
    running = InProcessServer(repository)
    yield running
    running.stop()


def _body(ids: list[int], rows: int = 1) -> dict:
    return {
        "inputs": [
            {"name": "IDS", "datatype": "INT64", "shape": [rows, len(ids)], "data": ids * rows}
        ]
    }


def test_requests_of_different_lengths_share_batches_and_get_their_own_rows(server):
    rng = np.random.default_rng(3)
    lengths = [int(n) for n in rng.integers(5, 40, size=32)]
    sequences = [[int(v) for v in rng.integers(1, 1000, size=n)] for n in lengths]

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(
                *(client.post("/v2/models/padded/infer", json=_body(s)) for s in sequences)
            )

    before = httpx.get(f"{server.url}/v2/models/padded/stats").json()["model_stats"][0]
    answers = asyncio.run(run())
    widths = []
    for ids, answer in zip(sequences, answers, strict=True):
        assert answer.status_code == 200, answer.text
        outputs = {o["name"]: o for o in answer.json()["outputs"]}
        assert outputs["PER_TOKEN"]["shape"] == [1, len(ids)]
        assert outputs["PER_TOKEN"]["data"] == [v * 10 for v in ids]
        assert outputs["TOTAL"]["data"] == [sum(ids)]
        widths.append(outputs["WIDTH"]["data"][0])
        assert widths[-1] >= len(ids)
    after = httpx.get(f"{server.url}/v2/models/padded/stats").json()["model_stats"][0]
    executions = after["execution_count"] - before["execution_count"]
    inferences = after["inference_count"] - before["inference_count"]
    assert inferences == 32
    assert executions < inferences  # different lengths were batched together (padded)
    assert any(w > n for w, n in zip(widths, lengths, strict=True))  # some rows were padded
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'gpuserve_batch_padding_ratio_count{model="padded",version="1"}' in metrics


def test_a_request_of_several_rows_is_padded_as_one(server):
    answer = httpx.post(f"{server.url}/v2/models/padded/infer", json=_body([1, 2, 3], rows=2))
    assert answer.status_code == 200, answer.text
    outputs = {o["name"]: o for o in answer.json()["outputs"]}
    assert outputs["PER_TOKEN"]["shape"] == [2, 3]
    assert outputs["TOTAL"]["data"] == [6, 6]
