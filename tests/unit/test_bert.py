"""gpuserve.models.bert: config, checkpoint loading, encoder numerics and pooling.

Fast tests use a tiny random checkpoint written in Hugging Face's key layout and an
independent, naive reference forward written here. Tests marked slow compare the real
all-MiniLM-L6-v2 against sentence-transformers and transformers (their imports take seconds).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from gpuserve.models.bert import (
    BertConfig,
    BertEncoder,
    CheckpointError,
    load_bert,
    mean_pool_normalize,
)
from gpuserve.models.sentence_embedding import SentenceEmbedder, default_model_dir

TINY = {
    "architectures": ["BertModel"],
    "model_type": "bert",
    "vocab_size": 50,
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 32,
    "max_position_embeddings": 24,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "hidden_act": "gelu",
    "position_embedding_type": "absolute",
    "hidden_dropout_prob": 0.1,
}

SENTENCES = [
    "Hello world.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps on a warm windowsill.",
    "GPU",
    "Ünïcödé text with émojis 🚀 and 中文字符, to exercise the tokenizer's odd paths.",
]


def tiny_state(cfg: dict = TINY, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with the key names of a Hugging Face ``BertModel`` checkpoint."""
    gen = torch.Generator().manual_seed(seed)
    h, inner = cfg["hidden_size"], cfg["intermediate_size"]

    def rnd(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    state = {
        "embeddings.word_embeddings.weight": rnd(cfg["vocab_size"], h),
        "embeddings.position_embeddings.weight": rnd(cfg["max_position_embeddings"], h),
        "embeddings.token_type_embeddings.weight": rnd(cfg["type_vocab_size"], h),
        "embeddings.LayerNorm.weight": 1 + rnd(h, scale=0.1),
        "embeddings.LayerNorm.bias": rnd(h, scale=0.1),
        "embeddings.position_ids": torch.arange(cfg["max_position_embeddings"])[None],
        "pooler.dense.weight": rnd(h, h),
        "pooler.dense.bias": rnd(h),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        for name in ("query", "key", "value"):
            state[f"{p}attention.self.{name}.weight"] = rnd(h, h)
            state[f"{p}attention.self.{name}.bias"] = rnd(h, scale=0.1)
        state[f"{p}attention.output.dense.weight"] = rnd(h, h)
        state[f"{p}attention.output.dense.bias"] = rnd(h, scale=0.1)
        state[f"{p}attention.output.LayerNorm.weight"] = 1 + rnd(h, scale=0.1)
        state[f"{p}attention.output.LayerNorm.bias"] = rnd(h, scale=0.1)
        state[f"{p}intermediate.dense.weight"] = rnd(inner, h)
        state[f"{p}intermediate.dense.bias"] = rnd(inner, scale=0.1)
        state[f"{p}output.dense.weight"] = rnd(h, inner)
        state[f"{p}output.dense.bias"] = rnd(h, scale=0.1)
        state[f"{p}output.LayerNorm.weight"] = 1 + rnd(h, scale=0.1)
        state[f"{p}output.LayerNorm.bias"] = rnd(h, scale=0.1)
    return state


def write_checkpoint(folder: Path, state: dict[str, torch.Tensor], cfg: dict = TINY) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


def reference_forward(
    state: dict[str, torch.Tensor],
    cfg: dict,
    ids: torch.Tensor,
    mask: torch.Tensor,
    token_type_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Textbook BERT in float64: separate q/k/v, explicit softmax, -inf on padded keys."""
    s = {k: v.double() for k, v in state.items() if v.is_floating_point()}
    h, heads, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg["layer_norm_eps"]
    d = h // heads
    b, seq = ids.shape
    tt = torch.zeros_like(ids) if token_type_ids is None else token_type_ids

    def ln(x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.layer_norm(x, (h,), s[prefix + ".weight"], s[prefix + ".bias"], eps)

    def lin(x: torch.Tensor, prefix: str) -> torch.Tensor:
        return x @ s[prefix + ".weight"].T + s[prefix + ".bias"]

    x = (
        s["embeddings.word_embeddings.weight"][ids]
        + s["embeddings.position_embeddings.weight"][torch.arange(seq)][None]
        + s["embeddings.token_type_embeddings.weight"][tt]
    )
    x = ln(x, "embeddings.LayerNorm")
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, seq, heads, d).transpose(1, 2)

        q = split(lin(x, p + "attention.self.query"))
        k = split(lin(x, p + "attention.self.key"))
        v = split(lin(x, p + "attention.self.value"))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        scores = scores.masked_fill(mask[:, None, None, :] == 0, float("-inf"))
        ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, seq, h)
        x = ln(x + lin(ctx, p + "attention.output.dense"), p + "attention.output.LayerNorm")
        inner = lin(x, p + "intermediate.dense")
        inner = 0.5 * inner * (1 + torch.erf(inner / math.sqrt(2)))
        x = ln(x + lin(inner, p + "output.dense"), p + "output.LayerNorm")
    return x


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "tiny", tiny_state())


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """ids/mask int64 [3, 9]: lengths 9, 4 and 6, padded with id 0."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, TINY["vocab_size"], (3, 9), generator=gen)
    mask = torch.ones(3, 9, dtype=torch.int64)
    mask[1, 4:] = 0
    mask[2, 6:] = 0
    return ids.masked_fill(mask == 0, 0), mask


# --- config ---------------------------------------------------------------------------------


def test_config_reads_hf_json_and_ignores_unused_keys(tiny_dir: Path) -> None:
    config = BertConfig.from_file(tiny_dir / "config.json")
    assert config.hidden_size == 16
    assert config.num_hidden_layers == 2
    assert config.head_size == 4
    assert config.layer_norm_eps == 1e-12


def test_config_real_model() -> None:
    config = BertConfig.from_file(default_model_dir() / "config.json")
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (
        384,
        6,
        12,
    )
    assert (config.intermediate_size, config.vocab_size) == (1536, 30522)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
        ({"hidden_act": "relu"}, "hidden_act"),
        ({"num_attention_heads": 5}, "not a multiple"),
        ({"hidden_size": None}, "required keys"),
    ],
)
def test_config_rejects_unsupported(change: dict, message: str) -> None:
    data = {**TINY, **change}
    data = {k: v for k, v in data.items() if v is not None}
    with pytest.raises(CheckpointError, match=message):
        BertConfig.from_dict(data)


# --- loading --------------------------------------------------------------------------------


def test_load_bert_eval_mode_frozen_dtype(tiny_dir: Path) -> None:
    model = load_bert(tiny_dir, dtype=torch.bfloat16)
    assert isinstance(model, BertEncoder)
    assert not model.training
    params = list(model.parameters())
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in params)
    assert all(p.device.type == "cpu" for p in params)


