"""Causal language models served over a paged KV cache.

* :mod:`.step`: the batch of one engine step (:class:`ChunkInput` -> :class:`StepBatch`).
* :mod:`.model`: :class:`CausalLM`, the forward pass of Llama, Mistral, Qwen2, Qwen3 and
  GPT-2 models; :mod:`.attention` its paged attention.
* :mod:`.loader`: :func:`load_causal_lm` from a Hugging Face folder or a GGUF file
  (:mod:`.weights`, :mod:`.gguf_file`, :mod:`.architectures`).
"""

from __future__ import annotations

from gpuserve.backends.causal_lm.architectures import SUPPORTED_ARCHITECTURES
from gpuserve.backends.causal_lm.gguf_file import GGUF_ARCHITECTURES
from gpuserve.backends.causal_lm.loader import LoadedCausalLM, load_causal_lm
from gpuserve.backends.causal_lm.model import CausalLM, CausalLMInfo, KVCache
from gpuserve.backends.causal_lm.step import ChunkInput, StepBatch

__all__ = [
    "GGUF_ARCHITECTURES",
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "CausalLMInfo",
    "ChunkInput",
    "KVCache",
    "LoadedCausalLM",
    "StepBatch",
    "load_causal_lm",
]
