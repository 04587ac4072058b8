"""OpenAI's text generation wire: ``POST /v1/completions`` and ``POST /v1/chat/completions``.

Bodies are parsed into a :class:`GenerationBody` (field types checked here, each error naming
the field and what it expects); each sequence of it (a prompt times ``n``) becomes one
:class:`GenerationWire`, the inference service's ``WireRequest``, decoded against the model's
configuration (its sampling defaults and limits) into a request with a ``generation`` input.

Accepted fields. Both: ``model``, ``max_tokens`` / ``max_completion_tokens``, ``temperature``,
``top_p``, ``n``, ``stream``, ``stream_options.include_usage``, ``stop``, ``seed``,
``presence_penalty``, ``frequency_penalty``, ``user`` (ignored), and the extra sampling
fields of vLLM's server: ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``, ``include_stop_str_in_output``.
Completions: ``prompt`` (a string, token ids, or a list of either), ``echo``, ``logprobs``
(an integer, 0-20: that many alternatives per token). Chat: ``messages`` (``role`` and
``content``, a string or a list of text parts), ``logprobs`` (bool) and ``top_logprobs``.
What gpuserve cannot honour is refused, never ignored: ``tools`` / ``functions``,
``response_format`` other than text, ``logit_bias``, ``suffix``, ``best_of`` other than ``n``,
content parts other than text.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from gpuserve.backends.causal_lm.params import (
    FIELDS,
    n_from_mapping,
    sampling_params_from_mapping,
)
from gpuserve.config import ModelConfig
from gpuserve.engine.generate.defaults import sampling_defaults, sampling_limits
from gpuserve.engine.generate.messages import GenerationInput
from gpuserve.engine.request import InferenceRequest
from gpuserve.errors import InvalidInputError

#: Most prompts in one ``/v1/completions`` call, and most choices ``n`` of one call before the
#: model's own ``generate.max_n`` is known.
MAX_PROMPTS = 64
MAX_N = 128

Kind = Literal["completion", "chat"]

#: Sampling fields taken from the body as they are (``logprobs`` and ``top_logprobs`` differ
#: between the two endpoints and are read by :func:`parse_generation`).
_SAMPLING = tuple(f for f in FIELDS if f not in ("logprobs", "top_logprobs"))
_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(slots=True)
class GenerationBody:
    """One completions or chat call, its fields checked for type.

    Attributes:
        kind: ``completion`` or ``chat``.
        model: The model name.
        prompts: Completions: each prompt (text or token ids); chat: empty.
        messages: Chat: the conversation (role and text content); else None.
        sampling: The sampling fields as given (validated against the model at decode).
        n: Choices per prompt.
        stream: Answer as server-sent events.
        include_usage: ``stream_options.include_usage``: a last event with the usage.
        echo: Completions: the prompt before the generated text.
        logprobs: Report log-probabilities of the generated tokens.
        top_logprobs: Alternatives per token (completions: the ``logprobs`` integer).
        id: The call's id (``cmpl-...`` / ``chatcmpl-...``).
    """

    kind: Kind
    model: str
    prompts: list[str | list[int]]
    messages: list[dict[str, Any]] | None
    sampling: dict[str, Any]
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    id: str = field(default="")

    @property
    def sequences(self) -> int:
        """Sequences of the call: prompts times ``n``."""
        return max(1, len(self.prompts)) * self.n

    def wires(self) -> list[GenerationWire]:
        """One wire request per sequence, in choice order (prompt-major, as OpenAI's)."""
        count = len(self.prompts) if self.kind == "completion" else 1
        return [GenerationWire(self, p, j) for p in range(count) for j in range(self.n)]


def parse_generation(document: dict[str, Any], kind: Kind) -> GenerationBody:
    """Check a completions (``kind`` ``completion``) or chat body (module docstring).

    Raises:
        InvalidInputError: a missing or mistyped field, or one gpuserve cannot honour;
            the message names it.
    """
    model = document.get("model")
    if not isinstance(model, str) or not model:
        problem = "is required" if model is None else f"must be a non-empty string, got {model!r}"
        raise InvalidInputError(f"'model' {problem}: the name of a generative model", param="model")
    _refuse_unsupported(document, kind)
    sampling = {key: document[key] for key in _SAMPLING if document.get(key) is not None}
    n = document.get("n")
    n = 1 if n is None else n
    if type(n) is not int or not 1 <= n <= MAX_N:
        raise InvalidInputError(f"'n' must be an integer in [1, {MAX_N}], got {n!r}", param="n")
    stream = _flag(document, "stream")
    options = document.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise InvalidInputError("'stream_options' must be an object", param="stream_options")
        if not stream:
            raise InvalidInputError(
                "'stream_options' is only allowed with 'stream': true", param="stream_options"
            )
        include_usage = _flag(options, "include_usage", "stream_options.include_usage")
    body = GenerationBody(kind, model, [], None, sampling, n, stream, include_usage)
    if kind == "completion":
        body.prompts = _prompts(document.get("prompt"))
        body.echo = _flag(document, "echo")
        logprobs = document.get("logprobs")
        if logprobs is not None:
            if type(logprobs) is not int or not 0 <= logprobs <= 20:
                raise InvalidInputError(
                    f"'logprobs' must be an integer in [0, 20] (alternatives per token), "
                    f"got {logprobs!r}"
                )
            body.logprobs, body.top_logprobs = True, logprobs
        body.id = f"cmpl-{uuid.uuid4().hex}"
    else:
        body.messages = _messages(document.get("messages"))
        body.logprobs = _flag(document, "logprobs")
        top = document.get("top_logprobs")
        if top is not None:
            if type(top) is not int or not 0 <= top <= 20:
                raise InvalidInputError(
                    f"'top_logprobs' must be an integer in [0, 20], got {top!r}",
                    param="top_logprobs",
                )
            if not body.logprobs:
                raise InvalidInputError(
                    "'top_logprobs' needs 'logprobs': true", param="top_logprobs"
                )
            body.top_logprobs = top
        body.id = f"chatcmpl-{uuid.uuid4().hex}"
    return body


class GenerationWire:
    """One sequence of a :class:`GenerationBody` as the inference service's ``WireRequest``.

    Args:
        body: The call.
        prompt: Index of its prompt (completions).
        choice: Its index among the prompt's ``n`` choices (a given ``seed`` is offset by
            it, so choices differ and each repeats).
    """

    __slots__ = ("body", "choice", "prompt")

    def __init__(self, body: GenerationBody, prompt: int, choice: int) -> None:
        self.body = body
        self.prompt = prompt
        self.choice = choice

    def request_id(self) -> str | None:
        return self.body.id

    def decode(
        self, config: ModelConfig, model_name: str, model_version: str | None
    ) -> InferenceRequest:
        body = self.body
        if not config.generates:
            raise InvalidInputError(
                f"model '{model_name}' does not generate text: completions and chat "
                "completions need a generative model"
            )
        limits = sampling_limits(config.generate)
        n_from_mapping({"n": body.n}, limits)
        values = dict(body.sampling)
        if body.logprobs:
            values["logprobs"] = True
            values["top_logprobs"] = body.top_logprobs
        seed = values.get("seed")
        if self.choice and type(seed) is int:
            values["seed"] = seed + self.choice
        params = sampling_params_from_mapping(values, sampling_defaults(config.generate), limits)
        if body.kind == "chat":
            asked = GenerationInput(params, messages=body.messages)
        else:
            asked = GenerationInput(params, prompt=body.prompts[self.prompt], echo=body.echo)
        return InferenceRequest(model_name, model_version, {}, id=body.id, generation=asked)


def _refuse_unsupported(document: dict[str, Any], kind: Kind) -> None:
    for name in ("tools", "functions", "logit_bias", "suffix"):
        value = document.get(name)
        if value not in (None, [], {}, ""):
            raise InvalidInputError(
                f"'{name}' is not supported by this server; leave it out", param=name
            )
    tool_choice = document.get("tool_choice")
    if tool_choice not in (None, "none"):
        raise InvalidInputError(
            "'tool_choice' is not supported (no tools): leave it out", param="tool_choice"
        )
    response_format = document.get("response_format")
    if response_format is not None and (
        not isinstance(response_format, dict) or response_format.get("type") != "text"
    ):
        raise InvalidInputError(
            '\'response_format\' other than {"type": "text"} is not supported; leave it out'
        )
    best_of = document.get("best_of")
    if best_of is not None and best_of != document.get("n", 1):
        raise InvalidInputError(
            "'best_of' is not supported unless it equals 'n'; leave it out", param="best_of"
        )
    if kind == "completion" and document.get("messages") is not None:
        raise InvalidInputError(
            "'messages' belongs to /v1/chat/completions; send 'prompt' here", param="messages"
        )
    if kind == "chat" and document.get("prompt") is not None:
        raise InvalidInputError(
            "'prompt' belongs to /v1/completions; send 'messages' here", param="prompt"
        )


def _flag(document: dict[str, Any], name: str, shown: str | None = None) -> bool:
    value = document.get(name)
    if value is None:
        return False
    if type(value) is not bool:
        raise InvalidInputError(f"'{shown or name}' must be true or false, got {value!r}")
    return value


def _prompts(value: Any) -> list[str | list[int]]:
    """``prompt``: a string, token ids, or a non-empty list of either."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(type(t) is int for t in value):
            return [_token_ids(value, "prompt")]
        if len(value) > MAX_PROMPTS:
            raise InvalidInputError(
                f"'prompt' holds {len(value)} prompts; at most {MAX_PROMPTS} per call",
                param="prompt",
            )
        out: list[str | list[int]] = []
        for i, item in enumerate(value):
            if isinstance(item, str):
                out.append(item)
            elif isinstance(item, list) and item and all(type(t) is int for t in item):
                out.append(_token_ids(item, f"prompt[{i}]"))
            else:
                raise InvalidInputError(
                    f"'prompt[{i}]' must be a string or a non-empty list of token ids",
                    param="prompt",
                )
        return out
    raise InvalidInputError(
        "'prompt' is required: a string, a list of token ids, or a list of either", param="prompt"
    )


def _token_ids(ids: list[int], name: str) -> list[int]:
    bad = next((t for t in ids if t < 0), None)
    if bad is not None:
        raise InvalidInputError(f"'{name}' holds token id {bad}; token ids are >= 0")
    return list(ids)


def _messages(value: Any) -> list[dict[str, Any]]:
    """``messages``: role and text content of each (text parts joined)."""
    if not isinstance(value, list) or not value:
        problem = "is required" if value is None else f"must be a non-empty list, got {value!r:.40}"
        raise InvalidInputError(
            f"'messages' {problem}: a list of message objects", param="messages"
        )
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise InvalidInputError(
                f"'messages[{i}]' must be an object with role and content", param="messages"
            )
        role = message.get("role")
        if role not in _ROLES:
            raise InvalidInputError(
                f"'messages[{i}].role' must be one of {', '.join(_ROLES)}, got {role!r}",
                param="messages",
            )
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):
            content = _text_parts(content, i)
        if not isinstance(content, str):
            raise InvalidInputError(
                f"'messages[{i}].content' must be a string or a list of text parts",
                param="messages",
            )
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _text_parts(parts: list[Any], index: int) -> str:
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidInputError(
                f"'messages[{index}].content[{j}]' is of type {kind!r}: only text parts are "
                "supported by this model"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidInputError(
                f"'messages[{index}].content[{j}].text' must be a string", param="messages"
            )
        texts.append(text)
    return "".join(texts)


__all__ = ["MAX_N", "MAX_PROMPTS", "GenerationBody", "GenerationWire", "parse_generation"]
