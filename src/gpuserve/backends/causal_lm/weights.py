"""Weights of a causal LM: read from a Hugging Face folder, laid out for the forward pass.

A :class:`TensorSource` hands out tensors by their Hugging Face name, in the stored dtype on
the CPU (a folder of ``*.safetensors`` or ``pytorch_model.bin`` files here; a GGUF file in
:mod:`gpuserve.backends.causal_lm.gguf_file`, which renames llama.cpp's tensors to these
names). :func:`build_weights` then takes what a :class:`ModelSpec` needs, one tensor at a
time, converts it to the serving dtype and device and fuses q/k/v and gate/up into single
matrices (one matmul each instead of three and two).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from gpuserve.backends.causal_lm.architectures import GPT2, ModelSpec
from gpuserve.backends.causal_lm.quantize import (
    QuantizedLinear,
    Weight,
    packed_kernel_available,
    quantize,
)
from gpuserve.errors import ConfigError


class TensorSource(Protocol):
    """Tensors of a checkpoint by their Hugging Face name."""

    def names(self) -> set[str]:
        """Every tensor name the checkpoint holds."""
        ...

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` on the CPU, in its stored dtype (a float type)."""
        ...


@dataclass(slots=True)
class Norm:
    """A norm's scale and (LayerNorm only) shift, each ``[width]``."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer, in ``[out, in]`` layout, in the serving dtype (the four weight
    matrices possibly quantised: :class:`QuantizedLinear`).

    Attributes:
        attn_norm: Norm before attention.
        qkv_weight: ``[(heads + 2 * kv_heads) * head_dim, hidden]``, q then k then v rows.
        qkv_bias: ``[(heads + 2 * kv_heads) * head_dim]`` or None.
        q_norm: RMSNorm scale ``[head_dim]`` applied to each query head (Qwen3), or None.
        k_norm: Same for the key heads.
        o_weight: ``[hidden, heads * head_dim]``.
        o_bias: ``[hidden]`` or None.
        mlp_norm: Norm before the MLP.
        up_weight: SwiGLU: ``[2 * intermediate, hidden]``, gate rows then up rows; GELU:
            ``[intermediate, hidden]``.
        up_bias: Matching bias, or None.
        down_weight: ``[hidden, intermediate]``.
        down_bias: ``[hidden]`` or None.
    """

    attn_norm: Norm
    qkv_weight: Weight
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_weight: Weight
    o_bias: torch.Tensor | None
    mlp_norm: Norm
    up_weight: Weight
    up_bias: torch.Tensor | None
    down_weight: Weight
    down_bias: torch.Tensor | None


@dataclass(slots=True)
class ModelWeights:
    """Every tensor of a causal LM, in the serving dtype on the serving device.

    Attributes:
        embed: ``[vocab, hidden]`` token embedding.
        pos_embed: ``[max_position, hidden]`` learned positions (GPT-2), or None.
        layers: The decoder layers in order.
        final_norm: Norm after the last layer.
        lm_head: ``[vocab, hidden]``; the same tensor as ``embed`` when tied (quantised:
            ``embed`` is then its ``dense`` matrix).
    """

    embed: torch.Tensor
    pos_embed: torch.Tensor | None
    layers: list[LayerWeights]
    final_norm: Norm
    lm_head: Weight


class SafetensorsFolder:
    """The ``*.safetensors`` files of a folder (one file, or shards listed in
    ``model.safetensors.index.json``), opened lazily: a tensor is read when asked for.

    Use as a context manager; the files stay open until it exits.
    """

    def __init__(self, folder: Path) -> None:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            # only the shards the index names (a folder may also hold another layout's file,
            # such as Mistral's consolidated.safetensors)
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
            self._files = sorted(folder / name for name in shards)
        else:
            self._files = sorted(folder.glob("*.safetensors"))
        self._stack = ExitStack()
        self._where: dict[str, Any] = {}

    def __enter__(self) -> SafetensorsFolder:
        from safetensors import safe_open

        for path in self._files:
            handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                self._where[name] = handle
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def names(self) -> set[str]:
        return set(self._where)

    def get(self, name: str) -> torch.Tensor:
        tensor: torch.Tensor = self._where[name].get_tensor(name)
        return tensor


class TorchBinFolder:
    """``pytorch_model.bin`` (or its shards ``pytorch_model-*.bin``), read with
    ``torch.load(weights_only=True)``, memory-mapped."""

    def __init__(self, folder: Path) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        for path in sorted(folder.glob("pytorch_model*.bin")):
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            self._tensors.update({k: v for k, v in state.items() if isinstance(v, torch.Tensor)})

    def __enter__(self) -> TorchBinFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self._tensors.clear()

    def names(self) -> set[str]:
        return set(self._tensors)

    def get(self, name: str) -> torch.Tensor:
        return self._tensors[name]