def test_load_bert_fuses_qkv_in_query_key_value_order(tiny_dir: Path) -> None:
    state = tiny_state()
    model = load_bert(tiny_dir)
    qkv = model.layers[1].qkv.weight
    p = "encoder.layer.1.attention.self."
    torch.testing.assert_close(qkv[:16], state[p + "query.weight"])
    torch.testing.assert_close(qkv[16:32], state[p + "key.weight"])
    torch.testing.assert_close(qkv[32:], state[p + "value.weight"])


def test_load_bert_accepts_bert_prefix(tmp_path: Path) -> None:
    state = {f"bert.{k}": v for k, v in tiny_state().items()}
    model = load_bert(write_checkpoint(tmp_path / "prefixed", state))
    ids, mask = padded_batch()
    expected = load_bert(write_checkpoint(tmp_path / "plain", tiny_state()))(ids, mask)
    torch.testing.assert_close(model(ids, mask), expected)


def test_load_bert_missing_key_is_an_error(tmp_path: Path) -> None:
    state = tiny_state()
    del state["encoder.layer.1.attention.self.key.bias"]
    with pytest.raises(CheckpointError, match=r"missing keys \[encoder\.layer\.1\.attention"):
        load_bert(write_checkpoint(tmp_path / "m", state))


def test_load_bert_unexpected_key_is_an_error(tmp_path: Path) -> None:
    state = tiny_state()
    state["classifier.weight"] = torch.zeros(2, 16)
    with pytest.raises(CheckpointError, match=r"unexpected keys \[classifier\.weight\]"):
        load_bert(write_checkpoint(tmp_path / "u", state))


