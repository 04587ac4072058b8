"""A generative model's sampling defaults and limits, from its ``generate:`` section: read the
same way by every front end's decoding (OpenAI bodies, the vLLM backend's tensors)."""

from __future__ import annotations

from gpuserve.backends.causal_lm.params import SamplingLimits, SamplingParams
from gpuserve.config.generate import GenerateConfig


def sampling_defaults(settings: GenerateConfig | None) -> SamplingParams:
    """The sampling values of a request that names none (``generate.sampling``)."""
    sampling = (settings or GenerateConfig()).sampling
    return SamplingParams(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        repetition_penalty=sampling.repetition_penalty,
    )


def sampling_limits(settings: GenerateConfig | None) -> SamplingLimits:
    """Caps on ``n``, stop strings and ``top_logprobs`` (``generate.max_*``)."""
    settings = settings or GenerateConfig()
    return SamplingLimits(
        max_stop_strings=settings.max_stop_strings,
        max_top_logprobs=settings.max_top_logprobs,
        max_n=settings.max_n,
    )


__all__ = ["sampling_defaults", "sampling_limits"]
