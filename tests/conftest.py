"""Shared fixtures: paths, and the skip rule for GPU tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The ONNX Runtime graph cache of the embedded text_embedding (gpuserve.models.bert_onnx): one
# folder per test run, shared by every server the tests start, outside the user's ~/.cache.
if "GPUSERVE_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["GPUSERVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="gpuserve-test-cache-")

FIXTURE_REPOSITORY = Path(__file__).parent / "fixtures" / "repository"


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