def test_load_bert_extra_layer_is_unexpected(tmp_path: Path) -> None:
    state = tiny_state({**TINY, "num_hidden_layers": 3})
    with pytest.raises(CheckpointError, match=r"encoder\.layer\.2\."):
        load_bert(write_checkpoint(tmp_path / "x", state, TINY))


def test_load_bert_pooler_and_position_ids_are_optional(tmp_path: Path) -> None:
    state = {k: v for k, v in tiny_state().items() if not k.startswith("pooler.")}
    del state["embeddings.position_ids"]
    load_bert(write_checkpoint(tmp_path / "p", state))


def test_load_bert_wrong_shape_is_an_error(tmp_path: Path) -> None:
    state = tiny_state()
    state["encoder.layer.0.intermediate.dense.weight"] = torch.zeros(31, 16)
    with pytest.raises(CheckpointError, match=r"ffn_in\.weight: \(31, 16\)"):
        load_bert(write_checkpoint(tmp_path / "s", state))


def test_load_bert_missing_files(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"config\.json"):
        load_bert(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: no such file"):
        load_bert(tmp_path)


# --- numerics on the tiny model ------------------------------------------------------------


def test_encoder_matches_naive_reference_on_padded_batch(tiny_dir: Path) -> None:
    model = load_bert(tiny_dir)
    ids, mask = padded_batch()
    with torch.inference_mode():
        ours = model(ids, mask)
    ref = reference_forward(tiny_state(), TINY, ids, mask).float()
    assert ours.shape == (3, 9, 16) and ours.dtype == torch.float32
    real = mask.bool()
    torch.testing.assert_close(ours[real], ref[real], atol=1e-5, rtol=1e-5)


def test_encoder_token_type_ids(tiny_dir: Path) -> None:
    model = load_bert(tiny_dir)
    ids, mask = padded_batch()
    tt = torch.zeros_like(ids)
    tt[:, 3:] = 1
    ref = reference_forward(tiny_state(), TINY, ids, mask, tt).float()
    ours = model(ids, mask, tt)
    torch.testing.assert_close(ours[mask.bool()], ref[mask.bool()], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model(ids, mask, torch.zeros_like(ids)), model(ids, mask))


def test_padding_does_not_change_real_tokens(tiny_dir: Path) -> None:
    model = load_bert(tiny_dir)
    ids, mask = padded_batch()
    batched = model(ids, mask)
    alone = model(ids[1:2, :4])  # row 1 has 4 real tokens
    torch.testing.assert_close(batched[1:2, :4], alone, atol=1e-5, rtol=1e-5)


def test_all_ones_mask_equals_no_mask(tiny_dir: Path) -> None:
    model = load_bert(tiny_dir)
    ids, _ = padded_batch()
    ones = torch.ones_like(ids)
    torch.testing.assert_close(model(ids, ones), model(ids, None))
    ref = reference_forward(tiny_state(), TINY, ids, ones).float()
    torch.testing.assert_close(model(ids, None), ref, atol=1e-5, rtol=1e-5)


def test_row_without_real_tokens_stays_finite(tiny_dir: Path) -> None:
    model = load_bert(tiny_dir)
    ids, mask = padded_batch()
    mask[2] = 0
    out = model(ids, mask)
    assert torch.isfinite(out).all()
    pooled = mean_pool_normalize(out, mask)
    assert torch.isfinite(pooled).all()


def test_sequence_longer_than_positions_is_refused(tiny_dir: Path) -> None:
    model = load_bert(tiny_dir)
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=24"):
        model(torch.ones(1, 25, dtype=torch.int64))


# --- pooling --------------------------------------------------------------------------------


def test_mean_pool_normalize_by_hand() -> None:
    hidden = torch.tensor(
        [[[1.0, 0.0], [3.0, 4.0], [100.0, 100.0]], [[0.0, 2.0], [0.0, 2.0], [0.0, 2.0]]]
    )
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    out = mean_pool_normalize(hidden, mask)
    # row 0: mean of the first two tokens = (2, 2) -> (1/sqrt2, 1/sqrt2); row 1: (0, 1).
    expected = torch.tensor([[1 / math.sqrt(2), 1 / math.sqrt(2)], [0.0, 1.0]])
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(mean_pool_normalize(hidden[1:], None), expected[1:])


def test_mean_pool_normalize_is_float32_for_half_inputs() -> None:
    hidden = torch.randn(2, 5, 8)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    ref = mean_pool_normalize(hidden, mask)
    for dtype in (torch.float16, torch.bfloat16):
        out = mean_pool_normalize(hidden.to(dtype), mask)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)


