"""Triton's own Python client examples, unchanged, against gpuserve serving Triton-named models.

The examples are ``src/python/examples`` of ``triton-inference-server/client``, copied to a
folder outside this repository; point ``GPUSERVE_TRITON_EXAMPLES`` at it (skipped otherwise).
The server serves :mod:`tests.fixtures.triton_examples` (``simple``, ``simple_string``,
``simple_identity``, ``simple_int8``, ``custom_identity_int32``, ``densenet_onnx``) in explicit
mode with every model loaded and with client shared memory allowed. Each example runs as its
own process, with ``-u`` pointing at the server (the one example with its addresses written in,
``memory_growth_test.py``, runs as a copy whose ``localhost:8000`` / ``localhost:8001`` name the
server's free ports: the suite never takes the default ports); an example passes when it exits
0 (and, for those in :data:`PASS_LINES`, which exit 0 either way, prints its PASS line:
Triton's error text matched).

Examples not run here, each with its reason: CUDA shared memory (needs a GPU), DALI
(``ensemble_image_client``), the two that require the server to call itself "triton", any
that fails outside this area (:data:`KNOWN`, empty now), and those whose models belong to
other areas and are run by those areas' tests with the same variable: sequence batching
(``tests/integration/test_sequence_batching.py``) and decoupled models
(``tests/integration/test_decoupled.py``). The two model-control examples count the models of
Triton's own example repository (7 over HTTP, 8 over gRPC): :func:`test_model_control_example`
runs each against a server of its own whose repository holds that many models
(:func:`~tests.fixtures.triton_examples.write_model_control_examples`), with ``simple`` a
Python model whose ``config.pbtxt`` names only its backend and whose ``auto_complete_config``
completes it (also under the load request's override ``{"max_batch_size": "16"}``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.fixtures.triton_examples import write_model_control_examples, write_triton_examples
from tests.helpers import InProcessServer

EXAMPLES = os.environ.get("GPUSERVE_TRITON_EXAMPLES")
if not EXAMPLES:
    pytest.skip(
        "GPUSERVE_TRITON_EXAMPLES is not set: copy src/python/examples of "
        "triton-inference-server/client to a folder and point it there",
        allow_module_level=True,
    )
pytest.importorskip("tritonclient.http")
pytest.importorskip("tritonclient.grpc")
pytest.importorskip("PIL")

FOLDER = Path(EXAMPLES)
RUN_ALL = os.environ.get("GPUSERVE_TRITON_EXAMPLES_ALL") == "1"

_CUDASHM = (
    "CUDA shared memory: the client needs a GPU and cuda-python "
    "(tritonclient.utils.cuda_shared_memory)"
)
#: Examples never run here, and why.
NOT_RUN = {
    # the server side is tested by tests/gpu/test_cuda_shm.py (real CUDA IPC) and
    # tests/integration/test_triton_cuda_shared_memory.py (tritonclient, fake CUDA driver)
    "simple_grpc_cudashm_client.py": _CUDASHM,
    "simple_http_cudashm_client.py": _CUDASHM,
    "ensemble_image_client.py": "needs NVIDIA DALI (an ensemble with a DALI preprocessing model)",
    "simple_http_health_metadata.py": "requires the server to call itself 'triton'",
    "simple_grpc_health_metadata.py": "requires the server to call itself 'triton'",
}
#: Examples that fail on something outside this area, and why (GPUSERVE_TRITON_EXAMPLES_ALL=1
#: runs them anyway).
KNOWN: dict[str, str] = {}
_SEQUENCE = (
    "simple_sequence/simple_dyna_sequence: run by tests/integration/test_sequence_batching.py"
)
#: Examples whose models belong to other areas, run by those areas' tests.
OTHER_AREAS = {
    "simple_grpc_sequence_stream_infer_client.py": _SEQUENCE,
    "simple_grpc_sequence_sync_infer_client.py": _SEQUENCE,
    "simple_http_sequence_sync_infer_client.py": _SEQUENCE,
    "simple_grpc_aio_sequence_stream_infer_client.py": _SEQUENCE,
    "simple_grpc_custom_repeat.py": (
        "repeat_int32 (decoupled): run by tests/integration/test_decoupled.py"
    ),
}
IMAGE = ["-m", "densenet_onnx", "-c", "3", "-s", "INCEPTION"]
#: The runs of each example that needs other arguments than ``-u URL`` (``{image}``: an
#: image file). image_client.py runs over gRPC: over HTTP it imports ``attrdict``, which does
#: not import on Python >= 3.10.
RUNS = {
    "image_client.py": [[*IMAGE, "-i", "grpc", "{image}"]],
    "grpc_image_client.py": [[*IMAGE, "{image}"]],
    "reuse_infer_objects_client.py": [["-i", "http"], ["-i", "grpc"]],
    "memory_growth_test.py": [["-r", "20", "-i", "http"], ["-r", "20", "-i", "grpc"]],
}
#: Examples that exit 0 whether or not the server's error text matched Triton's, each with
#: the line they print when it did (the test requires it).
PASS_LINES = {
    "grpc_explicit_int_content_client.py": "PASS: explicit int",
    "grpc_explicit_int8_content_client.py": "PASS: explicit int8",
}
#: Examples with the server's address written in (no ``-u``): run as a copy naming the test
#: server's ports (:func:`_localised`).
ADDRESSES_WRITTEN_IN = ("memory_growth_test.py",)
#: The model-control examples, each with the number of models its repository index must
#: hold; run by :func:`test_model_control_example`, each against a server of its own.
MODEL_CONTROL = {"simple_http_model_control.py": 7, "simple_grpc_model_control.py": 8}


def _examples() -> list[str]:
    return sorted(p.name for p in FOLDER.glob("*.py") if p.name not in MODEL_CONTROL)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = write_triton_examples(tmp_path_factory.mktemp("triton") / "models")
    running = InProcessServer(
        root, model_control_mode="explicit", load_model=["*"], allow_client_shm=True
    )
    yield running
    running.stop()


def _localised(name: str, server, folder: Path) -> Path:
    """The example, or for one with its addresses written in a copy in ``folder`` whose
    ``localhost:8000`` / ``localhost:8001`` name ``server``'s ports (nothing else changes)."""
    if name not in ADDRESSES_WRITTEN_IN:
        return FOLDER / name
    code = (FOLDER / name).read_text()
    code = code.replace("localhost:8000", server.url.removeprefix("http://"))
    code = code.replace("localhost:8001", server.grpc_url)
    copy = folder / name
    copy.write_text(code)
    return copy


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 255, (256, 256, 3), dtype=np.uint8)
    path = tmp_path_factory.mktemp("image") / "mug.png"
    Image.fromarray(pixels).save(path)
    return path


