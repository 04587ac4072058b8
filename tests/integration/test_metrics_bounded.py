"""``/metrics`` stays bounded by what the repository holds (BC-56 of shared/cases/README.md).

* ``poll`` mode: twelve models are each added to the repository, served once, then removed;
  every series labelled with one of them leaves ``/metrics`` (``gpuserve_*`` and ``nv_*``),
  and the exposition ends as it began.
* ``explicit`` mode: a version unloaded and loaded again keeps its ``gpuserve_*`` counters
  (they never go backwards while the model is in the repository; Triton's ``nv_*`` series
  leave with the version, as Triton's do); an evicted model keeps its eviction counters
  while it stays in the repository.
* Requests for names and versions the repository never had, on every route that takes a
  model name, add no series.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from tests.helpers import InProcessServer, wait_until

pytestmark = pytest.mark.timeout(180)

MODEL_PY = """
import numpy as np

from gpuserve import PythonModel


class Model(PythonModel):
    def forward(self, batch):
        return {"OUTPUT0": batch["INPUT0"] * 2}
"""

CONFIG = (
    "backend: python\n"
    "max_batch_size: 4\n"
    "inputs: [{name: INPUT0, datatype: FP32, shape: [1]}]\n"
    "outputs: [{name: OUTPUT0, datatype: FP32, shape: [1]}]\n"
    "instance_group: [{count: 1, kind: cpu}]\n"
)

BODY = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]}


def write_model(root: Path, name: str, extra: str = "") -> None:
    folder = root / name
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(MODEL_PY)
    (folder / "config.yaml").write_text(CONFIG + extra)


def series(url: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of ``/metrics``: (name, labels, value)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return [
        (sample.name, dict(sample.labels), sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def labelled(url: str, model: str, prefix: str = "") -> list[str]:
    """The series names whose ``model`` (or Triton's ``model_name``) label is ``model``."""
    return [
        name
        for name, labels, _ in series(url)
        if name.startswith(prefix) and model in (labels.get("model"), labels.get("model_name"))
    ]


def model_series_count(url: str) -> int:
    """How many series carry a model label at all (the part that grows with models)."""
    return sum(1 for _, labels, _ in series(url) if "model" in labels or "model_name" in labels)


def test_poll_mode_models_that_leave_the_repository_lose_their_series(tmp_path):
    repo = tmp_path / "repo"
    write_model(repo, "resident")
    server = InProcessServer(repo, model_control_mode="poll", repository_poll_interval_s=0.1)
    try:
        url = server.url
        with httpx.Client(base_url=url, timeout=30) as http:
            assert http.post("/v2/models/resident/infer", json=BODY).status_code == 200
            baseline = model_series_count(url)
            for i in range(12):
                name = f"churn{i}"
                write_model(repo, name)
                wait_until(
                    lambda n=name: http.get(f"/v2/models/{n}/ready").status_code == 200,
                    30,
                    f"{name} loaded by a poll",
                )
                assert http.post(f"/v2/models/{name}/infer", json=BODY).status_code == 200
                present = labelled(url, name)
                assert len([s for s in present if s.startswith("gpuserve_")]) >= 100, present
                assert any(s.startswith("nv_") for s in present), present
                shutil.rmtree(repo / name)
                wait_until(
                    lambda n=name: http.get(f"/v2/models/{n}/ready").status_code == 404,
                    30,
                    f"{name} removed by a poll",
                )
                assert labelled(url, name) == [], (name, labelled(url, name))
            assert model_series_count(url) == baseline
            # the model that stayed kept its counts
            kept = [
                value
                for name, labels, value in series(url)
                if name == "gpuserve_requests_total"
                and labels.get("model") == "resident"
                and labels.get("outcome") == "success"
            ]
            assert kept == [1.0], kept
    finally:
        server.stop()


def test_explicit_unload_and_reload_keep_counting_on_the_same_series(tmp_path):
    repo = tmp_path / "repo"
    write_model(repo, "m")
    server = InProcessServer(repo, model_control_mode="explicit", load_model=["m"])
    try:
        url = server.url
        with httpx.Client(base_url=url, timeout=30) as http:
            for _ in range(3):
                assert http.post("/v2/models/m/infer", json=BODY).status_code == 200
            assert len(labelled(url, "m", "gpuserve_")) >= 100
            assert labelled(url, "m", "nv_")
            kept = len(labelled(url, "m", "gpuserve_"))
            assert http.post("/v2/repository/models/m/unload").status_code == 200
            assert labelled(url, "m", "nv_") == []
            assert 100 <= len(labelled(url, "m", "gpuserve_")) <= kept  # counters stay
            assert http.post("/v2/repository/models/m/load").status_code == 200
            assert http.post("/v2/models/m/infer", json=BODY).status_code == 200
            success = [
                value
                for name, labels, value in series(url)
                if name == "gpuserve_requests_total"
                and labels.get("model") == "m"
                and labels.get("outcome") == "success"
            ]
            assert success == [4.0], success  # never backwards
    finally:
        server.stop()


def test_an_evicted_model_keeps_its_eviction_counts_while_in_the_repository(tmp_path):
    repo = tmp_path / "repo"
    write_model(repo, "a")
    write_model(repo, "b")
    server = InProcessServer(repo, load_on_demand=True, max_loaded_models=1)
    try:
        url = server.url
        with httpx.Client(base_url=url, timeout=30) as http:
            assert http.post("/v2/models/a/infer", json=BODY).status_code == 200
            assert http.post("/v2/models/b/infer", json=BODY).status_code == 200  # evicts a
            left = set(labelled(url, "a"))
            # its counters stay while it is in the repository (they never go backwards)
            assert {
                "gpuserve_requests_total",
                "gpuserve_model_loads_total",
                "gpuserve_model_evictions_total",
            } <= left
            evictions = [
                value
                for name, labels, value in series(url)
                if name == "gpuserve_model_evictions_total"
                and labels == {"model": "a", "reason": "lru"}
            ]
            assert evictions == [1.0], evictions
    finally:
        server.stop()


def test_names_and_versions_the_repository_never_had_add_no_series(tmp_path):
    repo = tmp_path / "repo"
    write_model(repo, "known")
    server = InProcessServer(repo)
    try:
        url = server.url
        before = model_series_count(url)
        names = [f"never_had_{i}" for i in range(40)]
        with httpx.Client(base_url=url, timeout=30) as http:
            triton = grpcclient.InferenceServerClient(server.grpc_url)
            tensor = grpcclient.InferInput("INPUT0", [1, 1], "FP32")
            tensor.set_data_from_numpy(np.ones((1, 1), np.float32))
            for i, name in enumerate(names):
                answers = [
                    http.post(f"/v2/models/{name}/infer", json=BODY),
                    http.post(f"/v2/models/{name}/versions/1/infer", json=BODY),
                    http.post(f"/v2/models/known/versions/{100 + i}/infer", json=BODY),
                    http.post(f"/v2/models/{name}/generate", json={"text_input": "hi"}),
                    http.post(
                        "/v1/chat/completions",
                        json={"model": name, "messages": [{"role": "user", "content": "hi"}]},
                    ),
                    http.post("/v1/completions", json={"model": name, "prompt": "hi"}),
                    http.post("/v1/embeddings", json={"model": name, "input": "hi"}),
                    http.get(f"/v2/models/{name}/stats"),
                ]
                assert all(400 <= a.status_code < 500 for a in answers), [
                    (a.request.url.path, a.status_code) for a in answers
                ]
                with pytest.raises(InferenceServerException):
                    triton.infer(name, [tensor])
                with pytest.raises(InferenceServerException):
                    triton.infer("known", [tensor], model_version=str(100 + i))
            triton.close()
        text = httpx.get(f"{url}/metrics").text
        assert "never_had" not in text
        versions = {labels.get("version") for _, labels, _ in series(url) if "version" in labels}
        assert not versions & {str(100 + i) for i in range(40)}, versions
        assert model_series_count(url) - before <= 12  # the `_unknown` failure series alone
    finally:
        server.stop()
