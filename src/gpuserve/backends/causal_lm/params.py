"""Per-request sampling parameters of a generative model, and their validation.

:class:`SamplingParams` is what the sampler and the stop-condition code read; it is built once
per request by :func:`sampling_params_from_mapping` from the raw JSON values of an
OpenAI-style request (``temperature``, ``top_p``, ``stop``, ...), over the model's defaults.

Validation is strict, as OpenAI's API is: a number field takes a JSON number (an int where the
field is an integer), never a string, never a boolean (``true`` is not ``1``), never NaN or an
infinity; ``null`` means "not given" (the default applies). Every refusal is an
:class:`~gpuserve.errors.InvalidInputError` (HTTP 400) whose message names the field, the value
received and what was expected::

    temperature must be a number in [0, 2], got 3.5
    top_k must be an integer >= -1 (0 or -1: off), got 'ten' (a string)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from gpuserve.errors import InvalidInputError

#: Seeds that ``torch.Generator.manual_seed`` accepts.
#: The numeric fields :func:`sampling_params_from_mapping` reads (OpenAI's and vLLM's names).
NUMERIC_FIELDS = (
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "min_tokens",
    "top_logprobs",
)
#: Every field :func:`sampling_params_from_mapping` reads.
FIELDS = (
    *NUMERIC_FIELDS,
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "include_stop_str_in_output",
    "skip_special_tokens",
)

_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request's tokens are chosen and when its generation stops.

    Attributes:
        max_tokens: Most tokens to generate (the prompt not counted), >= 1.
        temperature: Divides the logits; 0 is greedy (argmax).
        top_p: Nucleus sampling: the smallest set of most likely tokens whose probability
            mass is at least ``top_p``; 1 is off.
        top_k: Only the ``top_k`` most likely tokens (ties at the boundary kept); 0 or -1
            is off.
        min_p: Drops tokens whose probability is below ``min_p`` times the most likely
            token's; 0 is off.
        repetition_penalty: Hugging Face's: logits of tokens already in the prompt or the
            output are divided by it when positive and multiplied by it when negative; 1 is
            off.
        presence_penalty: OpenAI's: subtracted once from the logit of each token that is in
            the output so far.
        frequency_penalty: OpenAI's: subtracted from a token's logit once per occurrence in
            the output so far.
        seed: Seeds the request's own random generator: the same request with the same seed
            draws the same tokens whatever else runs in its batch. None: unseeded.
        stop: Strings that end the generation when they appear in the output text.
        stop_token_ids: Token ids that end the generation (besides the model's EOS).
        ignore_eos: Keep generating after the model's EOS token (benchmarks).
        min_tokens: EOS and ``stop_token_ids`` are not sampled before this many tokens.
        logprobs: Report the chosen token's log-probability.
        top_logprobs: Also report this many most likely tokens and their log-probabilities.
        include_stop_str_in_output: Keep the matched stop string at the end of the output.
        skip_special_tokens: Leave special tokens out of the output text.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


@dataclass(frozen=True, slots=True)
class SamplingLimits:
    """Server-side bounds on what one request may ask for.

    Attributes:
        max_stop_strings: Most entries in ``stop``.
        max_top_logprobs: Largest ``top_logprobs``.
        max_n: Most choices (``n``) per request; see :func:`n_from_mapping`.
    """

    max_stop_strings: int = 16
    max_top_logprobs: int = 20
    max_n: int = 16


def _describe(value: object) -> str:
    """``value`` as a message quotes it: repr, with the JSON type where it misleads."""
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:40] + "..."
        return f"{shown!r} (a string)"
    if isinstance(value, int | float):
        return repr(value)
    shown = repr(value)
    return f"{shown if len(shown) <= 60 else shown[:60] + '...'} (a {type(value).__name__})"


def _fail(field: str, expected: str, value: object) -> InvalidInputError:
    root = field.split("[", 1)[0].split(".", 1)[0]
    return InvalidInputError(f"{field} must be {expected}, got {_describe(value)}", param=root)


def _number(
    field: str,
    value: object,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """A finite number in the interval; ``low``/``high`` may be +-inf (unbounded)."""
    left = "(" if low_open else "["
    right = ")" if high_open or math.isinf(high) else "]"
    low_text = "-inf" if math.isinf(low) else f"{low:g}"
    high_text = "inf" if math.isinf(high) else f"{high:g}"
    expected = f"a number in {left}{low_text}, {high_text}{right}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(field, expected, value)
    number = float(value)
    if not math.isfinite(number):
        raise _fail(field, expected, value)
    too_low = number <= low if low_open else number < low
    too_high = number >= high if high_open else number > high
    if too_low or too_high:
        raise _fail(field, expected, value)
    return number


def _integer(field: str, value: object, low: int, high: int | None, expected: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        # 3.0 from a JSON encoder that writes every number as a float is still 3
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise _fail(field, expected, value)
    if value < low or (high is not None and value > high):
        raise _fail(field, expected, value)
    return value


def _boolean(field: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise _fail(field, "true or false", value)
    return value


def _stop(value: object, limits: SamplingLimits) -> tuple[str, ...]:
    expected = f"a string or a list of at most {limits.max_stop_strings} non-empty strings"
    items: list[object]
    if isinstance(value, str):
        items = [value]
    elif isinstance(value, list | tuple):
        items = list(value)
    else:
        raise _fail("stop", expected, value)
    if len(items) > limits.max_stop_strings:
        raise InvalidInputError(f"stop must be {expected}, got a list of {len(items)} strings")
    for index, item in enumerate(items):
        if not isinstance(item, str) or not item:
            raise _fail(f"stop[{index}]", "a non-empty string", item)
    return tuple(str(item) for item in items)


def _token_ids(field: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise _fail(field, "a list of token ids (integers >= 0)", value)
    return tuple(
        _integer(f"{field}[{index}]", item, 0, None, "a token id (an integer >= 0)")
        for index, item in enumerate(value)
    )


def _given(values: Mapping[str, object], name: str) -> bool:
    return values.get(name) is not None


def sampling_params_from_mapping(
    values: Mapping[str, object],
    defaults: SamplingParams,
    limits: SamplingLimits,
) -> SamplingParams:
    """Validate the sampling fields of a request and lay them over ``defaults``.

    Args:
        values: The request's JSON object (OpenAI's field names; ``max_completion_tokens``
            is an alias of ``max_tokens``). Keys this function does not know are ignored
            (the caller validates the rest of the request); a ``None`` value is "not given".
        defaults: The model's defaults, used for every field not given.
        limits: Bounds on ``stop`` and ``top_logprobs``.

    Returns:
        The request's parameters.

    Raises:
        InvalidInputError: A value of the wrong type or out of range; the message names the
            field, the value received and what was expected.
    """
    changes: dict[str, Any] = {}

    max_tokens: int | None = None
    for name in ("max_tokens", "max_completion_tokens"):
        if _given(values, name):
            given = _integer(name, values[name], 1, None, "an integer >= 1")
            if max_tokens is not None and given != max_tokens:
                raise InvalidInputError(
                    f"max_tokens ({max_tokens}) and max_completion_tokens ({given}) are "
                    "aliases and must not differ; give one of them"
                )
            max_tokens = given
    if max_tokens is not None:
        changes["max_tokens"] = max_tokens

    floats: tuple[tuple[str, float, float, bool, bool], ...] = (
        # name, low, high, low_open, high_open
        ("temperature", 0.0, 2.0, False, False),
        ("top_p", 0.0, 1.0, True, False),
        ("min_p", 0.0, 1.0, False, False),
        ("repetition_penalty", 0.0, math.inf, True, False),
        ("presence_penalty", -2.0, 2.0, False, False),
        ("frequency_penalty", -2.0, 2.0, False, False),
    )
    for name, low, high, low_open, high_open in floats:
        if _given(values, name):
            changes[name] = _number(
                name, values[name], low, high, low_open=low_open, high_open=high_open
            )

    if _given(values, "top_k"):
        changes["top_k"] = _integer(
            "top_k", values["top_k"], -1, None, "an integer >= -1 (0 or -1: off)"
        )
    if _given(values, "seed"):
        changes["seed"] = _integer(
            "seed", values["seed"], _SEED_MIN, _SEED_MAX, "an integer in [-2**63, 2**64 - 1]"
        )
    if _given(values, "min_tokens"):
        changes["min_tokens"] = _integer(
            "min_tokens", values["min_tokens"], 0, None, "an integer >= 0"
        )
    if _given(values, "top_logprobs"):
        changes["top_logprobs"] = _integer(
            "top_logprobs",
            values["top_logprobs"],
            0,
            limits.max_top_logprobs,
            f"an integer in [0, {limits.max_top_logprobs}]",
        )
    if _given(values, "stop"):
        changes["stop"] = _stop(values["stop"], limits)
    if _given(values, "stop_token_ids"):
        changes["stop_token_ids"] = _token_ids("stop_token_ids", values["stop_token_ids"])
    for name in ("ignore_eos", "logprobs", "include_stop_str_in_output", "skip_special_tokens"):
        if _given(values, name):
            changes[name] = _boolean(name, values[name])

    params = replace(defaults, **changes)
    if params.min_tokens > params.max_tokens:
        raise InvalidInputError(
            f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({params.max_tokens})"
        )
    return params


def n_from_mapping(values: Mapping[str, object], limits: SamplingLimits) -> int:
    """The request's number of choices ``n`` (1 when not given), validated against
    ``limits.max_n``.

    Raises:
        InvalidInputError: ``n`` is not an integer in ``[1, limits.max_n]``.
    """
    if not _given(values, "n"):
        return 1
    return _integer("n", values["n"], 1, limits.max_n, f"an integer in [1, {limits.max_n}]")
