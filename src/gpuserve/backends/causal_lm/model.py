"""The decoder-only transformer: one forward pass per engine step over a paged KV cache.

Every supported family (Llama, Mistral, Qwen2, Qwen3, GPT-2) runs the same pre-norm
decoder; :class:`ModelSpec` switches the norm, the positions, the MLP and the per-head q/k
norms. The linear layers run on all tokens of the step at once (``[T, hidden]``); attention
goes through :mod:`gpuserve.backends.causal_lm.attention`; the weight matrices may be
quantised (:mod:`gpuserve.backends.causal_lm.quantize`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpuserve.backends.causal_lm.architectures import ModelSpec
from gpuserve.backends.causal_lm.attention import PagedAttention, select_attention, write_kv
from gpuserve.backends.causal_lm.quantize import linear
from gpuserve.backends.causal_lm.step import StepBatch
from gpuserve.backends.causal_lm.weights import ModelWeights, Norm, distinct_tensors


@dataclass(frozen=True, slots=True)
class CausalLMInfo:
    """What the engine needs to know about a loaded model.

    Attributes:
        architecture: Hugging Face architecture name (``LlamaForCausalLM``).
        num_layers: Decoder layers (each has its own K/V cache).
        num_heads: Query heads.
        num_kv_heads: Key/value heads.
        head_dim: Channels per head.
        hidden_size: Width of the residual stream.
        vocab_size: Width of the logits.
        max_position: Longest sequence the model serves, tokens.
        eos_token_ids: Ids that end a generation (from the config; may be empty).
        bos_token_id: Beginning-of-sequence id, or None.
        dtype: Dtype of the activations, the KV cache and the unquantised weights.
    """

    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: torch.dtype


@dataclass(slots=True)
class KVCache:
    """The paged K/V cache of every layer.

    Attributes:
        keys: Per layer, ``[num_blocks, block_size, kv_heads, head_dim]``.
        values: Per layer, same shape.
        num_blocks: Blocks per layer.
        block_size: Tokens per block.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    num_blocks: int
    block_size: int


