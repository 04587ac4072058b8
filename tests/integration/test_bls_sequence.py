"""BLS calls into sequence models: ``pb_utils.InferenceRequest(..., correlation_id=...,
flags=...)`` routes a call like a client's ``sequence_id`` / ``sequence_start`` /
``sequence_end``.

Against the real server (``tests/fixtures/bls_sequence``): ``bls_seq`` (a Triton Python model)
calls ``seq_oldest`` or ``seq_direct`` (running sums in the server's implicit state, one per
sequence, echoing ``request.correlation_id()``) with the id and flags its client sends as
inputs. State must carry across the calls of one id, stay apart between ids (integer and
string), restart at START, and a call for an id that was never started must fail naming it.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.helpers import InProcessServer

FIXTURE = Path(__file__).parents[1] / "fixtures" / "bls_sequence"
START, END = 1, 2  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_START / _END
TARGETS = ["seq_oldest", "seq_direct"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("bls_sequence")
    shutil.copytree(FIXTURE, repository, dirs_exist_ok=True)
    for target in TARGETS:
        (repository / target / "1").mkdir()
        shutil.copy(FIXTURE / "sequence_model.py", repository / target / "1" / "model.py")
    (repository / "sequence_model.py").unlink()
    running = InProcessServer(repository)
    yield running
    running.stop()


def call(server: InProcessServer, target: str, corrid: str, value: int, flags: int = 0):
    body = {
        "inputs": [
            {"name": "VALUE", "datatype": "INT32", "shape": [1], "data": [value]},
            {"name": "CORRID", "datatype": "BYTES", "shape": [1], "data": [corrid]},
            {"name": "FLAGS", "datatype": "INT32", "shape": [1], "data": [flags]},
            {"name": "TARGET", "datatype": "BYTES", "shape": [1], "data": [target]},
        ]
    }
    return httpx.post(f"{server.url}/v2/models/bls_seq/infer", json=body, timeout=60)


def answer(response: httpx.Response) -> tuple[int, str]:
    """(OUTPUT, ID) of a successful call."""
    assert response.status_code == 200, response.text
    outputs = {o["name"]: o["data"][0] for o in response.json()["outputs"]}
    return int(outputs["OUTPUT"]), str(outputs["ID"])


@pytest.mark.parametrize("target", TARGETS)
def test_state_carries_across_calls_of_one_id_and_stays_apart_between_ids(server, target):
    got: dict[str, list[tuple[int, str]]] = {"11": [], "12": [], "seq-a": []}
    steps = [(1, 10, 100), (2, 20, 200), (3, 30, 300)]
    for step, values in enumerate(steps):
        flags = (START if step == 0 else 0) | (END if step == len(steps) - 1 else 0)
        for corrid, value in zip(got, values, strict=True):
            got[corrid].append(answer(call(server, target, corrid, value, flags)))
    assert got == {
        "11": [(1, "11"), (3, "11"), (6, "11")],
        "12": [(10, "12"), (30, "12"), (60, "12")],
        "seq-a": [(100, "seq-a"), (300, "seq-a"), (600, "seq-a")],
    }


@pytest.mark.parametrize("target", TARGETS)
def test_start_restarts_the_state_of_an_id(server, target):
    assert answer(call(server, target, "21", 5, START)) == (5, "21")
    assert answer(call(server, target, "21", 5)) == (10, "21")
    assert answer(call(server, target, "21", 7, START)) == (7, "21")  # a new sequence
    assert answer(call(server, target, "21", 1, END)) == (8, "21")


@pytest.mark.parametrize("target", TARGETS)
def test_a_call_for_an_id_never_started_fails_naming_it(server, target):
    response = call(server, target, "99", 1)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "99" in error and "sequence_start" in error
    without_id = call(server, target, "0", 1)  # correlation id 0: no sequence
    assert without_id.status_code == 400
    assert "sequence_id" in without_id.json()["error"]


def test_concurrent_sequences_through_bls_each_get_their_own_sums(server):
    def run(corrid: int) -> list[tuple[int, str]]:
        values = [corrid * 10 + k for k in range(5)]
        out = []
        for step, value in enumerate(values):
            flags = (START if step == 0 else 0) | (END if step == len(values) - 1 else 0)
            out.append(answer(call(server, "seq_oldest", str(corrid), value, flags)))
        return out

    ids = list(range(100, 108))
    with ThreadPoolExecutor(8) as pool:
        results = dict(zip(ids, pool.map(run, ids), strict=True))
    for corrid, got in results.items():
        sums, total = [], 0
        for k in range(5):
            total += corrid * 10 + k
            sums.append((total, str(corrid)))
        assert got == sums, corrid
