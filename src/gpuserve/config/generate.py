"""The ``generate:`` section of a model's config: a generative (causal) language model served
with continuous batching over a paged KV cache.

A model with this section (or ``backend: huggingface`` with ``huggingface.task:
text-generation``) runs on the generation runner: every engine step runs the next token of
every running sequence plus prefill chunks of new prompts, within ``max_tokens_per_step``.
Its KV cache is split into blocks of ``block_size`` tokens; a sequence holds a table of blocks,
prompts that start alike share their full blocks (prefix caching), and when blocks run out the
newest sequence is preempted and recomputed later (never an out-of-memory error).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from gpuserve.config.base import Strict


class SamplingDefaults(Strict):
    """Defaults for the sampling values a request leaves out (OpenAI's names).

    Attributes:
        max_tokens: Tokens generated when the request names no ``max_tokens``.
        temperature: 0 is greedy decoding.
        top_p: Nucleus sampling mass, (0, 1].
        top_k: Keep the k most likely tokens; 0 keeps all.
        min_p: Drop tokens below ``min_p`` times the most likely one's probability.
        repetition_penalty: Penalty on tokens already in the prompt or output (1: none).
    """

    max_tokens: int = Field(default=256, ge=1, le=1_000_000)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)


class GenerateConfig(Strict):
    """Serve the model as a text generator (OpenAI ``/v1/completions`` and
    ``/v1/chat/completions``, Triton's generate extension, V2 infer and gRPC streams with the
    tensors of Triton's vLLM backend).

    Attributes:
        context_length: Longest sequence (prompt + generated tokens), tokens. None: the
            model's own (``max_position_embeddings``, the GGUF ``context_length``), capped at
            ``max_context_length``.
        max_context_length: Cap on the context length taken from the model, tokens.
        kv_cache_bytes: Memory for the KV cache, bytes. None: on a GPU, 80% of what is free
            after loading the weights; on a CPU, enough for ``max_running`` sequences of
            ``context_length`` tokens, at most 2 GiB.
        block_size: Tokens per KV cache block.
        max_running: Most sequences generating at once (the decode batch).
        max_tokens_per_step: Token budget of one engine step (decodes first, then prefill
            chunks): a long prompt is prefilled in chunks of at most this size, so running
            sequences keep getting their next tokens.
        decode_slowdown_limit: While sequences are decoding, prompt chunks are cut so that a
            step takes at most this many times a step of the same decodes alone (costs learnt
            from the steps run: decode steps per batch size, prompt tokens by their position
            and chunk size): prompts arriving never stall the running streams' next tokens by
            more than this factor (at the cost of their own time to first token). None: every
            step may fill ``max_tokens_per_step`` with prompt chunks.
        max_waiting: Most sequences waiting for a slot; more are refused with 429.
        prefix_caching: Reuse the KV blocks of prompt prefixes already computed (a shared
            system prompt is computed once).
        max_n: Most completions one request may ask for (``n``).
        max_stop_strings: Most stop strings one request may give.
        max_top_logprobs: Largest ``top_logprobs`` a request may ask for.
        sampling: Defaults for sampling values a request leaves out.
        chat_template: A Jinja chat template replacing the model's own (the tokenizer's, or
            the GGUF file's ``tokenizer.chat_template``).
        cuda_graphs: On a CUDA device, replay steps of decodes alone from CUDA graphs
            recorded at load, one per batch-size bucket (and, without FlashAttention, per
            block-table width); False: every step runs eagerly, as vLLM's
            ``enforce_eager``. Ignored on a CPU.
        cuda_graph_max_batch: The largest decode batch recorded (buckets 1, 2, 4, 8, then
            multiples of 8 up to it); larger decode steps run eagerly. None: ``max_running``,
            at most 256.
        weight_format: Weight-only quantisation of the linear layers and the output
            projection: ``int8`` (one scale per output channel) or ``int4`` (groups of 32
            input channels, a scale and an offset each, as llama.cpp's Q4_1); activations and
            the KV cache stay in ``precision``, which must then be ``bf16`` on a CPU (the
            int8/int4 kernels take bf16 activations). None: weights in ``precision``.
            Checked against fp32 at load by ``precision_check`` (token agreement and
            perplexity).
    """

    context_length: int | None = Field(default=None, ge=16, le=1_048_576)
    max_context_length: int = Field(default=8192, ge=16, le=1_048_576)
    kv_cache_bytes: int | None = Field(default=None, ge=1)
    block_size: int = Field(default=16, ge=1, le=1024)
    max_running: int = Field(default=64, ge=1, le=4096)
    max_tokens_per_step: int = Field(default=512, ge=1, le=1_048_576)
    decode_slowdown_limit: float | None = Field(default=2.0, ge=1.1, le=1000.0)
    max_waiting: int = Field(default=1024, ge=1, le=1_000_000)
    prefix_caching: bool = True
    max_n: int = Field(default=16, ge=1, le=256)
    max_stop_strings: int = Field(default=16, ge=0, le=256)
    max_top_logprobs: int = Field(default=20, ge=0, le=100)
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults)
    chat_template: str | None = None
    cuda_graphs: bool = True
    cuda_graph_max_batch: int | None = Field(default=None, ge=1, le=4096)
    weight_format: Literal["int8", "int4"] | None = None

    @model_validator(mode="after")
    def _check(self) -> GenerateConfig:
        if self.context_length is not None and self.context_length > self.max_context_length:
            self.max_context_length = self.context_length
        return self


__all__ = ["GenerateConfig", "SamplingDefaults"]
