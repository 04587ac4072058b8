"""Packed execution of a transformers encoder: batches run on their real tokens only.

A padded batch of B rows of up to L tokens costs ``B x L`` tokens in every projection and
``B x L^2`` in attention, whatever the rows' lengths; on a CPU that is the whole cost. This
module runs the ``huggingface`` backend's BERT, RoBERTa and XLM-RoBERTa models (the families
of most cross-encoders, classifiers and sentence encoders) with the rows back to back: the
projections and the feed-forward block on the T real tokens, attention per row over its own
tokens (:mod:`gpuserve.backends.packing`). It computes with the loaded model's own modules
(weights, LayerNorms, activation, pooler and classifier head), so outputs equal the padded
model's up to floating-point reassociation; only query, key and value are fused into one
projection, their parameters becoming views of the fused weight (no second copy). At bf16 on
a CPU the projections run on oneDNN's prepacked kernels with the GELU and the residual adds
fused (:mod:`gpuserve.backends.fused_linear`).

Measured on one core (``python benchmarks/rerank.py --layers 2 --padded``: a 2-layer, 384-wide
cross-encoder, 100 passages of 60-200 words per call): served 1.25-1.45x the padded model at
1-32 concurrent calls, scores equal within 2e-8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gpuserve.backends.fused_linear import FusedLinear, prepack_all, prepack_refusal, row_padded
from gpuserve.backends.packing import Packing, mean_pool_packed, packed_attention

#: ``config.model_type`` of the families this module runs, and the attribute of the task
#: model holding the encoder (``model.bert`` / ``model.roberta``).
FAMILIES = {"bert": "bert", "roberta": "roberta", "xlm-roberta": "roberta"}
#: The sequence-classification heads this module reproduces, by family.
_HEADS = {"bert": "BertForSequenceClassification", "roberta": "ForSequenceClassification"}


@dataclass(frozen=True, slots=True)
class PackedRows:
    """Rows of token ids back to back (the CPU stage's output for packed execution).

    Attributes:
        input_ids: int64 [T], every row's tokens in order.
        token_type_ids: int64 [T] segment ids, or None (segment 0 everywhere).
        lengths: The B row lengths, tokens (each >= 1), summing to T.
    """

    input_ids: torch.Tensor
    token_type_ids: torch.Tensor | None
    lengths: tuple[int, ...]

    @classmethod
    def of(cls, rows: list[dict[str, list[int]]], pin: bool) -> PackedRows:
        """Pack tokenised rows (``input_ids`` and, when present, ``token_type_ids`` lists)."""
        ids = torch.tensor([t for row in rows for t in row["input_ids"]], dtype=torch.int64)
        types = None
        if rows and "token_type_ids" in rows[0]:
            types = torch.tensor(
                [t for row in rows for t in row["token_type_ids"]], dtype=torch.int64
            )
        if pin:
            ids = ids.pin_memory()
            types = types.pin_memory() if types is not None else None
        return cls(ids, types, tuple(len(row["input_ids"]) for row in rows))


def unsupported(model: Any, task: str) -> str | None:
    """Why ``model`` cannot run packed for ``task`` (None: it can).

    Args:
        model: The loaded transformers model (``AutoModel`` for ``feature-extraction``,
            ``AutoModelForSequenceClassification`` for ``sequence-classification``).
        task: The backend's task.
    """
    config = model.config
    family = FAMILIES.get(getattr(config, "model_type", ""))
    if family is None:
        return f"model_type {config.model_type!r} (packed execution covers {sorted(FAMILIES)})"
    if task not in ("feature-extraction", "sequence-classification"):
        return f"task {task!r}"
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        return "a decoder model"
    if getattr(config, "position_embedding_type", "absolute") not in (None, "absolute"):
        return f"position_embedding_type {config.position_embedding_type!r}"
    if task == "sequence-classification" and not type(model).__name__.endswith(_HEADS[family]):
        return f"head {type(model).__name__}"
    return None


class PackedEncoder:
    """Runs a transformers BERT/RoBERTa model on :class:`PackedRows` (see the module
    docstring). Build it with :meth:`of` after the model is on its device and in its dtype."""

    def __init__(self, model: Any, task: str) -> None:
        family = FAMILIES[model.config.model_type]
        self.model = model
        self.task = task
        self.encoder = getattr(model, family) if task == "sequence-classification" else model
        self.family = family
        embeddings = self.encoder.embeddings
        self.padding_idx = embeddings.padding_idx if family == "roberta" else None
        self.heads = int(model.config.num_attention_heads)
        self.head_size = int(model.config.hidden_size) // self.heads
        self.layers = [_projections(layer) for layer in self.encoder.encoder.layer]
        #: the feed-forward activation is exact GELU, which the fused kernels apply
        self.fused_gelu = getattr(model.config, "hidden_act", None) == "gelu"
        self.prepack_problem: str | None = None
        weight = self.layers[0].qkv.weight if self.layers else None
        if weight is not None and prepack_refusal(weight) is None:
            self.prepack_problem = prepack_all(torch.nn.ModuleList(self.layers))

    @classmethod
    def of(cls, model: Any, task: str) -> PackedEncoder:
        """The packed runner of ``model``; raises ``ValueError`` naming why it cannot be."""
        reason = unsupported(model, task)
        if reason is not None:
            raise ValueError(f"packed execution does not cover {reason}")
        return cls(model, task)

    def hidden(self, rows: PackedRows, device: torch.device) -> tuple[torch.Tensor, Packing]:
        """The last hidden state of the real tokens: [T, H] in the model's dtype."""
        ids = rows.input_ids.to(device, non_blocking=True)
        packing = Packing.of(rows.lengths, device)
        emb = self.encoder.embeddings
        x = emb.word_embeddings(ids)
        if rows.token_type_ids is not None:
            x = x + emb.token_type_embeddings(rows.token_type_ids.to(device, non_blocking=True))
        else:
            x = x + emb.token_type_embeddings.weight[0]
        x = emb.LayerNorm(x + emb.position_embeddings(self._positions(ids, packing)))
        real = x.shape[0]
        if self.layers and self.layers[0].qkv.packed:  # pad once, not in every projection
            x = row_padded(x)
        tokens, width = x.shape
        for layer, proj in zip(self.encoder.encoder.layer, self.layers, strict=True):
            qkv = proj.qkv(x).view(tokens, 3, self.heads, self.head_size)
            ctx = packed_attention(qkv, packing).reshape(tokens, width)
            x = layer.attention.output.LayerNorm(proj.attn_out.forward_add(ctx, x))
            if self.fused_gelu:
                inner = proj.ffn_in.forward_gelu(x)
            else:
                inner = layer.intermediate.intermediate_act_fn(proj.ffn_in(x))
            x = layer.output.LayerNorm(proj.ffn_out.forward_add(inner, x))
        return x[:real], packing

    def logits(self, rows: PackedRows, device: torch.device) -> torch.Tensor:
        """Sequence classification: float32 [B, num_labels], as the model's ``logits``."""
        hidden, packing = self.hidden(rows, device)
        first = hidden[packing.offsets[:-1]].unsqueeze(1)  # [B, 1, H]: each row's first token
        if self.family == "bert":
            return self.model.classifier(self.encoder.pooler(first)).float()
        return self.model.classifier(first).float()  # RoBERTa's head reads x[:, 0]

    def pooled(self, rows: PackedRows, device: torch.device, pooling: str) -> torch.Tensor:
        """Feature extraction: float32 [B, H], masked mean (``mean``) or first token (``cls``),
        not normalised."""
        hidden, packing = self.hidden(rows, device)
        if pooling == "cls":
            return hidden[packing.offsets[:-1]].float()
        return mean_pool_packed(hidden, packing, normalize=False)

    def _positions(self, ids: torch.Tensor, packing: Packing) -> torch.Tensor:
        """Each token's position id: its index in its row (BERT); RoBERTa counts from
        ``padding_idx + 1`` over tokens that are not the padding id, as transformers does."""
        if self.padding_idx is None:
            return packing.positions
        real = (ids != self.padding_idx).to(torch.int64)
        counts = torch.cumsum(real, 0)
        starts = torch.repeat_interleave(
            counts[packing.offsets[:-1]] - real[packing.offsets[:-1]],
            torch.tensor(packing.lengths, device=ids.device),
            output_size=ids.shape[0],
        )
        return (counts - starts) * real + self.padding_idx


class _Projections(torch.nn.Module):
    """One layer's four projections over the model's own parameters (no copy)."""

    def __init__(self, qkv: FusedLinear, attn_out: Any, ffn_in: Any, ffn_out: Any) -> None:
        super().__init__()
        self.qkv = qkv
        self.attn_out = FusedLinear.sharing(attn_out.weight, attn_out.bias)
        self.ffn_in = FusedLinear.sharing(ffn_in.weight, ffn_in.bias)
        self.ffn_out = FusedLinear.sharing(ffn_out.weight, ffn_out.bias)


def _projections(layer: Any) -> _Projections:
    weight, bias = _fuse_qkv(layer.attention.self)
    return _Projections(
        FusedLinear.sharing(weight, bias),
        layer.attention.output.dense,
        layer.intermediate.dense,
        layer.output.dense,
    )


def _fuse_qkv(attention: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Query, key and value as one [3H, H] projection; the three modules' parameters become
    views of it, so the model keeps working and holds no second copy."""
    parts = (attention.query, attention.key, attention.value)
    weight = torch.cat([p.weight.detach() for p in parts], dim=0)
    bias = torch.cat([p.bias.detach() for p in parts], dim=0)
    size = parts[0].weight.shape[0]
    for i, module in enumerate(parts):
        module.weight = torch.nn.Parameter(weight[i * size : (i + 1) * size], requires_grad=False)
        module.bias = torch.nn.Parameter(bias[i * size : (i + 1) * size], requires_grad=False)
    return weight, bias


__all__ = ["FAMILIES", "PackedEncoder", "PackedRows", "unsupported"]
