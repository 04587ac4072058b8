"""The default repository's ``text_embedding`` model and gpuserve.models.sentence_embedding.

The Model class is driven through its hooks exactly as the python backend calls them
(load -> warmup -> preprocess -> forward -> postprocess), with a real LoadContext.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gpuserve.backends import cpu_features
from gpuserve.backends.base import LoadContext
from gpuserve.backends.loader import import_module_from_path
from gpuserve.config import ModelConfig, default_model_repository, load_model_config
from gpuserve.models import text_embedding
from gpuserve.models.execution_choice import ExecutionTimes
from gpuserve.models.sentence_embedding import (
    SentenceEmbedder,
    decode_texts,
    default_model_dir,
    load_tokenizer,
)

MODEL_DIR = default_model_repository() / "text_embedding"

SENTENCES = [
    "Hello world.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps on a warm windowsill.",
    "GPU",
    "Ünïcödé text with émojis 🚀 and 中文字符, to exercise the tokenizer's odd paths.",
]


def text_tensor(texts: list[str]) -> np.ndarray:
    """BYTES [B, 1] as the protocol layer hands it over: an object array of bytes."""
    array = np.empty((len(texts), 1), dtype=object)
    for i, text in enumerate(texts):
        array[i, 0] = text.encode("utf-8")
    return array


def make_model(config: ModelConfig | None = None, **overrides: Any) -> Any:
    config = config or load_model_config(MODEL_DIR / "config.yaml")
    if overrides:
        params = {**config.parameters, **overrides}
        config = config.model_copy(update={"parameters": params})
    module = import_module_from_path(MODEL_DIR / "1" / "model.py", "text_embedding", 1)
    model = module.Model()
    context = LoadContext(
        config=config,
        version_path=MODEL_DIR / "1",
        version=1,
        device="cpu",
        parameters=dict(config.parameters),
    )
    model.context = context
    model.load(context)
    return model


def run_hooks(model: Any, texts: list[str]) -> np.ndarray:
    prepared = model.preprocess({"TEXT": text_tensor(texts)})
    outputs = model.postprocess(model.forward(prepared))
    assert set(outputs) == {"EMBEDDING"}
    return outputs["EMBEDDING"]


@pytest.fixture(scope="module")
def model() -> Any:
    m = make_model()
    m.warmup()
    return m


# --- decode_texts ---------------------------------------------------------------------------


def test_decode_texts_rows_of_bytes_and_str() -> None:
    array = text_tensor(["a", "bé"])
    assert decode_texts(array) == ["a", "bé"]
    assert decode_texts(array.reshape(-1)) == ["a", "bé"]
    assert decode_texts(np.array(["x", "y"], dtype=object)) == ["x", "y"]


def test_decode_texts_replaces_invalid_utf8() -> None:
    array = np.array([[b"ok \xff\xfe end"]], dtype=object)
    assert decode_texts(array) == ["ok \ufffd\ufffd end"]


def test_decode_texts_rejects_several_strings_per_row_and_non_text() -> None:
    with pytest.raises(ValueError, match=r"one string per row, got shape \[2, 2\]"):
        decode_texts(np.array([[b"a", b"b"], [b"c", b"d"]], dtype=object))
    with pytest.raises(TypeError, match="int"):
        decode_texts(np.array([[1]], dtype=object))


# --- tokenizer ------------------------------------------------------------------------------


def test_tokenizer_pads_to_longest_and_truncates() -> None:
    tokenizer = load_tokenizer(default_model_dir(), max_seq_len=8)
    short, long = tokenizer.encode_batch(["hi", "one two three four five six seven eight nine"])
    assert len(short.ids) == len(long.ids) == 8  # truncated to 8, "hi" padded up to it
    assert short.ids[:3] == [101, 7632, 102] and short.ids[3:] == [0] * 5
    assert short.attention_mask == [1, 1, 1, 0, 0, 0, 0, 0]
    assert long.ids[0] == 101 and long.ids[-1] == 102  # [CLS] ... [SEP] kept
    # The file's own fixed padding to 128 is gone: a lone short text is not padded.
    assert len(tokenizer.encode_batch(["hi"])[0].ids) == 3


def test_embedder_tokenize_tensors_and_padded_flag() -> None:
    embedder = SentenceEmbedder.load()
    assert embedder.max_seq_len == 256  # sentence_bert_config.json
    batch = embedder.tokenize(["hi", "hello there world"])
    assert batch.input_ids.dtype == batch.attention_mask.dtype == torch.int64
    assert batch.input_ids.shape == batch.attention_mask.shape == (2, 5)
    assert batch.padded
    assert not embedder.tokenize(["hi", "yo"]).padded
    long = embedder.tokenize(["word " * 1000])
    assert long.input_ids.shape == (1, 256)


def test_embedder_rejects_bad_max_seq_len() -> None:
    with pytest.raises(ValueError, match=r"max_seq_len=1000 must be in \[2, 512\]"):
        SentenceEmbedder.load(max_seq_len=1000)


def test_embedder_empty_batch() -> None:
    out = SentenceEmbedder.load().encode([])
    assert out.shape == (0, 384) and out.dtype == np.float32


# --- the Model hooks ------------------------------------------------------------------------


def test_model_hooks_output_shape_dtype_norm(model: Any) -> None:
    emb = run_hooks(model, SENTENCES)
    assert emb.shape == (len(SENTENCES), 384)
    assert emb.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)


def test_model_batched_equals_one_by_one(model: Any) -> None:
    batched = run_hooks(model, SENTENCES)
    for i, sentence in enumerate(SENTENCES):
        alone = run_hooks(model, [sentence])
        np.testing.assert_allclose(batched[i], alone[0], atol=1e-5)


def test_model_similar_sentences_are_closer(model: Any) -> None:
    a, b, c = run_hooks(
        model, ["A man is eating food.", "A man eats a meal.", "The stock market fell sharply."]
    )
    assert float(a @ b) > float(a @ c) + 0.3


def test_model_invalid_utf8_row_does_not_fail_batch(model: Any) -> None:
    inputs = text_tensor(["valid sentence", "x"])
    inputs[1, 0] = b"caf\xe9 au lait"
    out = model.postprocess(model.forward(model.preprocess({"TEXT": inputs})))["EMBEDDING"]
    assert out.shape == (2, 384) and np.isfinite(out).all()


def test_model_parameters_model_dir_and_max_seq_len() -> None:
    m = make_model(model_dir=str(default_model_dir()), max_seq_len=16)
    assert m.embedder.max_seq_len == 16
    prepared = m.preprocess({"TEXT": text_tensor(["word " * 100])})
    assert prepared.input_ids.shape == (1, 16)


def test_model_refuses_mismatched_output_shape() -> None:
    config = load_model_config(MODEL_DIR / "config.yaml")
    outputs = [config.outputs[0].model_copy(update={"shape": [768]})]
    with pytest.raises(ValueError, match=r"declared with shape \[768\].*384"):
        make_model(config.model_copy(update={"outputs": outputs}))


def test_model_bf16_close_to_fp32(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # bf16 on a CPU needs AVX-512 BF16 / AMX: say this one has them (torch emulates otherwise)
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    config = load_model_config(MODEL_DIR / "config.yaml").model_copy(update={"precision": "bf16"})
    low = make_model(config)
    assert next(low.embedder.encoder.parameters()).dtype == torch.bfloat16
    ref = run_hooks(model, SENTENCES)
    out = run_hooks(low, SENTENCES)
    assert out.dtype == np.float32
    assert (ref * out).sum(axis=1).min() >= 0.99


def test_model_int8_parameters_are_checked_before_loading() -> None:
    config = load_model_config(MODEL_DIR / "config.yaml").model_copy(update={"precision": "int8"})
    with pytest.raises(ValueError, match="parameter 'int8_scheme': 'int4'; expected one of "
                       "blockwise, dynamic"):  # fmt: skip
        make_model(config, int8_scheme="int4")


@pytest.mark.slow
def test_model_matches_sentence_transformers(model: Any) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    st = pytest.importorskip("sentence_transformers")
    reference = st.SentenceTransformer(str(default_model_dir()), device="cpu")
    ref = reference.encode(SENTENCES, batch_size=len(SENTENCES), convert_to_numpy=True)
    ours = run_hooks(model, SENTENCES)
    cosine = (ours * ref).sum(axis=1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    assert cosine.min() >= 0.9999, cosine
    assert np.abs(ours - ref).max() < 1e-5


def test_default_model_dir_has_the_files() -> None:
    folder = default_model_dir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (Path(folder) / name).is_file(), name


# --- execution: auto / torch / onnxruntime -----------------------------------------------------


def measured(ort_ms: list[float], torch_ms: list[float]):
    """A stand-in for the load's timing of both executions (batches of 2, 4, 8, 16 rows)."""
    times = ExecutionTimes(
        (2, 4, 8, 16), tuple(t / 1e3 for t in ort_ms), tuple(t / 1e3 for t in torch_ms)
    )
    return lambda embedder: times