class CausalLM:
    """A causal LM whose forward pass reads and writes a paged KV cache.

    Call :meth:`allocate_cache` once, then :meth:`forward` once per engine step. Not
    thread-safe: one engine thread drives it.
    """

    def __init__(
        self, spec: ModelSpec, weights: ModelWeights, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.spec = spec
        self.weights = weights
        self.dtype = dtype
        self.device = device
        self.info = CausalLMInfo(
            architecture=spec.architecture,
            num_layers=spec.num_layers,
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            hidden_size=spec.hidden_size,
            vocab_size=int(weights.lm_head.shape[0]),
            max_position=spec.max_position,
            eos_token_ids=spec.eos_token_ids,
            bos_token_id=spec.bos_token_id,
            dtype=dtype,
        )
        self.cache: KVCache | None = None
        self._attention: PagedAttention | None = None
        self._inv_freq = spec.rope.inv_freq().to(device) if spec.rope is not None else None

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight tensor (a tied embedding counted once)."""
        return sum(t.numel() * t.element_size() for t in distinct_tensors(self.weights))

    def cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block of ``block_size`` tokens takes, K and V of every layer."""
        element = torch.empty((), dtype=self.dtype).element_size()
        per_layer = block_size * self.spec.num_kv_heads * self.spec.head_dim * element
        return 2 * self.spec.num_layers * per_layer

    def allocate_cache(self, num_blocks: int, block_size: int) -> KVCache:
        """Allocate (replacing any earlier one) the KV cache: per layer, K and V tensors
        ``[num_blocks, block_size, kv_heads, head_dim]`` in the model's dtype on its device,
        zero-filled. Also picks the attention implementation for this block size."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}"
            )
        shape = (num_blocks, block_size, self.spec.num_kv_heads, self.spec.head_dim)

        def make() -> torch.Tensor:
            return torch.zeros(shape, dtype=self.dtype, device=self.device)

        layers = range(self.spec.num_layers)
        self.cache = KVCache(
            keys=[make() for _ in layers],
            values=[make() for _ in layers],
            num_blocks=num_blocks,
            block_size=block_size,
        )
        self._attention = select_attention(
            self.device,
            self.dtype,
            block_size,
            self.spec.num_heads,
            self.spec.num_kv_heads,
            self.spec.head_dim,
        )
        return self.cache

    @property
    def attention_name(self) -> str | None:
        """The attention implementation in use (``sdpa``, ``flash_attn``), None before
        :meth:`allocate_cache`."""
        return None if self._attention is None else self._attention.name

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Run one step: write its K/V into the cache, return the wanted logits.

        Args:
            batch: The step, built with the cache's block size on the model's device.

        Returns:
            float32 ``[R, vocab]``: the logits of the last token of each chunk with
            ``sample`` set, in chunk order (``R`` may be 0).

        Raises:
            RuntimeError: no cache allocated, or the batch's block size differs from it.
        """
        cache, attention = self.cache, self._attention
        if cache is None or attention is None:
            raise RuntimeError("allocate_cache() must be called before forward()")
        if batch.block_size != cache.block_size:
            raise RuntimeError(
                f"the step uses blocks of {batch.block_size} tokens, the cache {cache.block_size}"
            )
        spec, weights = self.spec, self.weights
        tokens = batch.num_tokens
        heads, kv_heads, head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        q_width, kv_width = heads * head_dim, kv_heads * head_dim
        hidden = F.embedding(batch.token_ids, weights.embed)
        if weights.pos_embed is not None:
            hidden = hidden + F.embedding(batch.positions, weights.pos_embed)
        rotation = self._rotation(batch.positions)
        for index, layer in enumerate(weights.layers):
            x = self._norm(hidden, layer.attn_norm)
            qkv = linear(x, layer.qkv_weight, layer.qkv_bias)
            v = qkv[:, q_width + kv_width :].view(tokens, kv_heads, head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                q = self._rms(qkv[:, :q_width].view(tokens, heads, head_dim), layer.q_norm)
                k = qkv[:, q_width : q_width + kv_width].view(tokens, kv_heads, head_dim)
                k = self._rms(k, layer.k_norm)
                if rotation is not None:
                    q, k = _rotate(q, *rotation), _rotate(k, *rotation)
            else:
                # q and k side by side: one rotation of [T, heads + kv_heads, head_dim]
                # (half the small ops of a decode step's RoPE)
                qk = qkv[:, : q_width + kv_width].view(tokens, heads + kv_heads, head_dim)
                if rotation is not None:
                    qk = _rotate(qk, *rotation)
                q, k = qk[:, :heads], qk[:, heads:]
            key_cache, value_cache = cache.keys[index], cache.values[index]
            write_kv(key_cache, value_cache, k, v, batch.slot_mapping)
            attended = attention(q, k, v, key_cache, value_cache, batch)
            hidden = hidden + linear(
                attended.reshape(tokens, q_width), layer.o_weight, layer.o_bias
            )
            x = self._norm(hidden, layer.mlp_norm)
            x = linear(x, layer.up_weight, layer.up_bias)
            if spec.mlp == "swiglu":
                gate, up = x.chunk(2, dim=-1)
                x = F.silu(gate) * up
            else:
                x = F.gelu(x, approximate="tanh")
            hidden = hidden + linear(x, layer.down_weight, layer.down_bias)
        last = self._norm(hidden[batch.logits_rows], weights.final_norm)
        return linear(last, weights.lm_head).float()

    __call__ = forward

    def _rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos and sin ``[T, 1, head_dim / 2]`` of each token's angles, in the model dtype."""
        if self._inv_freq is None:
            return None
        angles = positions.float()[:, None] * self._inv_freq[None, :]
        return angles.cos().to(self.dtype)[:, None], angles.sin().to(self.dtype)[:, None]

    def _norm(self, x: torch.Tensor, norm: Norm) -> torch.Tensor:
        if self.spec.norm == "layer":
            return F.layer_norm(x, x.shape[-1:], norm.weight, norm.bias, self.spec.norm_eps)
        return self._rms(x, norm.weight)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, x.shape[-1:], weight, self.spec.norm_eps)
        # half precision: normalise in float32, round, then scale, as transformers does
        normed = F.rms_norm(x.float(), x.shape[-1:], None, self.spec.norm_eps)
        return normed.to(x.dtype) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the rotate-half layout: channel ``i`` pairs with ``i + head_dim / 2``."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
