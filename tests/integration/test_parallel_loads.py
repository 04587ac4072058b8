"""BC-35: several Hugging Face models loading at the same time, each start a fresh process.

Before the fix, every start-up with several huggingface models lost one to five of them at
random (``module 'transformers' has no attribute 'AutoTokenizer'``): the versions loaded on
parallel threads, and the first use of transformers, which builds its names lazily, raced.

Five starts of ``gpuserve serve`` on six tiny huggingface models that share one folder
(three feature extraction, three classification); every model of every start must be READY:

* four in mode ``none``: the six load at start, in parallel;
* one in mode ``explicit`` with a python model loaded at start (transformers not imported
  yet): six ``load`` calls at once, then a seventh model whose folder is missing fails, and
  once the folder appears a plain ``load`` loads it, nothing in its model folder edited.

The five processes start at the same time: the cost of a start is importing torch and
transformers, so this keeps the test short, and the load it puts on the machine makes a race
likelier, not less.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.fixtures.hf_models import write_tiny_classifier
from tests.fixtures.lifecycle_support import make_repository
from tests.helpers import SubprocessServer, wait_ready

pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STARTS = 5
HF_MODELS = [f"hf_{i}" for i in range(6)]


def _hf_model(repository: Path, name: str, task: str, model_dir: Path) -> None:
    version = repository / name / "1"
    version.mkdir(parents=True)
    # The weights live in model_dir; an empty version folder would not be loaded.
    (version / "README.txt").write_text("weights: huggingface.model_dir\n")
    (repository / name / "config.yaml").write_text(
        "backend: huggingface\n"
        "max_batch_size: 4\n"
        "instance_group: [{kind: cpu}]\n"
        f"huggingface: {{task: {task}, model_dir: '{model_dir}', max_length: 32}}\n"
    )


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bc35")
    shared = write_tiny_classifier(root / "tiny")
    repository = root / "repository"
    for index, name in enumerate(HF_MODELS):
        task = "sequence-classification" if index % 2 else "feature-extraction"
        _hf_model(repository, name, task, shared)
    make_repository(repository, "double4_fp32")
    return repository


def _states(url: str) -> dict[str, str]:
    rows = httpx.post(f"{url}/v2/repository/index", timeout=30.0).json()
    return {row["name"]: f"{row['state']} {row.get('reason', '')}".strip() for row in rows}


def _start(*args: str) -> SubprocessServer:
    # One torch thread per process: five processes share two cores.
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return SubprocessServer(
        "--grpc-port", "-1", "--log-level", "warning", *args, env=env, wait=False
    )


def _ready(server: SubprocessServer) -> None:
    try:
        wait_ready(server.url, 240.0, alive=lambda: server.proc.poll() is None)
    except Exception:
        print(server.output())
        raise


def _load(url: str, name: str) -> httpx.Response:
    return httpx.post(f"{url}/v2/repository/models/{name}/load", timeout=240.0)


def test_every_hf_model_loads_at_every_start_and_in_parallel_explicit_loads(repository, tmp_path):
    hf_only = tmp_path / "hf_only"
    shutil.copytree(repository, hf_only, ignore=shutil.ignore_patterns("double4_fp32"))
    # The explicit server's repository also has one model whose transformers folder does
    # not exist yet (a cause that goes away without an edit of the model folder).
    late_dir = tmp_path / "late_weights"
    _hf_model(repository, "hf_late", "feature-extraction", late_dir)

    starts = [_start("--model-repository", str(hf_only)) for _ in range(STARTS - 1)]
    explicit = _start(
        "--model-repository",
        str(repository),
        "--model-control-mode",
        "explicit",
        "--load-model",
        "double4_fp32",
    )
    try:
        _ready(explicit)
        with ThreadPoolExecutor(len(HF_MODELS)) as pool:
            answers = list(pool.map(lambda name: _load(explicit.url, name), HF_MODELS))
        assert [a.status_code for a in answers] == [200] * len(HF_MODELS), [a.text for a in answers]
        states = _states(explicit.url)
        assert all(states[name] == "READY" for name in HF_MODELS), states

        failed = _load(explicit.url, "hf_late")
        assert failed.status_code == 400 and "config.json" in failed.text, failed.text
        shutil.copytree(repository.parent / "tiny", late_dir)  # the cause goes away
        retried = _load(explicit.url, "hf_late")
        assert retried.status_code == 200, retried.text
        assert _states(explicit.url)["hf_late"] == "READY"

        for number, server in enumerate(starts, 1):
            _ready(server)
            states = _states(server.url)
            lost = {name: state for name, state in states.items() if state != "READY"}
            assert sorted(states) == HF_MODELS and not lost, (
                f"start {number} of {STARTS}: {lost}\n{server.output()}"
            )
    finally:
        for server in [*starts, explicit]:
            server.stop()
