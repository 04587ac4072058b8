"""The backend of generative models (``backend: huggingface``, ``task: text-generation``).

An instance loads the causal LM (a Hugging Face folder or a GGUF file), its tokenizer and chat
template, allocates the paged KV cache and declares a :class:`GenerationModel` in its
:class:`~gpuserve.backends.base.Capabilities`: the generation runner's engine then runs its
step loop on this instance's thread, calling :meth:`GenerationModel.forward` once per step.
The batch stages of other backends (``preprocess``/``forward``/``postprocess``) are never
called.

Its served tensors are those of Triton's vLLM backend, so that backend's clients work
unchanged: ``text_input`` (BYTES), optional ``stream`` (BOOL), ``sampling_parameters`` (BYTES,
a JSON object) and ``exclude_input_in_output`` (BOOL) in; ``text_output`` (BYTES) out; the
model is decoupled.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpuserve.backends.base import Backend, Capabilities, LoadContext
from gpuserve.backends.causal_lm.accuracy import GenerationAccuracy
from gpuserve.backends.causal_lm.gate import check_generation
from gpuserve.backends.causal_lm.graphs import DEFAULT_MAX_BATCH, DecodeGraphs
from gpuserve.backends.causal_lm.loader import LoadedCausalLM, load_causal_lm
from gpuserve.backends.causal_lm.model import CausalLM
from gpuserve.backends.causal_lm.step import StepBatch
from gpuserve.backends.hf_folder import model_source
from gpuserve.config import ModelConfig
from gpuserve.config.generate import GenerateConfig
from gpuserve.config.model import TensorSpec
from gpuserve.datatypes import Datatype
from gpuserve.errors import BackendError, ConfigError

logger = logging.getLogger(__name__)

#: Inputs and outputs of Triton's vLLM backend: name -> (datatype, optional).
INPUTS: dict[str, tuple[Datatype, bool]] = {
    "text_input": ("BYTES", False),
    "stream": ("BOOL", True),
    "sampling_parameters": ("BYTES", True),
    "exclude_input_in_output": ("BOOL", True),
}
OUTPUT = "text_output"

#: KV cache of a CPU instance when the config sets none: at most this many bytes.
CPU_CACHE_CAP_BYTES = 2 << 30
#: Share of a GPU's free memory (after the weights) the KV cache takes by default.
GPU_CACHE_SHARE = 0.8

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(slots=True)
class GenerationModel:
    """A loaded causal LM with its tokenizer and KV cache, as the generation engine uses it.

    Attributes:
        loaded: The model, tokenizer and chat template.
        device: Torch device of the weights and cache.
        num_blocks: Blocks of the KV cache.
        block_size: Tokens per block.
        context_length: Longest sequence (prompt + output), tokens.
        eos_token_ids: Tokens that end a sequence (unless ``ignore_eos``).
        chat_template: Jinja chat template (the config's, the tokenizer's or the GGUF's).
        graphs: Decode steps replayed from CUDA graphs (:mod:`.graphs`), or None: every
            step runs eagerly.
    """

    loaded: LoadedCausalLM
    device: str
    num_blocks: int
    block_size: int
    context_length: int
    eos_token_ids: tuple[int, ...]
    chat_template: str | None
    graphs: DecodeGraphs | None = None

    @property
    def tokenizer(self) -> Any:
        """The transformers tokenizer (encode on the event loop, decode on the engine)."""
        return self.loaded.tokenizer

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """One engine step: float32 logits ``[sampling chunks, vocab]``."""
        with torch.inference_mode():
            graphs = self.graphs
            if graphs is not None and graphs.takes(batch):
                return graphs.run(batch)
            return self.loaded.model.forward(batch)

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt (with the special tokens the tokenizer adds)."""
        return list(self.tokenizer.encode(text))

    def encode_chat(self, rendered: str) -> list[int]:
        """Token ids of a rendered chat (its template wrote the special tokens itself)."""
        return list(self.tokenizer.encode(rendered, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        """The text of token ids (special tokens kept: a prompt as the model saw it)."""
        return str(self.tokenizer.decode(token_ids))

    @property
    def vocab_size(self) -> int:
        """Width of the model's logits: token ids are below it."""
        return self.loaded.model.info.vocab_size

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        """The prompt text of a conversation, by the model's chat template, ready for the
        assistant's turn.

        Raises:
            ValueError: the model has no chat template (message says so).
        """
        if not self.chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        rendered = self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=True,
        )
        return str(rendered)

    def token_text(self, token_id: int) -> str:
        """The text of one token alone (logprobs)."""
        return str(self.tokenizer.decode([token_id]))


class CausalLMBackend(Backend):
    """Generative models (module docstring)."""

    def __init__(self) -> None:
        self.generation: GenerationModel | None = None
        #: The load-time accuracy measurement (None: fp32 weights, or the gate is off).
        self.accuracy: GenerationAccuracy | None = None

    @classmethod
    def complete_config(
        cls, config: ModelConfig, version_path: Path, *, auto_complete: bool = True
    ) -> ModelConfig:
        """Fill in the vLLM-backend tensors, ``decoupled: true`` and the ``generate``
        section; check the model's weights are there.

        Raises:
            ConfigError: declared tensors that are not the generator's, or no weights.
        """
        model_source(config, version_path)
        declared_in = {t.name for t in config.inputs}
        declared_out = {t.name for t in config.outputs}
        unknown = sorted((declared_in - set(INPUTS)) | (declared_out - {OUTPUT}))
        if unknown:
            raise ConfigError(
                f"model '{config.name}': a generative model serves inputs "
                f"{sorted(INPUTS)} and output {OUTPUT!r}; the config declares {unknown}"
            )
        inputs = [
            TensorSpec(name=name, datatype=datatype, shape=[1], optional=optional)
            for name, (datatype, optional) in INPUTS.items()
        ]
        outputs = [TensorSpec(name=OUTPUT, datatype="BYTES", shape=[-1])]
        policy = config.model_transaction_policy.model_copy(update={"decoupled": True})
        return config.model_copy(
            update={
                "inputs": inputs,
                "outputs": outputs,
                "max_batch_size": 0,
                "model_transaction_policy": policy,
                "generate": config.generate or GenerateConfig(),
            }
        )

    def load(self, context: LoadContext) -> None:
        config = context.config
        settings = config.generate or GenerateConfig()
        dtype = _DTYPES.get(config.precision)
        if dtype is None:
            raise ConfigError(
                f"model '{config.name}': precision {config.precision!r} is not supported for "
                f"generative models (expected one of {sorted(_DTYPES)}; for int8 or int4 "
                "weights use precision bf16 with generate.weight_format)"
            )
        weight_format = settings.weight_format
        if weight_format and context.device.startswith("cpu") and dtype != torch.bfloat16:
            raise ConfigError(
                f"model '{config.name}': generate.weight_format {weight_format} on a CPU needs "
                f"precision bf16 (its kernels take bf16 activations), got precision "
                f"{config.precision}"
            )
        source = model_source(config, context.version_path)
        loaded = load_causal_lm(source, dtype, context.device, weight_format=weight_format)
        self.accuracy = None
        if config.precision != "fp32" or weight_format:
            label = config.precision + (f"+{weight_format}" if weight_format else "")
            self.accuracy = check_generation(
                loaded,
                source,
                label,
                config.precision_check,
                context.version_path,
                context.device,
            )
        model_length = loaded.context_length
        context_length = settings.context_length or min(model_length, settings.max_context_length)
        if context_length > model_length:
            raise ConfigError(
                f"model '{config.name}': generate.context_length {context_length} exceeds the "
                f"model's own context length {model_length}"
            )
        block_size = settings.block_size
        per_block = loaded.model.cache_bytes_per_block(block_size)
        budget = settings.kv_cache_bytes or _default_cache_bytes(
            context.device, per_block, block_size, settings.max_running, context_length
        )
        num_blocks = budget // per_block
        needed = -(-context_length // block_size)
        if num_blocks < needed:
            raise ConfigError(
                f"model '{config.name}': a KV cache of {budget} bytes holds {num_blocks} "
                f"blocks of {block_size} tokens, fewer than one sequence of the context "
                f"length ({context_length} tokens = {needed} blocks) needs; raise "
                "generate.kv_cache_bytes or lower generate.context_length"
            )
        graphed = settings.cuda_graphs and context.device.startswith("cuda")
        # with graphs, one more block than the sequences get: the padding rows' scratch
        loaded.model.allocate_cache(num_blocks + 1 if graphed else num_blocks, block_size)
        graphs = None
        if graphed:
            graphs = decode_graphs(loaded.model, settings, num_blocks, context_length)
        self.generation = GenerationModel(
            loaded=loaded,
            device=context.device,
            num_blocks=num_blocks,
            block_size=block_size,
            context_length=context_length,
            eos_token_ids=tuple(loaded.eos_token_ids),
            chat_template=settings.chat_template or loaded.chat_template,
            graphs=graphs,
        )
        logger.info(
            "model %s: %s, context %d tokens, KV cache %d blocks of %d tokens (%.1f MiB)",
            config.name,
            loaded.name,
            context_length,
            num_blocks,
            block_size,
            num_blocks * per_block / 2**20,
        )

    def capabilities(self) -> Capabilities:
        return Capabilities(generation=self.generation)

    def preprocess(self, inputs: dict[str, np.ndarray]) -> Any:
        raise BackendError("a generative model runs on the generation engine, not in batches")

    def forward(self, prepared: Any) -> Any:
        raise BackendError("a generative model runs on the generation engine, not in batches")

    def postprocess(self, raw: Any) -> dict[str, np.ndarray]:
        raise BackendError("a generative model runs on the generation engine, not in batches")

    def unload(self) -> None:
        self.generation = None


def decode_graphs(
    model: CausalLM, settings: GenerateConfig, scratch_block: int, context_length: int
) -> DecodeGraphs:
    """Record the CUDA graphs of decode steps (:mod:`.graphs`) for a model whose cache is
    allocated with ``scratch_block`` as its last block."""
    cache = model.cache
    assert cache is not None
    graphs = DecodeGraphs(
        model.forward,
        torch.device(model.device),
        cache.block_size,
        max_blocks=-(-context_length // cache.block_size),
        scratch_block=scratch_block,
        max_batch=settings.cuda_graph_max_batch or min(settings.max_running, DEFAULT_MAX_BATCH),
        capture=True,
        in_place=model.attention_name == "flash_attn",
    )
    graphs.capture_all()
    return graphs


def _default_cache_bytes(
    device: str, per_block: int, block_size: int, max_running: int, context_length: int
) -> int:
    """KV cache budget when the config sets none (see ``GenerateConfig.kv_cache_bytes``)."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free * GPU_CACHE_SHARE)
    blocks = max_running * -(-context_length // block_size)
    return min(blocks * per_block, CPU_CACHE_CAP_BYTES)


__all__ = ["INPUTS", "OUTPUT", "CausalLMBackend", "GenerationModel", "model_source"]
