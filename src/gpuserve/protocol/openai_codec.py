"""The OpenAI embeddings wire: request bodies to typed calls, answers to JSON.

Request (``POST /v1/embeddings``)::

    {"model": "text_embedding",               # required, a model serving embeddings
     "input": "text" | ["a", "b"] | [1, 2] | [[1, 2], [3]],
     "encoding_format": "float" | "base64",   # default float
     "dimensions": 256,                        # only where the model allows it
     "user": "someone"}                        # optional; also the canary routing id

Policies:

* ``input`` is one string, a list of strings, one token-id array (a list of integers) or a
  list of them; an empty list, an empty string or array, a list mixing kinds and an element of
  another type are refused (400, ``param: input``). At most the server's
  ``max_inputs_per_call`` inputs (by default :data:`MAX_INPUTS`, OpenAI's limit); more is 413
  (:meth:`~gpuserve.protocol.limits.RequestLimits.check_inputs`, the check of every
  embeddings and retrieval route). Texts are checked against ``max_bytes_element_bytes``
  here, with the index the client sent.
* Unknown keys are ignored (as for V2 bodies); known keys with the wrong type are refused.
* ``user`` picks the version when the model has a canary (the same user always lands on the
  same side); without it a call goes at random. One call is never split across versions.
* ``base64`` embeddings are the little-endian float32 bytes of each vector, base64-encoded
  (what the ``openai`` client decodes with ``numpy.frombuffer(..., dtype="float32")``).

Answer::

    {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [...]}],
     "model": "text_embedding", "usage": {"prompt_tokens": 5, "total_tokens": 5}}

``GET /v1/models`` answers ``{"object": "list", "data": [model, ...]}`` with each model as
``{"id", "object": "model", "created", "owned_by"}``.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import orjson

from gpuserve.engine.request import InferenceRequest
from gpuserve.errors import TooManyInputsError as TooManyInputsError  # re-exported
from gpuserve.protocol.limits import DEFAULT_MAX_INPUTS_PER_CALL, RequestLimits
from gpuserve.protocol.shapes import described, json_type, show, validate_request_shapes
from gpuserve.protocol.tensors import build_input
from gpuserve.service.apis.embeddings import (
    EmbeddingInputError,
    EmbeddingModelView,
    EmbeddingResult,
    embedding_spec,
)

if TYPE_CHECKING:
    from gpuserve.config import ModelConfig

#: Most inputs in one call unless the server sets ``max_inputs_per_call`` (OpenAI's limit).
MAX_INPUTS = DEFAULT_MAX_INPUTS_PER_CALL

#: Limits of a body parsed without the server's (tests, tools).
_DEFAULT_LIMITS = RequestLimits(2**62, 2**62)

EncodingFormat = Literal["float", "base64"]


@dataclass(slots=True)
class EmbeddingsBody:
    """One decoded ``/v1/embeddings`` body (implements the service's ``EmbeddingCall``).

    Attributes:
        model: The model name.
        texts: One string per input, or None when the inputs are token ids.
        token_ids: One list of token ids per input, or None when the inputs are texts.
        encoding_format: ``float`` or ``base64``.
        dimensions: Requested width, or None.
        user: The caller's end-user id, or None.
        limits: Server-wide tensor limits, applied when a chunk is decoded.
    """

    model: str
    texts: list[str] | None
    token_ids: list[list[int]] | None
    encoding_format: EncodingFormat = "float"
    dimensions: int | None = None
    user: str | None = None
    limits: RequestLimits | None = None

    @property
    def rows(self) -> int:
        """The number of inputs."""
        return len(self.texts if self.texts is not None else self.token_ids or ())

    def wire(self, rows: Sequence[int]) -> EmbeddingsWire:
        """The chunk of inputs ``rows``, ready for admission."""
        return EmbeddingsWire(self, rows)


class EmbeddingsWire:
    """Some rows of one call as one inference request (the service's ``WireRequest``).

    Args:
        body: The call.
        rows: Indices of its inputs, in the order they go into the tensor; token-id rows
            must all have the same length.
    """

    __slots__ = ("body", "rows")

    def __init__(self, body: EmbeddingsBody, rows: Sequence[int]) -> None:
        self.body = body
        self.rows = rows

    def request_id(self) -> str | None:
        """The call's ``user``: the canary split is by it."""
        return self.body.user

    def decode(
        self, config: ModelConfig, model_name: str, model_version: str | None
    ) -> InferenceRequest:
        """Build the request of these rows for the routed version's ``config``.

        Returns:
            A request with one input: the text input, BYTES ``[rows, 1]`` (or ``[rows]``),
            or the token-id input, ``[rows, length]`` of its declared integer type; the
            embedding output requested.

        Raises:
            EmbeddingInputError: the model serves no embeddings, takes no token ids (or no
                text), or does not allow the requested ``dimensions``.
            InvalidInputError: the tensor does not fit the model (message names the input).
            ConfigError: the model's embedding declaration does not fit its tensors.
        """
        spec = embedding_spec(config)
        if spec is None:
            raise EmbeddingInputError(f"model '{model_name}' does not serve embeddings", "model")
        body = self.body
        spec.check_dimensions(model_name, body.dimensions)
        batched = config.max_batch_size > 0
        count = len(self.rows)
        if body.texts is not None:
            name = spec.text_input
            if name is None:
                raise EmbeddingInputError(
                    f"model '{model_name}' takes token ids, not text: send 'input' as arrays "
                    "of integers",
                    "input",
                )
            texts = body.texts
            data: list[Any] = [texts[i] for i in self.rows]
            tensor = config.input(name)
            assert tensor is not None  # embedding_spec checked it
            shape = [count, *tensor.shape] if batched else list(tensor.shape)
            datatype = "BYTES"
        else:
            name = spec.token_ids_input
            if name is None:
                # LangChain's OpenAIEmbeddings sends tiktoken's ids by default: say what to set.
                raise EmbeddingInputError(
                    f"model '{model_name}' takes text, not token ids: send 'input' as a string "
                    "or a list of strings (LangChain's OpenAIEmbeddings: set "
                    "check_embedding_ctx_length=False)",
                    "input",
                )
            ids = body.token_ids or []
            data = [ids[i] for i in self.rows]
            tensor = config.input(name)
            assert tensor is not None
            length = len(data[0])
            shape = [count, length] if batched else [length]
            datatype = tensor.datatype
        array = build_input(
            tensor, name, datatype, shape, json_data=data, config=config, limits=body.limits
        )
        validate_request_shapes({name: array.shape}, config)
        return InferenceRequest(
            model_name=model_name,
            model_version=model_version,
            inputs={name: array},
            requested_outputs=[spec.output],
        )


# -- request bodies ------------------------------------------------------------------------


def load_body(body: bytes | bytearray) -> dict[str, Any]:
    """Parse the JSON body.

    Raises:
        EmbeddingInputError: not JSON, or not a JSON object.
    """
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as err:
        raise EmbeddingInputError(f"the request body is not valid JSON: {err}") from None
    if type(document) is not dict:
        raise EmbeddingInputError(
            f"the request body must be a JSON object, got {json_type(document)}"
        )
    return document


def parse_embeddings(
    document: dict[str, Any], limits: RequestLimits | None = None
) -> EmbeddingsBody:
    """Validate a parsed ``/v1/embeddings`` body (see the module's policies).

    Args:
        document: The body, as :func:`load_body` returns it.
        limits: Server-wide limits (``max_bytes_element_bytes`` applies to each text).

    Raises:
        EmbeddingInputError: names the field (``param``) and the value received.
        TooManyInputsError: more than ``limits.max_inputs_per_call`` inputs (413).
    """
    model = document.get("model")
    if type(model) is not str or not model:
        raise EmbeddingInputError(
            f"'model' must be a non-empty string naming the model, got {show(model)}", "model"
        )
    if "input" not in document:
        raise EmbeddingInputError("'input' is required: a string or a list of strings", "input")
    texts, token_ids = _inputs(document["input"], limits)
    given = document.get("encoding_format")
    encoding: EncodingFormat = "float"
    if given == "base64":
        encoding = "base64"
    elif given is not None and given != "float":
        raise EmbeddingInputError(
            f"'encoding_format' must be 'float' or 'base64', got {show(given)}",
            "encoding_format",
        )
    dimensions = document.get("dimensions")
    if dimensions is not None and (type(dimensions) is not int or dimensions < 1):
        raise EmbeddingInputError(
            f"'dimensions' must be a positive integer, got {show(dimensions)}", "dimensions"
        )
    user = document.get("user")
    if user is not None and type(user) is not str:
        raise EmbeddingInputError(f"'user' must be a string, got {show(user)}", "user")
    return EmbeddingsBody(model, texts, token_ids, encoding, dimensions, user, limits)


def _inputs(
    value: Any, limits: RequestLimits | None
) -> tuple[list[str] | None, list[list[int]] | None]:
    """``input`` as texts or token-id rows (exactly one is not None)."""
    if type(value) is str:
        value = [value]
    elif type(value) is not list:
        raise EmbeddingInputError(
            f"'input' must be a string, a list of strings or token-id arrays, got "
            f"{described(value)}",
            "input",
        )
    if not value:
        raise EmbeddingInputError("'input' is empty: send at least one string", "input")
    (limits or _DEFAULT_LIMITS).check_inputs("input", len(value))
    kinds = set(map(type, value))
    if kinds == {str}:
        _check_texts(value, limits)
        return value, None
    if kinds == {int}:
        _check_ids(value, None)
        return None, [value]
    if kinds == {list}:
        for index, row in enumerate(value):
            if not row:
                raise EmbeddingInputError(f"input[{index}] is an empty token array", "input")
            if set(map(type, row)) != {int}:
                bad = next(v for v in row if type(v) is not int)
                raise EmbeddingInputError(
                    f"input[{index}] must hold only integer token ids, got {described(bad)}",
                    "input",
                )
            _check_ids(row, index)
        return None, value
    kind = _KINDS.get(type(value[0]))
    if kind is None:
        index, bad, what = 0, value[0], "a string, an integer token id or a token-id array"
    else:
        index, bad = next((i, v) for i, v in enumerate(value) if type(v) is not type(value[0]))
        what = f"{kind} like input[0]"
    raise EmbeddingInputError(f"input[{index}] must be {what}, got {described(bad)}", "input")


_KINDS = {str: "a string", int: "an integer token id", list: "a token-id array"}


def _check_texts(texts: list[str], limits: RequestLimits | None) -> None:
    for index, text in enumerate(texts):
        if not text:
            raise EmbeddingInputError(f"input[{index}] is an empty string", "input")
    if limits is None:
        return
    limit = limits.max_bytes_element_bytes
    for index, text in enumerate(texts):  # a character is at most 4 UTF-8 bytes
        if len(text) * 4 > limit and len(text.encode("utf-8", "surrogatepass")) > limit:
            raise EmbeddingInputError(
                f"input[{index}] is more than this server's limit of {limit} bytes for one "
                "text (max_bytes_element_bytes)",
                "input",
            )


def _check_ids(ids: list[int], row: int | None) -> None:
    if not ids:
        raise EmbeddingInputError("'input' is an empty token array", "input")
    if min(ids) < 0:
        where = "'input'" if row is None else f"input[{row}]"
        raise EmbeddingInputError(f"{where}: token ids must be >= 0, got {min(ids)}", "input")


# -- answers -------------------------------------------------------------------------------


def encode_embeddings(result: EmbeddingResult, encoding_format: EncodingFormat) -> bytes:
    """The answer of one call as JSON bytes (float32 values, or base64 of their bytes)."""
    values = result.embeddings
    if encoding_format == "base64":
        raw = values.astype("<f4", copy=False)
        data: list[dict[str, Any]] = [
            {
                "object": "embedding",
                "index": index,
                "embedding": base64.b64encode(row.tobytes()).decode("ascii"),
            }
            for index, row in enumerate(raw)
        ]
    else:
        data = [
            {"object": "embedding", "index": index, "embedding": row}
            for index, row in enumerate(values)
        ]
    tokens = result.prompt_tokens
    return orjson.dumps(
        {
            "object": "list",
            "data": data,
            "model": result.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        },
        option=orjson.OPT_SERIALIZE_NUMPY,
    )


def _model(view: EmbeddingModelView) -> dict[str, Any]:
    return {"id": view.id, "object": "model", "created": view.created, "owned_by": view.owned_by}


def encode_model(view: EmbeddingModelView) -> bytes:
    """``GET /v1/models/{model}``: one model object."""
    return orjson.dumps(_model(view))


def encode_model_list(views: Sequence[EmbeddingModelView]) -> bytes:
    """``GET /v1/models``: the list object."""
    return orjson.dumps({"object": "list", "data": [_model(view) for view in views]})
