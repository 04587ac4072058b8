"""A user model that raises: the server log has the whole traceback (issue 19 item 3), the
answer only the one-line description (no trace, no paths)."""

from __future__ import annotations

import logging

import httpx

from tests.helpers import InProcessServer

MODEL_PY = """
from gpuserve import PythonModel


def helper_that_fails(batch):
    raise ValueError("row 0 is bad")


class Model(PythonModel):
    def forward(self, batch):
        return helper_that_fails(batch)
"""


def test_a_model_that_raises_logs_its_traceback_and_answers_without_it(tmp_path, caplog):
    model = tmp_path / "repo" / "raiser"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(MODEL_PY)
    (model / "config.yaml").write_text(
        "backend: python\nmax_batch_size: 4\ninstance_group: [{kind: cpu}]\n"
        "inputs: [{name: INPUT0, datatype: FP32, shape: [2]}]\n"
        "outputs: [{name: OUTPUT0, datatype: FP32, shape: [2]}]\n"
    )
    server = InProcessServer(tmp_path / "repo")
    try:
        body = {"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}
        with caplog.at_level(logging.ERROR, logger="gpuserve"):
            answer = httpx.post(f"{server.url}/v2/models/raiser/infer", json=body, timeout=30)
    finally:
        server.stop()
    assert answer.status_code == 500
    assert "row 0 is bad" in answer.text
    assert "Traceback" not in answer.text and "model.py" not in answer.text
    assert "Traceback (most recent call last)" in caplog.text
    assert "helper_that_fails" in caplog.text and "model.py" in caplog.text
