"""OpenAI's answers to completions and chat calls: the whole answer, the streamed chunks and
the usage, as JSON bytes.

* completions: ``text_completion`` objects, choices with ``text``, ``logprobs`` (``tokens``,
  ``token_logprobs``, ``top_logprobs`` as ``{token: logprob}``, ``text_offset``) and
  ``finish_reason``;
* chat: a ``chat.completion`` with ``message`` per choice, or ``chat.completion.chunk``
  events with ``delta`` (the first of each choice carries ``role``), ``logprobs.content``
  entries with ``token``, ``logprob``, ``bytes`` and ``top_logprobs``;
* ``usage``: ``prompt_tokens``, ``completion_tokens``, ``total_tokens`` and
  ``prompt_tokens_details.cached_tokens`` (prompt tokens served from the prefix cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from gpuserve.engine.generate.messages import TokenLogprob
from gpuserve.protocol.openai_generate import GenerationBody


@dataclass(slots=True)
class ChoiceState:
    """What one choice has produced so far.

    Attributes:
        index: Its index in the answer.
        text: Its text (the prompt first when echoed).
        logprobs: One entry per generated token when asked.
        finish_reason: ``stop`` or ``length`` once finished, else None.
        prompt_tokens / completion_tokens / cached_tokens: Its usage.
        offset: Characters of text before the next token (completions' ``text_offset``).
    """

    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    offset: int = 0


def usage(choices: list[ChoiceState], prompts: int) -> dict[str, Any]:
    """The call's usage: each prompt counted once (its ``n`` choices share it)."""
    per_prompt: dict[int, ChoiceState] = {}
    n = max(1, len(choices) // max(1, prompts))
    for choice in choices:
        per_prompt.setdefault(choice.index // n, choice)
    prompt = sum(c.prompt_tokens for c in per_prompt.values())
    cached = sum(c.cached_tokens for c in per_prompt.values())
    completion = sum(c.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def answer(body: GenerationBody, created: int, choices: list[ChoiceState]) -> bytes:
    """The whole answer of a call that did not stream."""
    if body.kind == "chat":
        listed = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": _chat_logprobs(c.logprobs) if body.logprobs else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ]
        obj = "chat.completion"
    else:
        listed = [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": _completion_logprobs(c.logprobs, c.offset, body.top_logprobs)
                if body.logprobs
                else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ]
        obj = "text_completion"
    document = {
        "id": body.id,
        "object": obj,
        "created": created,
        "model": body.model,
        "choices": listed,
        "usage": usage(choices, max(1, len(body.prompts))),
    }
    return orjson.dumps(document)


def chunk(
    body: GenerationBody,
    created: int,
    index: int,
    text: str,
    logprobs: list[TokenLogprob] | None,
    finish_reason: str | None,
    *,
    first: bool = False,
    offset: int = 0,
) -> bytes:
    """One streamed event of one choice."""
    entry: dict[str, Any] = {"index": index}
    if body.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
        if text and not first:
            delta["content"] = text
        entry["delta"] = delta
        entry["logprobs"] = _chat_logprobs(logprobs) if body.logprobs and logprobs else None
    else:
        entry["text"] = text
        entry["logprobs"] = (
            _completion_logprobs(logprobs, offset, body.top_logprobs)
            if body.logprobs and logprobs
            else None
        )
    entry["finish_reason"] = finish_reason
    document: dict[str, Any] = {
        "id": body.id,
        "object": "chat.completion.chunk" if body.kind == "chat" else "text_completion",
        "created": created,
        "model": body.model,
        "choices": [entry],
    }
    if body.include_usage:
        document["usage"] = None
    return orjson.dumps(document)


def usage_chunk(body: GenerationBody, created: int, choices: list[ChoiceState]) -> bytes:
    """The last event when ``stream_options.include_usage``: no choices, the usage."""
    document: dict[str, Any] = {
        "id": body.id,
        "object": "chat.completion.chunk" if body.kind == "chat" else "text_completion",
        "created": created,
        "model": body.model,
        "choices": [],
        "usage": usage(choices, max(1, len(body.prompts))),
    }
    return orjson.dumps(document)


def _chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e.text,
                "logprob": e.logprob,
                "bytes": list(e.text.encode()),
                "top_logprobs": [
                    {"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())}
                    for t in e.top
                ],
            }
            for e in entries
        ],
        "refusal": None,
    }


def _completion_logprobs(entries: list[TokenLogprob], offset: int, top: int) -> dict[str, Any]:
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.text)
    return {
        "tokens": [e.text for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t.text: t.logprob for t in e.top} for e in entries] if top else None,
        "text_offset": offsets,
    }


__all__ = ["ChoiceState", "answer", "chunk", "usage", "usage_chunk"]
