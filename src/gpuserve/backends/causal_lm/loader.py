"""``load_causal_lm``: a Hugging Face folder or a GGUF file -> a :class:`CausalLM` ready to
serve, with its tokenizer, chat template, context length and end-of-sequence ids."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpuserve.backends.causal_lm.architectures import ModelSpec, spec_from_config, token_ids
from gpuserve.backends.causal_lm.gguf_file import open_gguf
from gpuserve.backends.causal_lm.model import CausalLM
from gpuserve.backends.causal_lm.quantize import WEIGHT_FORMATS
from gpuserve.backends.causal_lm.weights import (
    ModelWeights,
    TensorSource,
    build_weights,
    folder_source,
    quantize_weights,
    read_config,
)
from gpuserve.backends.optional import library_lock, require
from gpuserve.errors import ConfigError

logger = logging.getLogger(__name__)

#: Serving dtypes a causal LM accepts.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(slots=True)
class LoadedCausalLM:
    """A loaded causal LM and what serving it needs.

    Attributes:
        model: The model (no KV cache yet: call ``model.allocate_cache``).
        tokenizer: A ``transformers`` tokenizer, or None when loaded without one.
        chat_template: The Jinja chat template (the tokenizer's, else the GGUF metadata's),
            or None when the model has none.
        context_length: Longest sequence, tokens (prompt and generation together).
        eos_token_ids: Ids that end a generation: ``generation_config.json``'s when it names
            any, else the config's (GGUF: ``eos`` and ``eot`` token ids).
        name: The folder's name, or the GGUF file's name without ``.gguf``.
    """

    model: CausalLM
    tokenizer: Any
    chat_template: str | None
    context_length: int
    eos_token_ids: tuple[int, ...]
    name: str


def load_causal_lm(
    path: Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    load_tokenizer: bool = True,
    weight_format: str | None = None,
) -> LoadedCausalLM:
    """Load a causal LM for serving.

    Args:
        path: A Hugging Face folder (``config.json`` with ``*.safetensors``, possibly sharded,
            or ``pytorch_model.bin``) or a ``.gguf`` file.
        dtype: Serving dtype of the weights and the KV cache (float32, bfloat16, float16).
        device: Where the model runs (``cpu``, ``cuda``, ``cuda:1``).
        load_tokenizer: Load the tokenizer with ``transformers`` (``AutoTokenizer``); False
            leaves ``tokenizer`` None (tests, or a caller with its own tokenizer).
        weight_format: ``int8`` or ``int4``: the weight matrices quantised from float32
            (:mod:`gpuserve.backends.causal_lm.quantize`); None keeps them in ``dtype``.

    Raises:
        ConfigError: the path is neither, the architecture or one of its settings is not
            supported, a weight is missing, the dtype is not one of :data:`DTYPES`, or the
            weight format is unknown or does not fit the model (int4: widths a multiple
            of 32).
        MissingDependencyError: ``transformers`` (for the tokenizer) or ``gguf`` is missing.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"causal LM dtype {dtype} is not supported (supported: {DTYPES})")
    if weight_format is not None and weight_format not in WEIGHT_FORMATS:
        raise ConfigError(
            f"weight format {weight_format!r} is not supported (supported: {WEIGHT_FORMATS})"
        )
    path = Path(path)
    target = torch.device(device)
    started = time.monotonic()
    if path.is_file() and path.suffix == ".gguf":
        loaded = _load_gguf(path, dtype, target, load_tokenizer, weight_format)
    elif path.is_dir():
        loaded = _load_folder(path, dtype, target, load_tokenizer, weight_format)
    else:
        raise ConfigError(f"{path}: expected a Hugging Face model folder or a .gguf file")
    info = loaded.model.info
    logger.info(
        "loaded causal LM %s (%s, %d layers, %d heads / %d kv heads, vocab %d, %s on %s, "
        "weights %s, %.1f MB of weights) in %.2f s",
        loaded.name,
        info.architecture,
        info.num_layers,
        info.num_heads,
        info.num_kv_heads,
        info.vocab_size,
        dtype,
        target,
        weight_format or "unquantised",
        loaded.model.weight_bytes / 1e6,
        time.monotonic() - started,
    )
    return loaded


def _weights(
    spec: ModelSpec,
    source: TensorSource,
    dtype: torch.dtype,
    device: torch.device,
    where: str,
    weight_format: str | None,
) -> ModelWeights:
    if weight_format is None:
        return build_weights(spec, source, dtype, device, where)
    full = build_weights(spec, source, torch.float32, device, where)
    try:
        return quantize_weights(full, weight_format, dtype, device)
    except ValueError as err:
        raise ConfigError(f"{where}: {err}") from None


def _load_folder(
    folder: Path,
    dtype: torch.dtype,
    device: torch.device,
    load_tokenizer: bool,
    weight_format: str | None,
) -> LoadedCausalLM:
    spec = spec_from_config(read_config(folder), source=str(folder / "config.json"))
    with folder_source(folder) as source:
        weights = _weights(spec, source, dtype, device, str(folder), weight_format)
    model = CausalLM(spec, weights, dtype, device)
    eos = _generation_eos(folder) or spec.eos_token_ids
    tokenizer = _tokenizer(str(folder), None) if load_tokenizer else None
    return LoadedCausalLM(
        model=model,
        tokenizer=tokenizer,
        chat_template=getattr(tokenizer, "chat_template", None),
        context_length=spec.max_position,
        eos_token_ids=eos,
        name=folder.name,
    )


def _load_gguf(
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    load_tokenizer: bool,
    weight_format: str | None,
) -> LoadedCausalLM:
    gguf = open_gguf(path)
    with gguf.tensors as source:
        weights = _weights(gguf.spec, source, dtype, device, str(path), weight_format)
    model = CausalLM(gguf.spec, weights, dtype, device)
    tokenizer = _tokenizer(str(path.parent), path.name) if load_tokenizer else None
    template = getattr(tokenizer, "chat_template", None) or gguf.chat_template
    return LoadedCausalLM(
        model=model,
        tokenizer=tokenizer,
        chat_template=template,
        context_length=gguf.spec.max_position,
        eos_token_ids=gguf.spec.eos_token_ids,
        name=path.stem,
    )


def _generation_eos(folder: Path) -> tuple[int, ...]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        config = json.loads(path.read_text())
    except ValueError as err:
        raise ConfigError(f"{path}: not valid JSON: {err}") from None
    return token_ids(config.get("eos_token_id")) if isinstance(config, dict) else ()


def _tokenizer(folder: str, gguf_file: str | None) -> Any:
    transformers = require("transformers", "generative models", ("AutoTokenizer",))
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    # from_pretrained is not safe to run from two threads at once (see backends.optional)
    with library_lock("transformers"):
        return transformers.AutoTokenizer.from_pretrained(folder, **kwargs)
