"""Packed execution of transformers encoders (gpuserve.backends.hf_packed) against the padded
model's own forward: BERT, RoBERTa and XLM-RoBERTa, classification heads and pooled features,
rows of mixed lengths with segment ids, and the load-time choice of the huggingface backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from gpuserve.backends.hf_packed import PackedEncoder, PackedRows, unsupported  # noqa: E402
from gpuserve.backends.huggingface import _packed_runner  # noqa: E402
from gpuserve.errors import ConfigError  # noqa: E402

SIZES = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
    vocab_size=120,
    max_position_embeddings=64,
)
FAMILIES = {
    "bert": (transformers.BertConfig, transformers.BertForSequenceClassification),
    "roberta": (transformers.RobertaConfig, transformers.RobertaForSequenceClassification),
    "xlm-roberta": (
        transformers.XLMRobertaConfig,
        transformers.XLMRobertaForSequenceClassification,
    ),
}
LENGTHS = [5, 17, 1, 30, 9]


def build(family: str, labels: int, seed: int = 0):
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    extra = {"type_vocab_size": 2} if family == "bert" else {}
    config = config_cls(**SIZES, num_labels=labels, hidden_act="gelu", **extra)
    return model_cls(config).eval()


def rows_for(family: str, seed: int = 1) -> list[dict[str, list[int]]]:
    """Rows of LENGTHS tokens; BERT rows carry a second segment, RoBERTa rows hold a token
    equal to the padding id mid-row (its position id is then the padding one, as in
    transformers)."""
    gen = np.random.default_rng(seed)
    rows = []
    for n in LENGTHS:
        ids = gen.integers(3, SIZES["vocab_size"], n).tolist()
        row = {"input_ids": ids}
        if family == "bert":
            split = n // 2
            row["token_type_ids"] = [0] * split + [1] * (n - split)
        elif n > 3:
            ids[2] = 1  # RoBERTa's padding_idx
        rows.append(row)
    return rows


def padded(model, rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    pad = model.config.pad_token_id or 0
    width = max(len(r["input_ids"]) for r in rows)
    out: dict[str, torch.Tensor] = {
        "input_ids": torch.full((len(rows), width), pad, dtype=torch.int64),
        "attention_mask": torch.zeros((len(rows), width), dtype=torch.int64),
    }
    if "token_type_ids" in rows[0]:
        out["token_type_ids"] = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        out["input_ids"][i, :n] = torch.tensor(row["input_ids"])
        out["attention_mask"][i, :n] = 1
        if "token_type_ids" in out:
            out["token_type_ids"][i, :n] = torch.tensor(row["token_type_ids"])
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("labels", [1, 3])
def test_packed_logits_equal_the_padded_model(family, labels):
    model = build(family, labels)
    rows = rows_for(family)
    with torch.inference_mode():
        want = model(**padded(model, rows)).logits.numpy()
        runner = PackedEncoder.of(model, "sequence-classification")
        got = runner.logits(PackedRows.of(rows, pin=False), torch.device("cpu")).numpy()
        # query/key/value now share one fused weight: the padded model still answers the same
        again = model(**padded(model, rows)).logits.numpy()
    assert got.shape == (len(LENGTHS), labels)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(again, want, atol=1e-6)


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_bf16_on_the_cpu_runs_prepacked_and_keeps_the_logits(family):
    """At bf16 on a CPU the projections run on oneDNN's fused kernels: every layer packed
    (on a CPU without them, none, with the reason), logits within bf16 rounding of the same
    bf16 model's padded forward and of fp32."""
    from tests.unit.test_fused_linear import KERNELS_PROBLEM

    model = build(family, 2)
    rows = rows_for(family)
    with torch.inference_mode():
        fp32 = model(**padded(model, rows)).logits
        model = model.to(torch.bfloat16)
        want = model(**padded(model, rows)).logits.float()
        runner = PackedEncoder.of(model, "sequence-classification")
        got = runner.logits(PackedRows.of(rows, pin=False), torch.device("cpu"))
    packed = [m.packed for proj in runner.layers for m in proj.children()]
    if KERNELS_PROBLEM is None:
        assert runner.prepack_problem is None and all(packed)
    else:
        assert runner.prepack_problem is not None and not any(packed)
    scale = float(fp32.abs().max())
    assert float((got - want).abs().max()) < 0.03 * scale
    assert float((got - fp32).abs().max()) < 0.03 * scale


def test_a_non_gelu_activation_is_applied_after_the_product():
    config_cls, model_cls = FAMILIES["bert"]
    torch.manual_seed(0)
    config = config_cls(**SIZES, num_labels=1, hidden_act="relu", type_vocab_size=2)
    model = model_cls(config).eval()
    rows = rows_for("bert")
    with torch.inference_mode():
        want = model(**padded(model, rows)).logits.numpy()
        runner = PackedEncoder.of(model, "sequence-classification")
        got = runner.logits(PackedRows.of(rows, pin=False), torch.device("cpu")).numpy()
    assert not runner.fused_gelu
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_packed_features_equal_pooled_hidden_states(family, pooling):
    config_cls, _ = FAMILIES[family]
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config_cls(**SIZES)).eval()
    rows = [{"input_ids": r["input_ids"]} for r in rows_for(family)]
    feeds = padded(model, rows)
    with torch.inference_mode():
        hidden = model(**feeds).last_hidden_state
        mask = feeds["attention_mask"].unsqueeze(-1).float()
        want = hidden[:, 0] if pooling == "cls" else (hidden * mask).sum(1) / mask.sum(1)
        runner = PackedEncoder.of(model, "feature-extraction")
        got = runner.pooled(PackedRows.of(rows, pin=False), torch.device("cpu"), pooling)
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=2e-6, rtol=1e-5)


def test_unsupported_models_are_named():
    distil = transformers.DistilBertForSequenceClassification(
        transformers.DistilBertConfig(
            dim=32, n_layers=1, n_heads=4, hidden_dim=48, vocab_size=120, max_position_embeddings=64
        )
    )
    assert "distilbert" in unsupported(distil, "sequence-classification")
    masked = transformers.BertForMaskedLM(transformers.BertConfig(**SIZES))
    assert "sparse-embedding" in unsupported(masked, "sparse-embedding")
    assert unsupported(build("bert", 1), "sequence-classification") is None


def test_the_backend_packs_on_the_cpu_by_default_and_refuses_what_it_cannot_pack():
    cpu = torch.device("cpu")
    bert = build("bert", 1)
    assert isinstance(
        _packed_runner(bert, "sequence-classification", "auto", cpu, "longest"), PackedEncoder
    )
    assert _packed_runner(bert, "sequence-classification", False, cpu, "longest") is None
    assert _packed_runner(bert, "sequence-classification", "auto", cpu, "max_length") is None
    assert (
        _packed_runner(bert, "sequence-classification", "auto", torch.device("meta"), "longest")
        is None
    )
    masked = transformers.BertForMaskedLM(transformers.BertConfig(**SIZES))
    assert _packed_runner(masked, "sparse-embedding", "auto", cpu, "longest") is None
    with pytest.raises(ConfigError, match="unpadded: true.*sparse-embedding"):
        _packed_runner(masked, "sparse-embedding", True, cpu, "longest")