def test_model_execution_auto_is_onnxruntime_on_cpu_and_equals_torch(monkeypatch) -> None:
    pytest.importorskip("onnxruntime")
    # a CPU where ONNX Runtime is ahead at every batch size (measured so on an AVX2 core)
    monkeypatch.setattr(
        text_embedding, "measured_times", measured([10, 15, 25, 45], [12, 18, 30, 50])
    )
    model = make_model()
    assert model.embedder.execution == "onnxruntime" and model.embedder.torch_from_rows is None
    assert model.unpadded_batches is True  # any mix of lengths: sub-batches of similar ones
    on_torch = make_model(execution="torch")
    assert on_torch.embedder.execution == "torch" and on_torch.unpadded_batches is True
    padded = make_model(unpadded="false")
    assert padded.embedder.execution == "onnxruntime" and padded.unpadded_batches is False
    ref = run_hooks(on_torch, SENTENCES)
    np.testing.assert_allclose(run_hooks(model, SENTENCES), ref, atol=1e-5)
    np.testing.assert_allclose(run_hooks(padded, SENTENCES), ref, atol=1e-5)
    # the CPU stage packs tokens only for torch
    assert model.preprocess({"TEXT": text_tensor(SENTENCES)}).packed_ids is None
    assert on_torch.preprocess({"TEXT": text_tensor(SENTENCES)}).packed_ids is not None
    # on ONNX Runtime the torch weights are freed (the session has its own copy)
    assert all(p.is_meta for p in model.embedder.encoder.parameters())
    assert not any(p.is_meta for p in on_torch.embedder.encoder.parameters())
    assert model.embedder.dimension == 384


def test_model_execution_auto_runs_large_batches_on_torch_where_it_is_faster(
    monkeypatch, caplog
) -> None:
    pytest.importorskip("onnxruntime")
    # a CPU where torch packed is ahead from 8 rows (measured so on a core with AMX)
    times = measured([16.2, 23.1, 41.2, 71.3], [16.7, 23.0, 34.5, 59.0])
    monkeypatch.setattr(text_embedding, "measured_times", times)
    with caplog.at_level("INFO"):
        model = make_model()
    assert model.embedder.execution == "onnxruntime" and model.embedder.torch_from_rows == 8
    assert "2 rows 16.2/16.7 ms, 4 rows 23.1/23.0 ms, 8 rows 41.2/34.5 ms" in caplog.text
    assert "-> torch from 8 rows" in caplog.text and "batches of 8+ rows on torch" in caplog.text
    assert not any(p.is_meta for p in model.embedder.encoder.parameters())  # kept for torch
    many = (SENTENCES * 3)[:9]
    assert model.preprocess({"TEXT": text_tensor(many)}).packed_ids is not None
    assert model.preprocess({"TEXT": text_tensor(SENTENCES)}).packed_ids is None
    ref = run_hooks(make_model(execution="torch"), many)
    np.testing.assert_allclose(run_hooks(model, many), ref, atol=1e-5)
    np.testing.assert_allclose(run_hooks(model, SENTENCES), ref[:4], atol=1e-5)
    # asked for by name, ONNX Runtime runs every batch and nothing is timed
    monkeypatch.setattr(text_embedding, "measured_times", None)
    only = make_model(execution="onnxruntime")
    assert only.embedder.torch_from_rows is None
    assert all(p.is_meta for p in only.embedder.encoder.parameters())


def test_release_torch_weights_needs_onnxruntime() -> None:
    embedder = SentenceEmbedder.load()
    with pytest.raises(RuntimeError, match="runs on torch"):
        embedder.release_torch_weights()
    assert embedder.encode(SENTENCES[:1]).shape == (1, 384)


def test_model_execution_errors_name_the_parameter(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"parameter 'execution': 'tvm'; expected one of auto, "):
        make_model(execution="tvm")
    pytest.importorskip("onnxruntime")
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    base = load_model_config(MODEL_DIR / "config.yaml")
    bf16 = base.model_copy(update={"precision": "bf16"})
    with pytest.raises(ValueError, match=r"onnxruntime runs precision fp32 or int8 on the CPU; "):
        make_model(bf16, execution="onnxruntime")
    int8 = base.model_copy(update={"precision": "int8"})
    with pytest.raises(ValueError, match=r"'execution': torch; precision int8 runs on ONNX Run"):
        make_model(int8, execution="torch")
    assert make_model(int8).embedder.execution == "onnxruntime"  # auto: int8 on ONNX Runtime
    with pytest.raises(ValueError, match=r"parameter 'unpadded': 'maybe'; expected true or false"):
        make_model(unpadded="maybe")


def test_model_execution_auto_falls_back_to_torch_when_onnxruntime_fails(monkeypatch, caplog):
    pytest.importorskip("onnxruntime")

    def broken(self: SentenceEmbedder, threads: int, cache: Any, int8_scheme: Any) -> None:
        raise ValueError("the ONNX Runtime graph disagrees with the torch encoder")

    monkeypatch.setattr(SentenceEmbedder, "use_onnxruntime", broken)
    with caplog.at_level("WARNING"):
        fallback = make_model()
    assert fallback.embedder.execution == "torch" and fallback.unpadded_batches is True
    assert "stays on torch: ONNX Runtime unusable (the ONNX Runtime graph disagrees" in caplog.text
    assert run_hooks(fallback, SENTENCES).shape == (len(SENTENCES), 384)
    with pytest.raises(ValueError, match="disagrees with the torch encoder"):
        make_model(execution="onnxruntime")  # asked for explicitly: the load fails


def test_model_says_which_execution_and_how_to_get_onnxruntime(monkeypatch, caplog) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else real(name)
    )
    with caplog.at_level("INFO"):
        model = make_model()
    assert model.embedder.execution == "torch"
    assert "text_embedding on torch (cpu, fp32) (1.1-1.7x faster on ONNX Runtime: pip install" in (
        caplog.text
    )
    caplog.clear()
    with caplog.at_level("INFO"):
        make_model(execution="torch")  # chosen: no hint
    assert "text_embedding on torch (cpu, fp32)\n" in caplog.text + "\n"
    assert "pip install" not in caplog.text
