"""The embedding graph on ONNX Runtime (gpuserve.models.bert_onnx) and ``execution`` of the
default ``text_embedding``: same embeddings as torch, the on-disk graph cache, the choice of
``execution: auto``, and clear errors for what it cannot run."""

from __future__ import annotations

import importlib.util
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from gpuserve.models import bert_onnx
from gpuserve.models.bert_onnx import cache_root, graph_key, length_groups
from gpuserve.models.sentence_embedding import SentenceEmbedder

pytest.importorskip("onnxruntime")

TEXTS = [
    "Hello world.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps on a warm windowsill.",
    "GPU",
    "Ünïcödé text with émojis 🚀 and 中文字符.",
    "long " * 600,  # truncated to max_seq_len
]


@pytest.fixture(scope="module")
def torch_embedder() -> SentenceEmbedder:
    return SentenceEmbedder.load()


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("graph-cache")


@pytest.fixture(scope="module")
def ort_embedder(shared_cache: Path) -> SentenceEmbedder:
    embedder = SentenceEmbedder.load()
    embedder.use_onnxruntime(1, shared_cache)
    return embedder


def test_onnxruntime_embeddings_equal_torch(torch_embedder, ort_embedder) -> None:
    assert ort_embedder.execution == "onnxruntime" and torch_embedder.execution == "torch"
    expected = torch_embedder.encode(TEXTS)
    got = ort_embedder.encode(TEXTS)
    assert got.shape == (len(TEXTS), 384) and got.dtype == np.float32
    assert float(np.abs(got - expected).max()) < 1e-5
    assert float((got * expected).sum(axis=1).min()) >= 0.9999
    # one row at a time: the same as in a padded batch
    for i, text in enumerate(TEXTS[:3]):
        np.testing.assert_allclose(ort_embedder.encode([text])[0], got[i], atol=1e-5)
    assert ort_embedder.encode([]).shape == (0, 384)


def test_graph_is_exported_once_then_read_from_the_cache(ort_embedder, shared_cache) -> None:
    graphs = list((shared_cache / "onnx").glob("*.onnx"))
    assert [p.name for p in graphs] == [f"{graph_key(ort_embedder.encoder)}.onnx"]
    assert ort_embedder.onnxruntime is not None
    assert ort_embedder.onnxruntime.source.startswith("exported to ")
    again = SentenceEmbedder.load()
    session = again.use_onnxruntime(1, shared_cache)
    assert session.source == f"cached {graphs[0]}"
    assert not [p for p in (shared_cache / "onnx").iterdir() if p.name.startswith(".export-")]


def test_a_damaged_cached_graph_is_exported_again(ort_embedder, tmp_path) -> None:
    key = graph_key(ort_embedder.encoder)
    (tmp_path / "onnx").mkdir()
    (tmp_path / "onnx" / f"{key}.onnx").write_bytes(b"not an onnx file")
    embedder = SentenceEmbedder.load()
    session = embedder.use_onnxruntime(1, tmp_path)
    assert session.source.startswith("exported to ")
    assert (tmp_path / "onnx" / f"{key}.onnx").stat().st_size > 1_000_000
    np.testing.assert_allclose(
        embedder.encode(TEXTS[:2]), ort_embedder.encode(TEXTS[:2]), atol=1e-6
    )


def test_a_cache_path_that_is_a_file_exports_in_memory(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    session = SentenceEmbedder.load().use_onnxruntime(1, blocker)
    assert session.source.startswith("exported in memory (cache ")
    assert session.run(np.array([[101, 102]]), np.array([[1, 1]])).shape == (1, 384)


def _load_side_by_side(cache: Path, count: int = 3) -> list[str | BaseException]:
    """``count`` embedders exporting at the same time (models loading in parallel): each
    one's session source, or what it raised."""
    embedders = [SentenceEmbedder.load() for _ in range(count)]
    start = threading.Barrier(count)

    def load(embedder: SentenceEmbedder) -> str:
        start.wait()
        return embedder.use_onnxruntime(1, cache).source

    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(load, embedder) for embedder in embedders]
    return [f.exception() or f.result() for f in futures]


def test_models_loading_side_by_side_export_once(tmp_path) -> None:
    sources = _load_side_by_side(tmp_path)
    kinds = sorted(str(s).split(" ", 1)[0] for s in sources)
    assert kinds == ["cached", "cached", "exported"], sources


