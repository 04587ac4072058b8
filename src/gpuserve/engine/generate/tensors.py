"""A V2 request with the tensors of Triton's vLLM backend, read into a generation request.

Inputs (a decoupled model, no batch dimension, each ``[1]``):

* ``text_input`` (BYTES): the prompt, UTF-8;
* ``stream`` (BOOL, optional): one response per engine step, else one at the end;
* ``sampling_parameters`` (BYTES, optional): a JSON object of sampling values (vLLM's and
  OpenAI's names: ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop``, ``seed``,
  ...); numbers may be given as strings, as Triton's clients often send them;
* ``exclude_input_in_output`` (BOOL, optional): the output is the generated text only, else
  the prompt followed by it.

Request parameters (Triton's generate extension puts its ``parameters`` object there) are
sampling values too; ``stream`` among them sets streaming; the tensor wins over a parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from gpuserve.backends.causal_lm.backend import GenerationModel
from gpuserve.backends.causal_lm.params import (
    NUMERIC_FIELDS,
    SamplingLimits,
    SamplingParams,
    sampling_params_from_mapping,
)
from gpuserve.engine.generate.messages import GenerationRequest
from gpuserve.engine.request import InferenceRequest
from gpuserve.errors import InvalidInputError

#: Parameters of a V2 request that are not sampling values.
_RESERVED = frozenset(
    {
        "stream",
        "priority",
        "timeout",
        "sequence_id",
        "sequence_start",
        "sequence_end",
        "binary_data_output",
        "triton_enable_empty_final_response",
    }
)


@dataclass(slots=True)
class TensorRequest:
    """What the tensors asked for.

    Attributes:
        request: The sequence to generate.
        streaming: One response per step (``stream``), else one at the end.
        prefix: Text put before the generated text (the prompt, or empty).
    """

    request: GenerationRequest
    streaming: bool
    prefix: str


def tensor_request(
    request: InferenceRequest,
    model: GenerationModel,
    defaults: SamplingParams,
    limits: SamplingLimits,
    clock: Callable[[], float],
) -> TensorRequest:
    """Read ``request`` (module docstring) into a generation request.

    Raises:
        InvalidInputError: the prompt is not UTF-8 or empty, ``sampling_parameters`` is not
            a JSON object, or a sampling value is out of range (the message names it).
    """
    prompt = _text(request.inputs, "text_input")
    if prompt is None or not prompt:
        raise InvalidInputError("input 'text_input' must hold a non-empty UTF-8 prompt")
    values: dict[str, Any] = {
        key: value for key, value in request.parameters.items() if key not in _RESERVED
    }
    raw = _text(request.inputs, "sampling_parameters")
    if raw:
        try:
            given = orjson.loads(raw)
        except orjson.JSONDecodeError as err:
            raise InvalidInputError(
                f"input 'sampling_parameters' must be a JSON object: {err}"
            ) from None
        if not isinstance(given, dict):
            raise InvalidInputError(
                f"input 'sampling_parameters' must be a JSON object, got {type(given).__name__}"
            )
        values.update(given)
    for key in NUMERIC_FIELDS:  # "0.7" as Triton's clients send it
        value = values.get(key)
        if isinstance(value, str):
            values[key] = _number(key, value)
    params = sampling_params_from_mapping(values, defaults, limits)
    streaming = _flag(request, "stream", False)
    exclude = _flag(request, "exclude_input_in_output", False)
    prompt_ids = model.encode(prompt)
    deadline = None
    if request.timeout_us:
        deadline = clock() + request.timeout_us / 1e6
    generation = GenerationRequest(
        request.id or "", prompt_ids, params, deadline_s=deadline, arrival_s=clock()
    )
    return TensorRequest(generation, streaming, "" if exclude else prompt)


def _text(inputs: dict[str, np.ndarray], name: str) -> str | None:
    array = inputs.get(name)
    if array is None or array.size == 0:
        return None
    value = array.reshape(-1)[0]
    if isinstance(value, bytes | bytearray):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidInputError(f"input {name!r} is not valid UTF-8") from None
    return str(value)


def _flag(request: InferenceRequest, name: str, default: bool) -> bool:
    array = request.inputs.get(name)
    if array is not None and array.size:
        return bool(array.reshape(-1)[0])
    value = request.parameters.get(name)
    if isinstance(value, bool):
        return value
    return default


def _number(key: str, value: str) -> float | int:
    try:
        number = float(value)
    except ValueError:
        raise InvalidInputError(
            f"sampling parameter {key!r} must be a number, got {value!r}"
        ) from None
    return int(number) if number.is_integer() and "." not in value else number


__all__ = ["TensorRequest", "tensor_request"]