def folder_source(folder: Path) -> SafetensorsFolder | TorchBinFolder:
    """The weight files of a Hugging Face folder: safetensors when there are any.

    Raises:
        ConfigError: the folder holds neither ``*.safetensors`` nor ``pytorch_model*.bin``.
    """
    if any(folder.glob("*.safetensors")):
        return SafetensorsFolder(folder)
    if any(folder.glob("pytorch_model*.bin")):
        return TorchBinFolder(folder)
    raise ConfigError(
        f"{folder}: no weights found (expected *.safetensors or pytorch_model.bin files)"
    )


def read_config(folder: Path) -> dict[str, Any]:
    """``config.json`` of a folder as a dict.

    Raises:
        ConfigError: the file is missing or is not a JSON object.
    """
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{folder}: no config.json (a Hugging Face model folder)") from None
    except ValueError as err:
        raise ConfigError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return config


class _Loader:
    """Takes tensors from a source by name, converting each to the serving dtype/device."""

    def __init__(
        self, source: TensorSource, dtype: torch.dtype, device: torch.device, where: str
    ) -> None:
        self.source = source
        self.names = source.names()
        self.dtype = dtype
        self.device = device
        self.where = where

    def has(self, name: str) -> bool:
        return name in self.names

    def take(self, name: str, transpose: bool = False) -> torch.Tensor:
        if name not in self.names:
            raise ConfigError(f"{self.where}: the weights have no tensor {name!r}")
        tensor = self.source.get(name)
        if transpose:
            tensor = tensor.t()
        return tensor.to(device=self.device, dtype=self.dtype).contiguous()

    def maybe(self, name: str, transpose: bool = False) -> torch.Tensor | None:
        return self.take(name, transpose) if name in self.names else None

    def fused(self, names: list[str]) -> torch.Tensor | None:
        present = [name in self.names for name in names]
        if not any(present):
            return None
        return torch.cat([self.take(name) for name in names]).contiguous()


def build_weights(
    spec: ModelSpec,
    source: TensorSource,
    dtype: torch.dtype,
    device: torch.device,
    where: str,
) -> ModelWeights:
    """Take the tensors ``spec`` needs from ``source``, in ``dtype`` on ``device``.

    Args:
        spec: The model's shape and family.
        source: Tensors by Hugging Face name.
        dtype: Serving dtype of every weight.
        device: Where the weights live.
        where: What to name in error messages (the path).

    Raises:
        ConfigError: a tensor the architecture needs is missing.
    """
    loader = _Loader(source, dtype, device, where)
    if spec.architecture == GPT2:
        return _gpt2_weights(spec, loader)
    return _llama_weights(spec, loader)


def _lm_head(spec: ModelSpec, loader: _Loader, embed: torch.Tensor) -> torch.Tensor:
    # tied, or a checkpoint that stores no output projection (GGUF files of tied models,
    # checkpoints saved without the duplicate): the token embedding is the projection
    if loader.has("lm_head.weight") and not spec.tie_word_embeddings:
        return loader.take("lm_head.weight")
    return embed