def _commands(name: str, server, image: Path, folder: Path) -> list[list[str]]:
    commands = []
    for extra in RUNS.get(name, [[]]):
        grpc = "grpc" in name or "grpc" in extra
        url = server.grpc_url if grpc else server.url.removeprefix("http://")
        command = [sys.executable, str(_localised(name, server, folder))]
        if name not in ADDRESSES_WRITTEN_IN:
            command += ["-u", url]
        commands.append(command + [arg.format(image=image) for arg in extra])
    return commands


@pytest.mark.slow
@pytest.mark.parametrize("name", _examples())
def test_example_runs_unchanged(name, server, image, tmp_path):
    if name in NOT_RUN:
        pytest.skip(NOT_RUN[name])
    if name in OTHER_AREAS:
        pytest.skip(OTHER_AREAS[name])
    if name in KNOWN and not RUN_ALL:
        pytest.skip(f"fails outside this area: {KNOWN[name]}")
    runs = _commands(name, server, image, tmp_path)
    for command in runs:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (
            f"{' '.join(command[1:])} exited {done.returncode}\n"
            f"stdout: {done.stdout[-2000:]}\nstderr: {done.stderr[-2000:]}"
        )
        if name in PASS_LINES:
            assert PASS_LINES[name] in done.stdout, (
                f"{name} did not print {PASS_LINES[name]!r} (the server's error text differs "
                f"from Triton's)\nstdout: {done.stdout[-2000:]}\nstderr: {done.stderr[-2000:]}"
            )


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODEL_CONTROL))
def test_model_control_example(name, tmp_path):
    if not (FOLDER / name).is_file():
        pytest.skip(f"{name} is not in {FOLDER}")
    root = write_model_control_examples(tmp_path / "models", MODEL_CONTROL[name])
    running = InProcessServer(root, model_control_mode="explicit", load_model=["simple"])
    try:
        url = running.grpc_url if "grpc" in name else running.url.removeprefix("http://")
        command = [sys.executable, str(FOLDER / name), "-u", url]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    finally:
        running.stop()
    assert done.returncode == 0 and "PASS: model control" in done.stdout, (
        f"{name} exited {done.returncode}\nstdout: {done.stdout[-2000:]}\n"
        f"stderr: {done.stderr[-2000:]}"
    )
