"""What a causal LM is made of, read from a Hugging Face ``config.json`` dict.

Every supported architecture is one decoder shape with a few switches (:class:`ModelSpec`):
RMSNorm or LayerNorm, RoPE or learned positions, SwiGLU or GELU MLP, per-head q/k norms
(Qwen3). :func:`spec_from_config` reads the switches from the config; the weight names of each
family are mapped in :mod:`gpuserve.backends.causal_lm.weights`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from gpuserve.errors import ConfigError

LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
GPT2 = "GPT2LMHeadModel"
#: Every ``architectures`` entry :func:`spec_from_config` accepts.
SUPPORTED_ARCHITECTURES = (*LLAMA_FAMILY, GPT2)
#: RoPE scaling types :class:`RopeSpec` implements.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
#: ``model_type`` -> architecture, for a config that lists no ``architectures``.
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gpt2": GPT2,
}


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """Rotary position embedding, in Hugging Face's rotate-half layout.

    Attributes:
        theta: Base of the frequencies (``rope_theta``).
        dim: Rotated channels per head (the head dimension).
        rope_type: ``default``, ``linear`` (positions divided by ``factor``) or ``llama3``.
        factor: Scaling factor (``linear``, ``llama3``).
        low_freq_factor: ``llama3`` only.
        high_freq_factor: ``llama3`` only.
        original_max_position: ``llama3`` only: the context the model was trained on.
        freq_factors: Per-frequency divisors given as a tensor (GGUF ``rope_freqs``, how
            llama.cpp stores the ``llama3`` scaling), or None.
    """

    theta: float
    dim: int
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    freq_factors: tuple[float, ...] | None = None

    def inv_freq(self) -> torch.Tensor:
        """float32 ``[dim / 2]``: the angle per position of each rotated channel pair."""
        # float32 throughout, as transformers computes it, so angles match to the last bit
        exponents = torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim
        inv = 1.0 / (self.theta**exponents)
        if self.rope_type == "linear":
            inv = inv / self.factor
        elif self.rope_type == "llama3":
            inv = self._llama3(inv)
        if self.freq_factors is not None:
            inv = inv / torch.tensor(self.freq_factors, dtype=torch.float32)
        return inv

    def _llama3(self, inv: torch.Tensor) -> torch.Tensor:
        # Long wavelengths (past the trained context / low_freq_factor) are slowed by
        # `factor`, short ones (under context / high_freq_factor) kept, and those between
        # blended linearly in context / wavelength.
        wavelength = 2 * math.pi / inv
        long_limit = self.original_max_position / self.low_freq_factor
        short_limit = self.original_max_position / self.high_freq_factor
        scaled = torch.where(wavelength > long_limit, inv / self.factor, inv)
        blend = (self.original_max_position / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - blend) * scaled / self.factor + blend * scaled
        between = (wavelength >= short_limit) & (wavelength <= long_limit)
        return torch.where(between, blended, scaled)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shape of a decoder-only transformer and the switches of its family.

    Attributes:
        architecture: The ``architectures`` entry (``LlamaForCausalLM``).
        num_layers: Decoder layers.
        hidden_size: Width of the residual stream.
        num_heads: Query heads.
        num_kv_heads: Key/value heads (fewer than ``num_heads`` with grouped-query attention).
        head_dim: Channels per head.
        intermediate_size: Width of the MLP's hidden layer.
        vocab_size: Rows of the embedding as the config states it.
        max_position: Longest context the model serves (positions ``0..max_position-1``).
        norm: ``rms`` (RMSNorm, no bias) or ``layer`` (LayerNorm with bias).
        norm_eps: Epsilon of every norm.
        mlp: ``swiglu`` (``down(silu(gate(x)) * up(x))``) or ``gelu_tanh`` (``down(gelu(up(x)))``).
        rope: Rotary embedding, or None with learned positions.
        learned_positions: A position-embedding table is added to the token embedding.
        qk_norm: RMSNorm over each head of q and k before RoPE (Qwen3).
        tie_word_embeddings: The output projection is the token embedding.
        eos_token_ids: End-of-sequence ids from the config (may be empty).
        bos_token_id: Beginning-of-sequence id, or None.
    """

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position: int
    norm: Literal["rms", "layer"]
    norm_eps: float
    mlp: Literal["swiglu", "gelu_tanh"]
    rope: RopeSpec | None
    learned_positions: bool
    qk_norm: bool
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None


