"""A compact BERT encoder in plain PyTorch, loadable from a Hugging Face ``model.safetensors``.

Architecture: BERT (Devlin et al., 2019, "BERT: Pre-training of Deep Bidirectional
Transformers for Language Understanding"): token + absolute position + segment embeddings
followed by LayerNorm, then ``num_hidden_layers`` post-LayerNorm transformer layers
(multi-head self-attention, then a feed-forward block with exact erf GELU).

Why not ``transformers.BertModel``: importing ``transformers`` costs seconds and its per-call
Python overhead is large next to a small model such as all-MiniLM-L6-v2. This module has the
same numerics with less machinery: query, key and value are one fused projection (one GEMM
instead of three), attention is ``torch.nn.functional.scaled_dot_product_attention`` (flash /
memory-efficient kernels on GPU), and a batch without padding runs attention with no mask.

Only what inference needs is here: no dropout, no pooler, no decoder or cross-attention.
"""

from __future__ import annotations

import json
import logging
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from gpuserve.backends.fused_linear import PREPACK_DTYPES, FusedLinear, prepack_all, row_padded
from gpuserve.backends.packing import Packing, mean_pool_packed, packed_attention

__all__ = [
    "BertConfig",
    "BertEncoder",
    "CheckpointError",
    "Packing",
    "load_bert",
    "mean_pool_packed",
    "packed_attention",
]

logger = logging.getLogger(__name__)

CONFIG_FILENAME = "config.json"
WEIGHTS_FILENAME = "model.safetensors"

# Checkpoint keys that are present in Hugging Face BERT checkpoints but unused here.
_IGNORED_PREFIXES = ("pooler.",)
_IGNORED_KEYS = frozenset({"embeddings.position_ids"})


class CheckpointError(ValueError):
    """A BERT checkpoint or its config does not fit :class:`BertEncoder`."""


@dataclass(frozen=True, slots=True)
class BertConfig:
    """Shape of a BERT encoder, read from a Hugging Face ``config.json``.

    Attributes:
        vocab_size: Rows of the token embedding table.
        hidden_size: Width of every token vector (H).
        num_hidden_layers: Transformer layers.
        num_attention_heads: Heads per attention layer; must divide ``hidden_size``.
        intermediate_size: Width of the feed-forward block.
        max_position_embeddings: Longest sequence the position table covers, tokens.
        type_vocab_size: Rows of the segment (token type) embedding table.
        layer_norm_eps: Epsilon of every LayerNorm.
        hidden_act: Feed-forward activation; only ``"gelu"`` (exact, erf) is supported.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise CheckpointError(
                f"hidden_size={self.hidden_size} is not a multiple of "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.hidden_act != "gelu":
            raise CheckpointError(
                f"hidden_act={self.hidden_act!r} is not supported; only 'gelu' (exact) is"
            )

    @property
    def head_size(self) -> int:
        """Width of one attention head (``hidden_size // num_attention_heads``)."""
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BertConfig:
        """Build from a ``config.json`` mapping; keys this encoder does not use are ignored.

        Raises:
            CheckpointError: a required key is missing, or the config describes a variant
                this encoder does not implement (relative positions, another activation).
        """
        position_type = data.get("position_embedding_type", "absolute")
        if position_type != "absolute":
            raise CheckpointError(
                f"position_embedding_type={position_type!r} is not supported; only 'absolute' is"
            )
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        required = [f.name for f in fields(cls) if f.default is MISSING]
        missing = [name for name in required if name not in values]
        if missing:
            raise CheckpointError(f"BERT config lacks required keys: {missing}")
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | Path) -> BertConfig:
        """Read a Hugging Face ``config.json``.

        Raises:
            CheckpointError: see :meth:`from_dict`; also an unreadable or non-JSON file.
        """
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{path}: cannot read BERT config: {err}") from None
        if not isinstance(data, dict):
            raise CheckpointError(f"{path}: top level must be a JSON object")
        try:
            return cls.from_dict(data)
        except CheckpointError as err:
            raise CheckpointError(f"{path}: {err}") from None


def _embedding(num: int, dim: int, device: torch.device | str | None) -> nn.Embedding:
    if device is not None and torch.device(device).type == "meta":
        # Skip the random init: normal_ on a meta tensor imports torch._dynamo (~1.8 s), and
        # a meta tensor has no values to initialise anyway.
        return nn.Embedding.from_pretrained(torch.empty(num, dim, device=device), freeze=False)
    return nn.Embedding(num, dim, device=device)