def _llama_weights(spec: ModelSpec, loader: _Loader) -> ModelWeights:
    prefix = "model." if loader.has("model.embed_tokens.weight") else ""
    layers = []
    for i in range(spec.num_layers):
        p = f"{prefix}layers.{i}."
        qkv = [f"{p}self_attn.{x}_proj.weight" for x in "qkv"]
        qkv_bias = [f"{p}self_attn.{x}_proj.bias" for x in "qkv"]
        up = [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"]
        up_bias = [f"{p}mlp.gate_proj.bias", f"{p}mlp.up_proj.bias"]
        layers.append(
            LayerWeights(
                attn_norm=Norm(loader.take(f"{p}input_layernorm.weight")),
                qkv_weight=torch.cat([loader.take(name) for name in qkv]).contiguous(),
                qkv_bias=loader.fused(qkv_bias),
                q_norm=loader.take(f"{p}self_attn.q_norm.weight") if spec.qk_norm else None,
                k_norm=loader.take(f"{p}self_attn.k_norm.weight") if spec.qk_norm else None,
                o_weight=loader.take(f"{p}self_attn.o_proj.weight"),
                o_bias=loader.maybe(f"{p}self_attn.o_proj.bias"),
                mlp_norm=Norm(loader.take(f"{p}post_attention_layernorm.weight")),
                up_weight=torch.cat([loader.take(name) for name in up]).contiguous(),
                up_bias=loader.fused(up_bias),
                down_weight=loader.take(f"{p}mlp.down_proj.weight"),
                down_bias=loader.maybe(f"{p}mlp.down_proj.bias"),
            )
        )
    embed = loader.take(f"{prefix}embed_tokens.weight")
    return ModelWeights(
        embed=embed,
        pos_embed=None,
        layers=layers,
        final_norm=Norm(loader.take(f"{prefix}norm.weight")),
        lm_head=_lm_head(spec, loader, embed),
    )


def _gpt2_weights(spec: ModelSpec, loader: _Loader) -> ModelWeights:
    prefix = "transformer." if loader.has("transformer.wte.weight") else ""

    def norm(name: str) -> Norm:
        return Norm(loader.take(f"{name}.weight"), loader.take(f"{name}.bias"))

    layers = []
    for i in range(spec.num_layers):
        p = f"{prefix}h.{i}."
        # GPT-2's Conv1D modules store their weights [in, out]: transposed to [out, in]
        layers.append(
            LayerWeights(
                attn_norm=norm(f"{p}ln_1"),
                qkv_weight=loader.take(f"{p}attn.c_attn.weight", transpose=True),
                qkv_bias=loader.take(f"{p}attn.c_attn.bias"),
                q_norm=None,
                k_norm=None,
                o_weight=loader.take(f"{p}attn.c_proj.weight", transpose=True),
                o_bias=loader.take(f"{p}attn.c_proj.bias"),
                mlp_norm=norm(f"{p}ln_2"),
                up_weight=loader.take(f"{p}mlp.c_fc.weight", transpose=True),
                up_bias=loader.take(f"{p}mlp.c_fc.bias"),
                down_weight=loader.take(f"{p}mlp.c_proj.weight", transpose=True),
                down_bias=loader.take(f"{p}mlp.c_proj.bias"),
            )
        )
    embed = loader.take(f"{prefix}wte.weight")
    return ModelWeights(
        embed=embed,
        pos_embed=loader.take(f"{prefix}wpe.weight"),
        layers=layers,
        final_norm=norm(f"{prefix}ln_f"),
        lm_head=_lm_head(spec, loader, embed),
    )


def quantize_weights(
    weights: ModelWeights, fmt: str, dtype: torch.dtype, device: torch.device
) -> ModelWeights:
    """``weights`` (float32, built with :func:`build_weights`) with the four matrices of
    every layer quantised to ``fmt``, the ``lm_head`` to int8 (either format), and every
    other tensor in ``dtype``.

    A tied embedding becomes the quantised head's ``dense`` matrix (one copy, and the
    lookups see the same values the head multiplies by).
    """
    def cast(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.to(dtype)

    def norm(n: Norm) -> Norm:
        return Norm(n.weight.to(dtype), cast(n.bias))

    def matrix(weight: Weight, kind: str = fmt) -> QuantizedLinear:
        assert isinstance(weight, torch.Tensor), "quantising weights that already are"
        return quantize(weight, kind, dtype, packed_kernel_available(kind, dtype, device))

    tied = weights.lm_head is weights.embed
    # the output projection (and a tied embedding) stays at 8 bits under int4, as
    # llama.cpp's Q4_x files keep it (Q8_0/Q6_K): 4 bits there cost the most accuracy
    lm_head = matrix(weights.lm_head, "int8")
    layers = [
        LayerWeights(
            attn_norm=norm(layer.attn_norm),
            qkv_weight=matrix(layer.qkv_weight),
            qkv_bias=cast(layer.qkv_bias),
            q_norm=cast(layer.q_norm),
            k_norm=cast(layer.k_norm),
            o_weight=matrix(layer.o_weight),
            o_bias=cast(layer.o_bias),
            mlp_norm=norm(layer.mlp_norm),
            up_weight=matrix(layer.up_weight),
            up_bias=cast(layer.up_bias),
            down_weight=matrix(layer.down_weight),
            down_bias=cast(layer.down_bias),
        )
        for layer in weights.layers
    ]
    return ModelWeights(
        embed=lm_head.dense if tied else weights.embed.to(dtype),
        pos_embed=cast(weights.pos_embed),
        layers=layers,
        final_norm=norm(weights.final_norm),
        lm_head=lm_head,
    )


def distinct_tensors(weights: ModelWeights) -> Iterator[torch.Tensor]:
    """Every distinct tensor of ``weights`` (for counting bytes; a quantised matrix as its
    packed weights, scales and dense copy)."""
    seen: set[int] = set()
    candidates: list[Weight | None] = [
        weights.embed,
        weights.pos_embed,
        weights.final_norm.weight,
        weights.final_norm.bias,
        weights.lm_head,
    ]
    for layer in weights.layers:
        candidates += [
            layer.attn_norm.weight,
            layer.attn_norm.bias,
            layer.qkv_weight,
            layer.qkv_bias,
            layer.q_norm,
            layer.k_norm,
            layer.o_weight,
            layer.o_bias,
            layer.mlp_norm.weight,
            layer.mlp_norm.bias,
            layer.up_weight,
            layer.up_bias,
            layer.down_weight,
            layer.down_bias,
        ]
    tensors: list[torch.Tensor] = []
    for candidate in candidates:
        if isinstance(candidate, QuantizedLinear):
            tensors += [candidate.packed, candidate.scales, candidate.dense]
        elif candidate is not None:
            tensors.append(candidate)
    for tensor in tensors:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield tensor