def test_mean_pool_all_masked_row_is_zero_not_nan() -> None:
    out = mean_pool_normalize(torch.randn(1, 3, 4), torch.zeros(1, 3, dtype=torch.int64))
    assert torch.equal(out, torch.zeros(1, 4))


# --- the real model -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedder() -> SentenceEmbedder:
    return SentenceEmbedder.load()


def test_real_model_half_precision_close_to_fp32(embedder: SentenceEmbedder) -> None:
    ref = embedder.encode(SENTENCES)
    for dtype in (torch.bfloat16, torch.float16):
        try:
            low = SentenceEmbedder.load(dtype=dtype).encode(SENTENCES)
        except RuntimeError as err:  # an op without a CPU kernel for this dtype
            if dtype is torch.float16:
                pytest.skip(f"fp16 unsupported on this CPU build: {err}")
            raise
        assert low.dtype == np.float32
        cosine = (ref * low).sum(axis=1)
        assert cosine.min() >= 0.99, (dtype, cosine)


@pytest.fixture(scope="module")
def sentence_transformer():  # type: ignore[no-untyped-def]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(str(default_model_dir()), device="cpu")


@pytest.mark.slow
def test_matches_sentence_transformers(
    embedder: SentenceEmbedder, sentence_transformer: object
) -> None:
    assert embedder.max_seq_len == sentence_transformer.max_seq_length  # type: ignore[attr-defined]
    # One padded batch: lengths differ, so every short row carries padding.
    batch = embedder.tokenize(SENTENCES)
    assert batch.padded
    ours = embedder.embed(batch).numpy()
    ref = sentence_transformer.encode(  # type: ignore[attr-defined]
        SENTENCES, batch_size=len(SENTENCES), convert_to_numpy=True
    )
    cosine = (ours * ref).sum(axis=1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    assert cosine.min() >= 0.9999, cosine
    assert np.abs(ours - ref).max() < 1e-5


@pytest.mark.slow
def test_matches_transformers_bert_model(embedder: SentenceEmbedder) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    hf = transformers.BertModel.from_pretrained(str(default_model_dir())).eval()
    batch = embedder.tokenize(SENTENCES)
    with torch.inference_mode():
        ref = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        ours = embedder.encoder(batch.input_ids, batch.attention_mask)
    assert ours.shape == ref.shape
    real = batch.attention_mask.bool()
    torch.testing.assert_close(ours[real], ref[real], atol=1e-4, rtol=1e-4)
    # Unpadded batch: the encoder drops the mask; still identical.
    ids = batch.input_ids[1:2]
    with torch.inference_mode():
        torch.testing.assert_close(
            embedder.encoder(ids), hf(input_ids=ids).last_hidden_state, atol=1e-4, rtol=1e-4
        )