class BertEmbeddings(nn.Module):
    """Token + absolute position + segment embeddings, then LayerNorm."""

    def __init__(self, config: BertConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = _embedding(config.vocab_size, hidden, device)
        self.position_embeddings = _embedding(config.max_position_embeddings, hidden, device)
        self.token_type_embeddings = _embedding(config.type_vocab_size, hidden, device)
        self.layer_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps, device=device)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        """input_ids: int64 [B, L]; token_type_ids: int64 [B, L] or None (all segment 0).

        Returns: [B, L, H] in the parameters' dtype.
        """
        seq_len = input_ids.shape[1]
        x = self.word_embeddings(input_ids)
        if token_type_ids is None:
            # Segment 0 everywhere: one broadcast row instead of a [B, L] gather.
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings.weight[:seq_len]
        return self.layer_norm(x)


class BertLayer(nn.Module):
    """One post-LayerNorm transformer layer: self-attention, then feed-forward.

    ``qkv`` holds the checkpoint's query, key and value projections stacked in that order
    (rows ``[0, H)``, ``[H, 2H)``, ``[2H, 3H)``), so one matmul computes all three.
    """

    def __init__(self, config: BertConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        hidden, inner, eps = config.hidden_size, config.intermediate_size, config.layer_norm_eps
        self.num_heads = config.num_attention_heads
        self.head_size = config.head_size
        self.qkv = FusedLinear(hidden, 3 * hidden, device=device)
        self.attn_out = FusedLinear(hidden, hidden, device=device)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps, device=device)
        self.ffn_in = FusedLinear(hidden, inner, device=device)
        self.ffn_out = FusedLinear(inner, hidden, device=device)
        self.ffn_norm = nn.LayerNorm(hidden, eps=eps, device=device)

    def forward_packed(self, x: torch.Tensor, packing: Packing) -> torch.Tensor:
        """x: [T', H], the real tokens of every sequence back to back (then any padding
        rows, ``T' >= T``) -> [T', H].

        Projections and the feed-forward block run on real tokens only; attention runs per
        sequence (see :func:`packed_attention`).
        """
        tokens, hidden = x.shape
        qkv = self.qkv(x).view(tokens, 3, self.num_heads, self.head_size)
        ctx = packed_attention(qkv, packing).reshape(tokens, hidden)
        x = self.attn_norm(self.attn_out.forward_add(ctx, x))
        return self.ffn_norm(self.ffn_out.forward_add(self.ffn_in.forward_gelu(x), x))

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor | None) -> torch.Tensor:
        """x: [B, L, H]; attn_bias: additive [B, 1, 1, L] in x's dtype, or None -> [B, L, H]."""
        batch, seq_len, hidden = x.shape
        # [B, L, 3H] -> [3, B, heads, L, head_size]; q, k, v are strided views of one buffer.
        qkv = self.qkv(x).view(batch, seq_len, 3, self.num_heads, self.head_size)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias)
        ctx = ctx.transpose(1, 2).reshape(batch, seq_len, hidden)
        x = self.attn_norm(self.attn_out.forward_add(ctx, x))
        return self.ffn_norm(self.ffn_out.forward_add(self.ffn_in.forward_gelu(x), x))