def test_models_loading_side_by_side_without_a_writable_cache(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    sources = _load_side_by_side(blocker)
    assert all(str(s).startswith("exported in memory (cache ") for s in sources), sources


def test_the_key_follows_the_weights(torch_embedder) -> None:
    other = SentenceEmbedder.load()
    assert graph_key(other.encoder) == graph_key(torch_embedder.encoder)
    with torch.no_grad():
        other.encoder.layers[0].qkv.bias[0] += 1e-3
    assert graph_key(other.encoder) != graph_key(torch_embedder.encoder)


def test_a_graph_that_disagrees_with_torch_is_refused(monkeypatch, tmp_path) -> None:
    real = bert_onnx.OrtSession.run
    monkeypatch.setattr(bert_onnx.OrtSession, "run", lambda self, i, m: real(self, i, m) + 0.01)
    with pytest.raises(ValueError, match=r"disagrees with the torch encoder: max \|diff\| 0\.01"):
        SentenceEmbedder.load().use_onnxruntime(1, tmp_path)


def test_only_an_fp32_cpu_encoder_runs_on_onnxruntime(tmp_path) -> None:
    half = SentenceEmbedder.load(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fp32 encoder on the CPU; this one is bfloat16 on cpu"):
        half.use_onnxruntime(1, tmp_path)


def test_cache_root_follows_the_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("GPUSERVE_CACHE_DIR", str(tmp_path / "explicit"))
    assert cache_root() == tmp_path / "explicit"
    monkeypatch.delenv("GPUSERVE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "gpuserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "gpuserve"


def test_auto_execution(monkeypatch) -> None:
    from gpuserve.models import text_embedding as module

    assert module.auto_execution("cpu", "fp32") == "onnxruntime"
    assert module.auto_execution("cuda:0", "fp32") == "torch"
    assert module.auto_execution("cpu", "int8") == "onnxruntime"
    assert module.auto_execution("cuda:0", "int8") == "torch"  # refused at load
    assert module.auto_execution("cpu", "bf16") == "torch"
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else real(name)
    )
    assert module.auto_execution("cpu", "fp32") == "torch"
    assert module.auto_execution("cpu", "int8") == "onnxruntime"


def _modelled(lengths: list[int], groups: list[list[int]], call: float) -> float:
    total = 0.0
    for g in groups:
        longest = max(lengths[i] for i in g)
        total += call + len(g) * longest * (1 + bert_onnx.GROUP_ATTENTION * longest)
    return total


def _cuts(count: int) -> list[list[tuple[int, int]]]:
    """Every way to cut ``count`` sorted rows into consecutive runs."""
    if count == 0:
        return [[]]
    return [[*head, (first, count)] for first in range(count) for head in _cuts(first)]


def test_length_groups_are_the_cheapest_cut_within_the_token_bound() -> None:
    rng = np.random.default_rng(5)
    for trial in range(60):
        lengths = [int(n) for n in rng.integers(1, 300 if trial % 2 else 40, rng.integers(1, 9))]
        call = float(rng.choice([0.0, 12.0, 100.0]))
        groups = length_groups(lengths, call_tokens=call, max_tokens=256)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        for g in groups:
            rows = [lengths[i] for i in g]
            assert rows == sorted(rows)
            assert len(rows) == 1 or max(rows) * len(rows) <= 256
        order = sorted(range(len(lengths)), key=lambda k: lengths[k])
        feasible = [
            [order[a:b] for a, b in cut]
            for cut in _cuts(len(lengths))
            if all(b - a == 1 or (b - a) * lengths[order[b - 1]] <= 256 for a, b in cut)
        ]
        cheapest = min(_modelled(lengths, c, call) for c in feasible)
        assert _modelled(lengths, groups, call) == pytest.approx(cheapest)


def test_length_groups_of_a_served_mix() -> None:
    lengths = [10, 200, 11, 12, 40, 9, 300, 41, 10]
    groups = length_groups(lengths)
    assert [[lengths[i] for i in g] for g in groups] == [
        [9, 10, 10, 11, 12],
        [40, 41],
        [200],
        [300],
    ]
    assert length_groups([]) == []
    assert sorted(map(len, length_groups([16] * 40))) == [8, 32]  # 512 tokens at most
    assert length_groups([5, 6], call_tokens=0.0) == [[0], [1]]  # padding costs, calls free


def test_mixed_lengths_run_grouped_equal_one_by_one(ort_embedder) -> None:
    session = ort_embedder.onnxruntime
    assert session is not None
    texts = TEXTS + ["word " * n for n in (3, 30, 31, 90, 120)]
    batch = ort_embedder.tokenize(texts)
    ids, mask = batch.input_ids.numpy(), batch.attention_mask.numpy()
    lengths = mask.sum(axis=1).tolist()
    assert len(length_groups(lengths)) > 3
    got = session.run_grouped(ids, mask, lengths)
    whole = session.run(ids, mask)  # one padded call
    np.testing.assert_allclose(got, whole, atol=1e-5)
    for i, text in enumerate(texts):
        np.testing.assert_allclose(ort_embedder.encode([text])[0], got[i], atol=1e-5)
