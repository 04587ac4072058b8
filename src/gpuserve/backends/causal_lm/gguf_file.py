"""GGUF files (llama.cpp's format): the model config from the metadata, the tensors
dequantised and renamed to their Hugging Face names.

A GGUF file is read with the ``gguf`` package's memory-mapped reader; each tensor is
dequantised with its numpy code (``gguf.quants.dequantize``) when the weights are built, one
at a time, so a quantised file never sits dequantised in memory twice.

llama.cpp's converter reorders the rows of ``attn_q`` and ``attn_k`` of ``llama`` models
so that each head's rotary channel pairs are adjacent (its RoPE rotates pairs ``(2i, 2i+1)``,
Hugging Face's rotates ``(i, i + head_dim / 2)``); :class:`GgufTensors` undoes that
permutation, so the same forward pass serves both. ``qwen2``/``qwen3`` files are not
permuted.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpuserve.backends.causal_lm.architectures import ModelSpec, spec_from_config
from gpuserve.errors import ConfigError

#: GGUF ``general.architecture`` -> the Hugging Face architecture served for it.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
#: llama.cpp names of the tensors of one block -> Hugging Face names (after ``layers.N.``).
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def _gguf() -> Any:
    # imported here: the gguf package is only needed by GGUF models
    try:
        import gguf
    except ImportError:
        raise ConfigError(
            "GGUF models need the gguf package, which is not installed: pip install gguf"
        ) from None
    return gguf


@dataclass(slots=True)
class _Entry:
    tensor: Any  # gguf.ReaderTensor
    unpermute_heads: int  # > 0: undo llama.cpp's RoPE row permutation over this many heads


class GgufTensors:
    """The tensors of a GGUF file by Hugging Face name, dequantised to float32 on request."""

    def __init__(self, entries: dict[str, _Entry]) -> None:
        self._entries = entries

    def __enter__(self) -> GgufTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def names(self) -> set[str]:
        return set(self._entries)

    def get(self, name: str) -> torch.Tensor:
        entry = self._entries[name]
        gguf = _gguf()
        array = gguf.quants.dequantize(entry.tensor.data, entry.tensor.tensor_type)
        if not array.flags.writeable or array.dtype != np.float32:
            array = np.array(array, dtype=np.float32)
        tensor = torch.from_numpy(array)
        if entry.unpermute_heads:
            tensor = unpermute_rope_rows(tensor, entry.unpermute_heads)
        return tensor


def unpermute_rope_rows(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's permutation of q/k rows: within each head, row ``2i + j`` of the
    file is row ``j * head_dim / 2 + i`` of the Hugging Face weight (``j`` in {0, 1})."""
    rows = tensor.shape[0]
    rest = tensor.shape[1:]
    return tensor.reshape(heads, rows // heads // 2, 2, *rest).transpose(1, 2).reshape(tensor.shape)


@dataclass(slots=True)
class GgufModel:
    """What a GGUF file holds for serving.

    Attributes:
        spec: The model's shape, from the metadata.
        tensors: The weights by Hugging Face name.
        config: The Hugging Face style config built from the metadata.
        chat_template: ``tokenizer.chat_template``, or None.
        name: ``general.name``, or None.
    """

    spec: ModelSpec
    tensors: GgufTensors
    config: dict[str, Any]
    chat_template: str | None
    name: str | None


def open_gguf(path: Path) -> GgufModel:
    """Read the metadata and tensor index of the GGUF file at ``path`` (the tensors stay
    memory-mapped until :meth:`GgufTensors.get`).

    Raises:
        ConfigError: not a readable GGUF file, an architecture outside
            :data:`GGUF_ARCHITECTURES`, or metadata that lacks a size field.
    """
    gguf = _gguf()
    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path}: not a readable GGUF file: {err}") from None

    def field(key: str, default: Any = None) -> Any:
        found = reader.get_field(key)
        return default if found is None else found.contents()

    arch = field("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(
            f"{path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(GGUF_ARCHITECTURES)})"
        )
    tensors = {t.name: t for t in reader.tensors}
    token_list = reader.get_field("tokenizer.ggml.tokens")
    if token_list is not None:
        vocab_size = len(token_list.data)  # one entry per token, without decoding them
    else:
        vocab_size = int(tensors["token_embd.weight"].shape[-1])
    config = _config(path, arch, field, tensors, vocab_size)
    spec = spec_from_config(config, source=str(path))
    if "rope_freqs.weight" in tensors and spec.rope is not None:
        # llama.cpp stores Llama 3.1's rope scaling as per-frequency divisors
        factors = GgufTensors({"f": _Entry(tensors["rope_freqs.weight"], 0)}).get("f")
        rope = dataclasses.replace(spec.rope, freq_factors=tuple(factors.tolist()))
        spec = dataclasses.replace(spec, rope=rope)
    entries = _entries(arch, spec, tensors)
    return GgufModel(
        spec=spec,
        tensors=GgufTensors(entries),
        config=config,
        chat_template=field("tokenizer.chat_template"),
        name=field("general.name"),
    )


def _config(
    path: Path, arch: str, field: Any, tensors: dict[str, Any], vocab_size: int
) -> dict[str, Any]:
    def required(key: str) -> Any:
        value = field(f"{arch}.{key}")
        if value is None:
            raise ConfigError(f"{path}: the GGUF metadata has no {arch}.{key}")
        if not isinstance(value, int | float):
            raise ConfigError(f"{path}: {arch}.{key} must be one number, got {value!r}")
        return value

    hidden = int(required("embedding_length"))
    heads = int(required("attention.head_count"))
    kv_heads = field(f"{arch}.attention.head_count_kv", heads)
    scaling = field(f"{arch}.rope.scaling.type", "none")
    rope: dict[str, Any] = {
        "rope_theta": float(field(f"{arch}.rope.freq_base", 10000.0)),
        "rope_type": "default" if scaling == "none" else scaling,
    }
    if scaling != "none":
        rope["factor"] = float(field(f"{arch}.rope.scaling.factor", 1.0))
    eos = [field("tokenizer.ggml.eos_token_id"), field("tokenizer.ggml.eot_token_id")]
    return {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "num_hidden_layers": int(required("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(field(f"{arch}.attention.key_length", hidden // heads)),
        "intermediate_size": int(required("feed_forward_length")),
        "vocab_size": vocab_size,
        "max_position_embeddings": int(field(f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": rope,
        "tie_word_embeddings": "output.weight" not in tensors,
        "eos_token_id": list(dict.fromkeys(int(e) for e in eos if e is not None)),
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
    }


def _entries(arch: str, spec: ModelSpec, tensors: dict[str, Any]) -> dict[str, _Entry]:
    permuted = arch == "llama"
    entries: dict[str, _Entry] = {}
    for name, tensor in tensors.items():
        if name in _TOP_NAMES:
            entries[_TOP_NAMES[name]] = _Entry(tensor, 0)
            continue
        match = _BLOCK.fullmatch(name)
        if match is None or match.group(2) not in _BLOCK_NAMES:
            continue
        suffix = match.group(2)
        heads = 0
        if permuted and suffix.startswith("attn_q."):
            heads = spec.num_heads
        elif permuted and suffix.startswith("attn_k."):
            heads = spec.num_kv_heads
        entries[f"model.layers.{match.group(1)}.{_BLOCK_NAMES[suffix]}"] = _Entry(tensor, heads)
    return entries
