"""The ``huggingface`` backend on its own (no server): config auto-completion from
``config.json``, feature extraction against sentence-transformers and the in-house encoder,
sequence classification against transformers' own forward, and per-row errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from gpuserve.backends.base import LoadContext, RowErrors
from gpuserve.backends.huggingface import HuggingFaceBackend, read_folder
from gpuserve.config import ModelConfig
from gpuserve.errors import ConfigError, InvalidInputError
from tests.fixtures.hf_models import LABELS, minilm_dir, reference_logits, write_tiny_classifier

pytest.importorskip("transformers")

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A fast auburn fox leaps above a sleepy hound.",
    "gpuserve batches requests dynamically.",
    "Ünïcödé text, emoji 🚀 and punctuation!?",
    "short",
]


def make_config(**fields: object) -> ModelConfig:
    return ModelConfig.model_validate({"name": "hf", "backend": "huggingface", **fields})


def text_tensor(texts: list[str]) -> np.ndarray:
    return np.array([[t.encode()] for t in texts], dtype=object)


def load(config: ModelConfig, version_path: Path) -> HuggingFaceBackend:
    config = HuggingFaceBackend.complete_config(config, version_path)
    backend = HuggingFaceBackend()
    backend.load(LoadContext(config=config, version_path=version_path, version=1))
    return backend


def run(backend: HuggingFaceBackend, texts: list[str]) -> dict[str, np.ndarray]:
    return backend.postprocess(backend.forward(backend.preprocess({"TEXT": text_tensor(texts)})))


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory) -> Path:
    return write_tiny_classifier(tmp_path_factory.mktemp("classifier") / "1")


@pytest.fixture(scope="module")
def minilm_backend(tmp_path_factory) -> HuggingFaceBackend:
    version = tmp_path_factory.mktemp("minilm") / "1"
    version.mkdir()
    return load(make_config(huggingface={"model_dir": str(minilm_dir())}), version)


# --- config auto-completion (JSON only, no model load) --------------------------------------


def test_feature_extraction_io_is_read_from_config_json(tmp_path):
    config = make_config(huggingface={"model_dir": str(minilm_dir())})
    done = HuggingFaceBackend.complete_config(config, tmp_path / "1")
    assert [(t.name, t.datatype, t.shape) for t in done.inputs] == [("TEXT", "BYTES", [1])]
    assert [(t.name, t.datatype, t.shape) for t in done.outputs] == [("EMBEDDING", "FP32", [384])]


def test_sentence_transformers_files_set_pooling_and_length():
    info = read_folder(minilm_dir())
    assert (info.st_pooling, info.st_normalize, info.st_max_seq_length) == ("mean", True, 256)


def test_classification_io_names_labels(tmp_path):
    version = tmp_path / "1"
    version.mkdir()
    (version / "config.json").write_text(
        json.dumps({"hidden_size": 8, "id2label": {"0": "no", "1": "yes"}})
    )
    config = make_config(huggingface={"task": "sequence-classification"})
    done = HuggingFaceBackend.complete_config(config, version)
    assert [(t.name, t.datatype, t.shape) for t in done.outputs] == [
        ("LOGITS", "FP32", [2]),
        ("LABEL", "BYTES", [1]),
    ]
    assert read_folder(version).labels == ["no", "yes"]
    # Declaring the optional PROBABILITIES output (and a subset) is accepted as is.
    declared = make_config(
        huggingface={"task": "sequence-classification"},
        inputs=[{"name": "SENTENCE", "datatype": "BYTES", "shape": [1]}],
        outputs=[{"name": "PROBABILITIES", "datatype": "FP32", "shape": [2]}],
    )
    assert HuggingFaceBackend.complete_config(declared, version) is declared


def test_declarations_that_disagree_name_both_values(tmp_path):
    config = make_config(
        huggingface={"model_dir": str(minilm_dir())},
        inputs=[{"name": "TEXT", "datatype": "INT64", "shape": [-1]}],
        outputs=[
            {"name": "EMBEDDING", "datatype": "FP32", "shape": [768]},
            {"name": "LOGITS", "datatype": "FP32", "shape": [2]},
        ],
    )
    with pytest.raises(ConfigError) as err:
        HuggingFaceBackend.complete_config(config, tmp_path / "1")
    message = err.value.message
    assert "config declares [TEXT INT64 [-1]], the model takes [TEXT BYTES [1]]" in message
    assert "output 'EMBEDDING': config declares FP32 [768], the model gives FP32 [384]" in message
    assert "output 'LOGITS': task 'feature-extraction' produces only ['EMBEDDING']" in message


def test_missing_folder_and_unbatched_configs_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="needs a transformers folder"):
        HuggingFaceBackend.complete_config(make_config(), tmp_path / "1")
    unbatched = make_config(max_batch_size=0, huggingface={"model_dir": str(minilm_dir())})
    with pytest.raises(ConfigError, match="max_batch_size"):
        HuggingFaceBackend.complete_config(unbatched, tmp_path / "1")


# --- feature extraction -----------------------------------------------------------------------


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_feature_extraction_matches_the_in_house_encoder(minilm_backend):
    from gpuserve.models.sentence_embedding import SentenceEmbedder

    got = run(minilm_backend, SENTENCES)["EMBEDDING"]
    assert got.shape == (len(SENTENCES), 384) and got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    expected = SentenceEmbedder.load(minilm_dir()).encode(SENTENCES)
    assert cosines(got, expected).min() > 0.9999


def test_feature_extraction_matches_sentence_transformers(minilm_backend):
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(minilm_dir()), device="cpu", local_files_only=True)
    expected = model.encode(SENTENCES, convert_to_numpy=True)
    got = run(minilm_backend, SENTENCES)["EMBEDDING"]
    assert cosines(got, expected).min() > 0.9999


def test_a_row_embeds_the_same_alone_and_in_a_padded_batch(minilm_backend):
    batch = run(minilm_backend, SENTENCES)["EMBEDDING"]
    alone = run(minilm_backend, SENTENCES[-1:])["EMBEDDING"]
    np.testing.assert_allclose(batch[-1:], alone, atol=1e-5)


def test_cls_pooling_without_normalisation(tmp_path):
    version = tmp_path / "1"
    version.mkdir()
    backend = load(
        make_config(
            huggingface={"model_dir": str(minilm_dir()), "pooling": "cls", "normalize": False}
        ),
        version,
    )
    import torch

    got = run(backend, SENTENCES[:2])["EMBEDDING"]
    batch = backend.tokenizer(SENTENCES[:2], padding=True, return_tensors="pt")
    with torch.inference_mode():
        expected = backend.model(**batch).last_hidden_state[:, 0].numpy()
    np.testing.assert_allclose(got, expected, atol=1e-5)


# --- sequence classification -----------------------------------------------------------------


def test_classification_equals_transformers_forward(classifier_dir):
    config = make_config(
        huggingface={"task": "sequence-classification"},
        outputs=[
            {"name": "LOGITS", "datatype": "FP32", "shape": [3]},
            {"name": "PROBABILITIES", "datatype": "FP32", "shape": [3]},
            {"name": "LABEL", "datatype": "BYTES", "shape": [1]},
        ],
    )
    backend = load(config, classifier_dir)
    out = run(backend, SENTENCES)
    assert out["LOGITS"].shape == (5, 3) and out["LOGITS"].dtype == np.float32
    assert out["LABEL"].shape == (5, 1) and out["LABEL"].dtype == object
    expected = reference_logits(classifier_dir, SENTENCES)
    np.testing.assert_allclose(out["LOGITS"], expected, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(out["PROBABILITIES"].sum(axis=1), 1.0, atol=1e-6)
    names = [LABELS[i].encode() for i in expected.argmax(axis=1)]
    assert out["LABEL"][:, 0].tolist() == names


def test_bf16_on_a_cpu_needs_the_instruction_set(classifier_dir, monkeypatch):
    """The huggingface backend refuses bf16 on a CPU without bf16 dot products, as every CPU
    execution does (emulated bf16 is many times slower than fp32), and runs it where the
    cores have them, with logits within bf16 rounding of fp32's."""
    from gpuserve.backends import cpu_features

    config = make_config(
        precision="bf16",
        huggingface={"task": "sequence-classification"},
        outputs=[{"name": "LOGITS", "datatype": "FP32", "shape": [3]}],
    )
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    with pytest.raises(ValueError, match=r"AVX-512 BF16 or AMX-BF16.*avx512_bf16"):
        load(config, classifier_dir)
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    out = run(load(config, classifier_dir), SENTENCES)
    expected = reference_logits(classifier_dir, SENTENCES)
    assert out["LOGITS"].dtype == np.float32
    np.testing.assert_allclose(out["LOGITS"], expected, atol=0.03 * np.abs(expected).max())


def test_rows_over_max_length_fail_alone_without_truncation(classifier_dir):
    config = make_config(
        huggingface={"task": "sequence-classification", "max_length": 8, "truncation": False}
    )
    backend = load(config, classifier_dir)
    texts = ["short text", "this sentence has far more than eight tokens in it, surely", "ok"]
    out = run(backend, texts)
    assert isinstance(out, RowErrors)
    assert list(out.errors) == [1]
    assert isinstance(out.errors[1], InvalidInputError)
    assert "more than max_length 8" in out.errors[1].message
    expected = reference_logits(classifier_dir, [texts[0], texts[2]])
    np.testing.assert_allclose(out["LOGITS"][[0, 2]], expected, atol=1e-5, rtol=1e-5)


def test_a_folder_without_a_fast_tokenizer_is_refused(tmp_path, classifier_dir):
    version = tmp_path / "1"
    shutil.copytree(classifier_dir, version)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        (version / name).unlink(missing_ok=True)
    with pytest.raises(ConfigError, match="tokenizer"):
        load(make_config(huggingface={"task": "sequence-classification"}), version)
