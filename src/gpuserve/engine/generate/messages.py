"""Typed messages between the generation runner (event loop) and its engine (instance thread).

The runner hands the engine :class:`GenerationRequest` objects; the engine answers each with a
series of :class:`GenerationDelta` objects, the last one ``finished``. Nothing here is a tuple.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpuserve.backends.causal_lm.params import SamplingParams
from gpuserve.errors import GpuserveError

#: Why a sequence ended: its stop condition (EOS, a stop token or string), its token limit
#: (``max_tokens`` or the context length), the client went away, its deadline passed, or
#: the engine failed it.
FINISH_REASONS = ("stop", "length", "abort", "timeout", "error")


@dataclass(slots=True)
class GenerationRequest:
    """One sequence to generate.

    Attributes:
        request_id: The caller's id (logs, traces).
        prompt_ids: The prompt's token ids, int, at least one.
        params: Its sampling values (validated).
        deadline_s: Monotonic time after which it is ended with ``timeout``; None: none.
        arrival_s: When it was admitted, monotonic seconds.
        bulk: Bulk work (the bulk lane): it waits behind interactive sequences.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    deadline_s: float | None = None
    arrival_s: float = 0.0
    bulk: bool = False


@dataclass(slots=True)
class GenerationInput:
    """A generation asked for through a typed API (OpenAI's), before tokenisation: what a
    front end decodes into :attr:`InferenceRequest.generation
    <gpuserve.engine.request.InferenceRequest.generation>`. The generation runner renders
    and tokenises it (the tokenizer is the loaded model's).

    Attributes:
        params: Validated sampling values (the model's defaults filled in).
        prompt: The prompt: text, or token ids (``/v1/completions``); None for a chat.
        messages: The conversation (``/v1/chat/completions``): OpenAI's message objects with
            ``role`` and text ``content``; rendered by the model's chat template.
        echo: Put the prompt text before the generated text (``/v1/completions``).
    """

    params: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    echo: bool = False


@dataclass(slots=True)
class TokenLogprob:
    """The log-probability of one generated token and, when asked, the best alternatives.

    Attributes:
        token_id: The token generated.
        text: Its text (as decoded alone).
        logprob: Natural log of its probability.
        top: The ``top_logprobs`` most likely tokens at that step, best first, as
            (token id, text, logprob).
    """

    token_id: int
    text: str
    logprob: float
    top: list[TopLogprob] = field(default_factory=list)


@dataclass(slots=True)
class TopLogprob:
    """One alternative of :attr:`TokenLogprob.top`."""

    token_id: int
    text: str
    logprob: float


@dataclass(slots=True)
class GenerationDelta:
    """What one engine step added to a sequence (or how it ended).

    Attributes:
        text: New text: whole UTF-8 characters only, with stop strings held back until
            they are told apart from ordinary text.
        token_ids: Token ids generated since the previous delta.
        logprobs: One entry per token of ``token_ids`` when the request asked for logprobs.
        finished: Nothing follows.
        finish_reason: One of :data:`FINISH_REASONS` when finished.
        prompt_tokens: Tokens of the prompt.
        completion_tokens: Tokens generated so far.
        cached_tokens: Prompt tokens whose KV came from the prefix cache.
        error: Why the engine failed it (``finish_reason`` ``error``), else None.
    """

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    error: GpuserveError | None = None


__all__ = [
    "FINISH_REASONS",
    "GenerationDelta",
    "GenerationInput",
    "GenerationRequest",
    "TokenLogprob",
    "TopLogprob",
]
