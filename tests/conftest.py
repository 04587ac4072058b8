"""Shared fixtures: paths, and the skip rule for GPU tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.port_guard import DefaultPortGuard

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The ONNX Runtime graph cache of the embedded text_embedding (gpuserve.models.bert_onnx): one
# folder per test run, shared by every server the tests start, outside the user's ~/.cache.
if "GPUSERVE_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["GPUSERVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="gpuserve-test-cache-")

FIXTURE_REPOSITORY = Path(__file__).parent / "fixtures" / "repository"


@pytest.fixture(scope="session", autouse=True)
def default_ports_held() -> Iterator[DefaultPortGuard]:
    """gpuserve's default ports (8000, 8001, 8002) held while the suite runs: no test may
    start a server on them or reach one there (see tests/port_guard.py)."""
    guard = DefaultPortGuard()
    yield guard
    guard.close()


@pytest.fixture(autouse=True)
def no_default_ports(request: pytest.FixtureRequest, default_ports_held: DefaultPortGuard):
    """Fail a test that reached a default port (a server of its own must take a free one,
    and its clients must be pointed there)."""
    default_ports_held.current = request.node.nodeid
    yield
    made = sorted({port for port, _ in default_ports_held.take()})
    if made:
        pytest.fail(
            f"this test connected to gpuserve's default port(s) {made}, where a user's own "
            "server runs: start servers on free ports (tests/helpers.py) and point every "
            "client at them"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def fixture_repository() -> Path:
    return FIXTURE_REPOSITORY