class BertEncoder(nn.Module):
    """BERT without pooler: ``input_ids`` in, ``last_hidden_state`` out.

    Build it with :func:`load_bert`; a bare constructor leaves random weights.

    Args:
        config: Sizes of the model.
        device: Where parameters are created; ``"meta"`` allocates nothing (used by
            :func:`load_bert`, which then adopts the checkpoint's tensors).
    """

    def __init__(self, config: BertConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config, device)
        self.layers = nn.ModuleList(
            BertLayer(config, device) for _ in range(config.num_hidden_layers)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Encode a batch of token sequences.

        Args:
            input_ids: int64 [B, L], on the module's device; L <= ``max_position_embeddings``.
            attention_mask: int64/bool [B, L], 1 for real tokens and 0 for padding, or None
                (every token is real). A mask of all ones on the CPU is dropped so attention
                runs unmasked; a device-resident mask is used as given, to avoid a host sync
                (callers that know the batch has no padding should pass None).
            token_type_ids: int64 [B, L] segment ids, or None (segment 0 everywhere).

        Returns:
            last_hidden_state: [B, L, H] in the parameters' dtype. Rows at padded positions
            hold values too; pool with the mask (see :func:`mean_pool_normalize`).

        Raises:
            ValueError: L exceeds ``max_position_embeddings``.
        """
        seq_len = input_ids.shape[1]
        if seq_len > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_position_embeddings="
                f"{self.config.max_position_embeddings}"
            )
        x = self.embeddings(input_ids, token_type_ids)
        attn_bias = _attention_bias(attention_mask, x.dtype)
        for layer in self.layers:
            x = layer(x, attn_bias)
        return x

    def forward_packed(self, input_ids: torch.Tensor, packing: Packing) -> torch.Tensor:
        """Encode sequences packed back to back, without padding (segment 0 everywhere).

        Args:
            input_ids: int64 [T], the tokens of every sequence in order, on the module's
                device; each sequence at most ``max_position_embeddings`` long.
            packing: Where each sequence lies (:meth:`Packing.of`).

        Returns:
            last_hidden_state of the real tokens: [T, H] in the parameters' dtype; pool with
            :func:`mean_pool_packed`. Equal to :meth:`forward` on the padded batch at the
            real positions (up to floating-point reassociation).

        Raises:
            ValueError: a sequence exceeds ``max_position_embeddings`` or is empty.
        """
        limit = self.config.max_position_embeddings
        if packing.lengths and (max(packing.lengths) > limit or min(packing.lengths) < 1):
            raise ValueError(
                f"packed sequence lengths must be in [1, {limit}], got "
                f"{min(packing.lengths)}..{max(packing.lengths)}"
            )
        emb = self.embeddings
        x = emb.word_embeddings(input_ids) + emb.token_type_embeddings.weight[0]
        x = emb.layer_norm(x + emb.position_embeddings(packing.positions))
        real = x.shape[0]
        layers = [cast(BertLayer, layer) for layer in self.layers]
        if layers and layers[0].qkv.packed:  # pad once, not in every projection
            x = row_padded(x)
        for layer in layers:
            x = layer.forward_packed(x, packing)
        return x[:real]


def _attention_bias(attention_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """[B, L] 1/0 mask -> additive [B, 1, 1, L] bias (0 keep, dtype min drop), or None.

    A large finite negative rather than -inf keeps a row with no real token finite (uniform
    attention) instead of NaN.
    """
    if attention_mask is None:
        return None
    if attention_mask.device.type == "cpu" and bool(attention_mask.all()):
        return None
    keep = attention_mask[:, None, None, :].to(dtype)
    return (1.0 - keep) * torch.finfo(dtype).min


def mean_pool_normalize(
    hidden: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Sentence embedding as sentence-transformers computes it: masked mean, then L2 norm.

    Args:
        hidden: [B, L, H], any float dtype (pooling runs in float32).
        attention_mask: [B, L], 1 for real tokens and 0 for padding, or None (all real).

    Returns:
        float32 [B, H], each row of unit L2 norm, on ``hidden``'s device.
    """
    hidden = hidden.float()
    if attention_mask is None:
        pooled = hidden.mean(dim=1)
    else:
        weights = attention_mask.to(device=hidden.device, dtype=torch.float32)
        # [B, 1, L] @ [B, L, H] -> [B, 1, H]: the masked sum as one batched matmul.
        summed = torch.bmm(weights.unsqueeze(1), hidden).squeeze(1)
        pooled = summed / weights.sum(dim=1, keepdim=True).clamp(min=1e-9)
    return F.normalize(pooled, p=2, dim=1)


def _strip_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the ``bert.`` prefix that ``BertFor*`` checkpoints put on the encoder's keys.

    Their task heads (``cls.*``, ``classifier.*``) keep their names and so count as unexpected.
    """
    if any(k.startswith("bert.embeddings.") for k in state):
        return {k.removeprefix("bert."): v for k, v in state.items()}
    return state


def convert_state_dict(
    state: dict[str, torch.Tensor], config: BertConfig
) -> dict[str, torch.Tensor]:
    """Map Hugging Face BERT checkpoint keys to :class:`BertEncoder` keys.

    Query, key and value weights are concatenated into ``layers.N.qkv``. Pooler weights and
    the ``embeddings.position_ids`` buffer are dropped.

    Raises:
        CheckpointError: a key the encoder needs is missing, or a key is neither used nor
            known to be ignorable (e.g. a task head). Shapes are checked by :func:`load_bert`.
    """
    src = _strip_prefix(state)
    used: set[str] = set()
    missing: list[str] = []

    def take(*names: str) -> list[torch.Tensor] | None:
        absent = [n for n in names if n not in src]
        if absent:
            missing.extend(absent)
            return None
        used.update(names)
        return [src[n] for n in names]

    plan: dict[str, tuple[str, ...]] = {
        "embeddings.word_embeddings.weight": ("embeddings.word_embeddings.weight",),
        "embeddings.position_embeddings.weight": ("embeddings.position_embeddings.weight",),
        "embeddings.token_type_embeddings.weight": ("embeddings.token_type_embeddings.weight",),
        "embeddings.layer_norm.weight": ("embeddings.LayerNorm.weight",),
        "embeddings.layer_norm.bias": ("embeddings.LayerNorm.bias",),
    }
    for i in range(config.num_hidden_layers):
        hf, ours = f"encoder.layer.{i}.", f"layers.{i}."
        for p in ("weight", "bias"):
            plan[f"{ours}qkv.{p}"] = tuple(
                f"{hf}attention.self.{n}.{p}" for n in ("query", "key", "value")
            )
            plan[f"{ours}attn_out.{p}"] = (f"{hf}attention.output.dense.{p}",)
            plan[f"{ours}attn_norm.{p}"] = (f"{hf}attention.output.LayerNorm.{p}",)
            plan[f"{ours}ffn_in.{p}"] = (f"{hf}intermediate.dense.{p}",)
            plan[f"{ours}ffn_out.{p}"] = (f"{hf}output.dense.{p}",)
            plan[f"{ours}ffn_norm.{p}"] = (f"{hf}output.LayerNorm.{p}",)

    out: dict[str, torch.Tensor] = {}
    for target, names in plan.items():
        tensors = take(*names)
        if tensors is None:
            continue
        if len({t.shape for t in tensors}) > 1:
            shapes = [tuple(t.shape) for t in tensors]
            raise CheckpointError(f"{names} must have equal shapes, got {shapes}")
        out[target] = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)

    unexpected = sorted(
        k
        for k in src
        if k not in used and k not in _IGNORED_KEYS and not k.startswith(_IGNORED_PREFIXES)
    )
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing keys {_abbrev(missing)}")
        if unexpected:
            parts.append(f"unexpected keys {_abbrev(unexpected)}")
        raise CheckpointError(
            "checkpoint does not match a BERT encoder with "
            f"num_hidden_layers={config.num_hidden_layers}: " + "; ".join(parts)
        )

    return out


def _abbrev(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    more = f", ... ({len(keys) - limit} more)" if len(keys) > limit else ""
    return f"[{shown}{more}]"


def load_bert(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> BertEncoder:
    """Load a BERT encoder from a Hugging Face folder (``config.json`` + ``model.safetensors``).

    Args:
        model_dir: Folder holding ``config.json`` and ``model.safetensors``.
        device: Torch device for the weights, e.g. ``"cpu"`` or ``"cuda:0"``.
        dtype: Floating dtype of the weights and of the computation.

    Returns:
        The encoder in eval mode with ``requires_grad`` off on every parameter; at bf16 on
        the CPU its projections run on oneDNN's prepacked kernels
        (:mod:`gpuserve.backends.fused_linear`).

    Raises:
        CheckpointError: missing files, or a checkpoint that does not match its config
            (missing keys, unexpected non-pooler keys, wrong shapes).
    """
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    config = BertConfig.from_file(model_dir / CONFIG_FILENAME)
    weights = model_dir / WEIGHTS_FILENAME
    if not weights.is_file():
        raise CheckpointError(f"{weights}: no such file")
    try:
        state = convert_state_dict(load_file(str(weights)), config)
    except CheckpointError as err:
        raise CheckpointError(f"{weights}: {err}") from None
    # Build on the meta device (no random init, no memory), then adopt the loaded tensors.
    # Factory kwargs rather than a ``with torch.device("meta")`` block, which routes every
    # op through Python and costs ~1.5 s on first use.
    model = BertEncoder(config, device="meta")
    expected = model.state_dict()
    wrong = [
        f"{k}: {tuple(v.shape)} (config.json implies {tuple(expected[k].shape)})"
        for k, v in state.items()
        if v.shape != expected[k].shape
    ]
    if wrong:
        raise CheckpointError(f"{weights}: tensor shapes do not match config.json: {wrong[:5]}")
    state = {k: v.to(device=device, dtype=dtype, copy=True) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    if torch.device(device).type == "cpu" and dtype in PREPACK_DTYPES:
        problem = prepack_all(model)
        if problem is not None:
            logger.warning("BERT projections at %s run unfused on F.linear: %s", dtype, problem)
    return model.eval()