def token_ids(value: Any) -> tuple[int, ...]:
    """A config's ``eos_token_id`` (an int, a list of ints or null) as a tuple."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def spec_from_config(config: dict[str, Any], source: str = "config.json") -> ModelSpec:
    """Read a :class:`ModelSpec` from a Hugging Face config dict.

    Args:
        config: The parsed ``config.json``.
        source: What to name in error messages (the file).

    Raises:
        ConfigError: an architecture outside :data:`SUPPORTED_ARCHITECTURES`, an unsupported
            RoPE scaling or activation, or a missing size field.
    """
    architectures = config.get("architectures") or []
    architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if architecture is None and not architectures:
        architecture = _BY_MODEL_TYPE.get(str(config.get("model_type")))
    if architecture is None:
        named = (
            f"architectures {architectures!r}"
            if architectures
            else f"model_type {config.get('model_type')!r}"
        )
        raise ConfigError(
            f"{source}: {named} names no supported causal LM "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    try:
        if architecture == GPT2:
            return _gpt2_spec(config, source)
        return _llama_spec(architecture, config, source)
    except KeyError as err:
        raise ConfigError(f"{source}: {architecture} needs the field {err.args[0]!r}") from None


def _llama_spec(architecture: str, config: dict[str, Any], source: str) -> ModelSpec:
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        raise ConfigError(f"{source}: hidden_act {activation!r} is not supported (only silu)")
    max_position = int(config.get("max_position_embeddings", 2048))
    # Sliding-window attention over a context no longer than the window is full attention,
    # so such a model is served with its context capped at the window.
    window = config.get("sliding_window")
    uses_window = architecture == "MistralForCausalLM" or config.get("use_sliding_window")
    if uses_window and window:
        max_position = min(max_position, int(window))
    return ModelSpec(
        architecture=architecture,
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        intermediate_size=int(config["intermediate_size"]),
        vocab_size=int(config["vocab_size"]),
        max_position=max_position,
        norm="rms",
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        mlp="swiglu",
        rope=rope_from_config(config, head_dim, source),
        learned_positions=False,
        qk_norm=architecture == "Qwen3ForCausalLM",
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        eos_token_ids=token_ids(config.get("eos_token_id")),
        bos_token_id=config.get("bos_token_id"),
    )


def _gpt2_spec(config: dict[str, Any], source: str) -> ModelSpec:
    hidden = int(config["n_embd"])
    heads = int(config["n_head"])
    activation = config.get("activation_function", "gelu_new")
    if activation not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(
            f"{source}: activation_function {activation!r} is not supported "
            "(supported: gelu_new, gelu_pytorch_tanh)"
        )
    if config.get("scale_attn_by_inverse_layer_idx") or config.get("reorder_and_upcast_attn"):
        raise ConfigError(
            f"{source}: scale_attn_by_inverse_layer_idx and reorder_and_upcast_attn are "
            "not supported"
        )
    return ModelSpec(
        architecture=GPT2,
        num_layers=int(config["n_layer"]),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=int(config.get("n_inner") or 4 * hidden),
        vocab_size=int(config["vocab_size"]),
        max_position=int(config["n_positions"]),
        norm="layer",
        norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        mlp="gelu_tanh",
        rope=None,
        learned_positions=True,
        qk_norm=False,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        eos_token_ids=token_ids(config.get("eos_token_id")),
        bos_token_id=config.get("bos_token_id"),
    )


def rope_from_config(config: dict[str, Any], head_dim: int, source: str) -> RopeSpec:
    """The RoPE of a config: transformers 5's ``rope_parameters`` or 4's ``rope_theta`` +
    ``rope_scaling``.

    Raises:
        ConfigError: a scaling type outside :data:`SUPPORTED_ROPE_TYPES`, or a partial rotary
            factor.
    """
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{source}: rope type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    partial = float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1)))
    if partial != 1.0:
        raise ConfigError(f"{source}: partial_rotary_factor {partial} is not supported (only 1)")
    return RopeSpec(
        theta=theta,
        dim=head_dim,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )
