"""``gpuserve models validate`` loads each model and tries one request of zeros; a server that
serves such a model logs its first mismatching answer with the reason.

The repositories are written here: a good python and torch model, and the mistakes a new
user makes that only running the code finds (a SyntaxError in ``model.py``, a constructor that
needs arguments, a ``forward`` returning ``OUT`` for a config that says ``OUTPUT0``, a
``warmup`` that raises).
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gpuserve.repository.scan import validate_repository
from tests.helpers import InProcessServer

pytestmark = pytest.mark.timeout(120)

CONFIG = """backend: {backend}
max_batch_size: 4
inputs:
  - {{name: INPUT0, datatype: FP32, shape: [-1]}}
{extra}outputs:
  - {{name: OUTPUT0, datatype: FP32, shape: [-1]}}
"""
MODELS = {
    "good_python": (
        "python",
        """
from gpuserve import PythonModel

class Model(PythonModel):
    def forward(self, batch):
        return {"OUTPUT0": batch["INPUT0"] + 1}
""",
    ),
    "good_torch": (
        "torch",
        """
import torch

class Model(torch.nn.Module):
    def forward(self, x):
        return x * 2
""",
    ),
    "syntax_error": (
        "python",
        """
from gpuserve import PythonModel

class Model(PythonModel)
    def forward(self, batch):
        return batch
""",
    ),
    "needs_arguments": (
        "torch",
        """
import torch

class Model(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.width = width

    def forward(self, x):
        return x
""",
    ),
    "wrong_output": (
        "python",
        """
from gpuserve import PythonModel

class Model(PythonModel):
    def forward(self, batch):
        return {"OUT": batch["INPUT0"] * 2}
""",
    ),
    "wrong_rows": (
        "python",
        """
from gpuserve import PythonModel

class Model(PythonModel):
    def forward(self, batch):
        return {"OUTPUT0": batch["INPUT0"][:0]}
""",
    ),
}


def write(root: Path, names: list[str]) -> Path:
    for name in names:
        backend, code = MODELS[name]
        (root / name / "1").mkdir(parents=True)
        # an optional input the request of zeros leaves out (python models take BYTES)
        extra = "  - {name: TAG, datatype: BYTES, shape: [1], optional: true}\n"
        config = CONFIG.format(backend=backend, extra=extra if backend == "python" else "")
        (root / name / "config.yaml").write_text(config)
        (root / name / "1" / "model.py").write_text(code.lstrip())
    return root


def test_validate_loads_each_model_and_checks_one_request_of_zeros(tmp_path):
    root = write(tmp_path / "models", list(MODELS))
    problems = validate_repository(root)
    by_model = {name: [p for p in problems if f"/{name}/1" in p] for name in MODELS}
    assert by_model["good_python"] == [] and by_model["good_torch"] == [], problems
    assert len(problems) == 4, problems
    (syntax,) = by_model["syntax_error"]
    assert "SyntaxError" in syntax and "model.py" in syntax
    (arguments,) = by_model["needs_arguments"]
    assert "width" in arguments, arguments
    (output,) = by_model["wrong_output"]
    assert "one request of zeros failed" in output
    assert "did not return output(s) ['OUTPUT0']" in output and "returned ['OUT']" in output
    (rows,) = by_model["wrong_rows"]
    assert "0 rows in output 'OUTPUT0' for a batch of 1 rows" in rows


def test_no_model_files_skips_the_trial_and_the_cli_exits_1_naming_the_model(tmp_path):
    root = write(tmp_path / "models", ["good_python", "wrong_output"])
    assert validate_repository(root, check_model_files=False) == []
    result = subprocess.run(
        [sys.executable, "-m", "gpuserve", "models", "validate", "--model-repository", str(root)],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "wrong_output/1: one request of zeros failed" in result.stdout
    assert "good_python" not in result.stdout
    assert "1 problem(s) in 2 model(s)" in result.stderr


def test_the_server_logs_the_first_mismatching_answer_with_its_reason(tmp_path, caplog):
    root = write(tmp_path / "models", ["wrong_output"])
    server = InProcessServer(root)
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}
    try:
        with caplog.at_level(logging.ERROR, logger="gpuserve.engine.instance"):
            for _ in range(3):
                answer = httpx.post(f"{server.url}/v2/models/wrong_output/infer", json=body)
                assert answer.status_code == 500
                assert "did not return output(s) ['OUTPUT0']" in answer.json()["error"]
    finally:
        server.stop()
    logged = [r.getMessage() for r in caplog.records if "declared outputs" in r.getMessage()]
    assert len(logged) == 1, logged  # once per instance, not once per request
    assert "wrong_output" in logged[0] and "returned ['OUT']" in logged[0]


def test_the_start_up_summary_counts_the_versions_that_failed_beside_those_ready(tmp_path, caplog):
    root = write(tmp_path / "models", ["good_python", "syntax_error"])
    (root / "bad_config" / "1").mkdir(parents=True)
    (root / "bad_config" / "config.yaml").write_text("backend: python\nmax_batch_sise: 4\n")
    with caplog.at_level(logging.INFO, logger="gpuserve.repository.manager"):
        server = InProcessServer(root)
        server.stop()
    (record,) = [r for r in caplog.records if "initial load done" in r.getMessage()]
    assert record.levelno == logging.WARNING  # something failed: not an INFO line
    assert record.getMessage() == (
        "initial load done: 1 version(s) ready: good_python:1; "
        "1 version(s) failed to load: syntax_error:1; 1 model(s) cannot be loaded: bad_config"
    )
