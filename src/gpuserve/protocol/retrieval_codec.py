"""The wire of the retrieval APIs: TEI's ``/rerank``, ``/predict``, ``/embed``,
``/embed_sparse``, ``/tokenize``, ``/similarity`` bodies and Cohere/Jina's ``/v1/rerank``, parsed
into typed calls and their answers encoded.

Field names and answers follow text-embeddings-inference's OpenAPI document and Cohere's
rerank API; each parser refuses a bad body with a :class:`RetrievalInputError` naming the
field and what it takes (``empty`` for an empty input: TEI answers those 400, other
validation errors 413). How many rows one call may carry is checked by the API, against the
server's and the model's caps (:meth:`~gpuserve.protocol.limits.RequestLimits.check_inputs`).
A ``parameters`` object (what ``huggingface_hub``'s ``InferenceClient`` sends) supplies the
fields the body leaves out. Every TEI body may name its ``model`` (gpuserve's addition;
without it, the first model serving the kind).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from gpuserve.errors import InvalidInputError


class RetrievalInputError(InvalidInputError):
    """A bad retrieval body.

    Attributes:
        param: The field at fault, or None.
        empty: The input is empty (TEI's ``Empty`` error, 400).
    """

    def __init__(self, message: str, param: str | None = None, empty: bool = False) -> None:
        super().__init__(message)
        self.param = param
        self.empty = empty


def load(body: bytes | bytearray) -> dict[str, Any]:
    """The JSON object of a body, with ``parameters`` merged under its own fields.

    Raises:
        RetrievalInputError: not JSON, or not an object.
    """
    try:
        document = orjson.loads(body) if body else None
    except orjson.JSONDecodeError as err:
        raise RetrievalInputError(f"the body is not valid JSON: {err}") from None
    if not isinstance(document, dict):
        raise RetrievalInputError("the body must be a JSON object")
    parameters = document.get("parameters")
    if isinstance(parameters, dict):
        document = {**{k: v for k, v in parameters.items() if v is not None}, **document}
    return document


def _bool(document: dict[str, Any], name: str, default: bool | None) -> bool | None:
    value = document.get(name, default)
    if value is None:
        return default
    if type(value) is not bool:
        raise RetrievalInputError(f"'{name}' must be true or false, got {value!r}", name)
    return value


def _model(document: dict[str, Any], required: bool = False) -> str | None:
    model = document.get("model")
    if model is None and not required:
        return None
    if type(model) is not str or not model:
        raise RetrievalInputError(
            f"'model' must be a non-empty string naming the model, got {model!r}", "model"
        )
    return model


def _text(value: Any, name: str) -> str:
    if type(value) is not str:
        raise RetrievalInputError(f"'{name}' must be a string, got {type(value).__name__}", name)
    return value


def _texts(document: dict[str, Any], name: str) -> list[str]:
    """A string or a non-empty list of strings."""
    if name not in document:
        raise RetrievalInputError(f"'{name}' is required: a string or a list of strings", name)
    value = document[name]
    if type(value) is str:
        return [value]
    if not isinstance(value, list) or not all(type(v) is str for v in value):
        raise RetrievalInputError(f"'{name}' must be a string or a list of strings", name)
    if not value:
        raise RetrievalInputError(f"'{name}' is empty: send at least one text", name, empty=True)
    return value


@dataclass(frozen=True, slots=True)
class RerankCall:
    """A rerank call (TEI's or Cohere's).

    Attributes:
        model: The model named, or None (TEI: the first reranker).
        query: The query.
        documents: The passages, in input order.
        raw_scores: Return logits instead of sigmoid scores (TEI).
        return_text: Return each passage with its score.
        truncate: None: the model's setting; False: refuse passages over its limit.
        top_n: Keep the best ``top_n`` after scoring (Cohere), or None for all.
        objects: Cohere documents given as objects: the object each came as (echoed back).
    """

    model: str | None
    query: str
    documents: list[str]
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool | None = None
    top_n: int | None = None
    objects: list[Any] | None = None


def parse_tei_rerank(document: dict[str, Any]) -> RerankCall:
    """TEI's ``POST /rerank`` body: ``query``, ``texts``, ``raw_scores``, ``return_text``,
    ``truncate`` (``truncation_direction`` ``Right`` only).

    Raises:
        RetrievalInputError: a field is missing or of the wrong type; ``texts`` is empty.
    """
    if "query" not in document:
        raise RetrievalInputError("'query' is required: a string", "query")
    query = _text(document["query"], "query")
    texts = document.get("texts")
    if not isinstance(texts, list) or not all(type(t) is str for t in texts):
        raise RetrievalInputError("'texts' is required: a list of strings", "texts")
    if not texts:
        raise RetrievalInputError("'texts' is empty: send at least one text", "texts", True)
    _direction(document)
    return RerankCall(
        model=_model(document),
        query=query,
        documents=texts,
        raw_scores=bool(_bool(document, "raw_scores", False)),
        return_text=bool(_bool(document, "return_text", False)),
        truncate=_bool(document, "truncate", None),
    )


def _direction(document: dict[str, Any]) -> None:
    direction = document.get("truncation_direction", "Right")
    if direction not in ("Right", "right", None):
        raise RetrievalInputError(
            f"'truncation_direction' {direction!r} is not supported: only 'Right'",
            "truncation_direction",
        )


def parse_cohere_rerank(document: dict[str, Any]) -> RerankCall:
    """Cohere/Jina's ``POST /v1/rerank`` body: ``model``, ``query``, ``documents`` (strings,
    or objects with a ``text`` field), ``top_n``, ``return_documents``.

    Raises:
        RetrievalInputError: a field is missing or of the wrong type; ``documents`` is
            empty; ``top_n`` below 1.
    """
    model = _model(document, required=True)
    if "query" not in document:
        raise RetrievalInputError("'query' is required: a string", "query")
    query = _text(document["query"], "query")
    docs = document.get("documents")
    if not isinstance(docs, list):
        raise RetrievalInputError(
            "'documents' is required: a list of strings or of objects with a 'text'", "documents"
        )
    if not docs:
        raise RetrievalInputError("'documents' is empty: send at least one", "documents", True)
    texts: list[str] = []
    objects: list[Any] | None = None
    for index, doc in enumerate(docs):
        if type(doc) is str:
            texts.append(doc)
        elif isinstance(doc, dict) and type(doc.get("text")) is str:
            texts.append(doc["text"])
            objects = objects if objects is not None else list(docs)
        else:
            raise RetrievalInputError(
                f"'documents[{index}]' must be a string or an object with a string 'text'",
                "documents",
            )
    top_n = document.get("top_n")
    if top_n is not None and (type(top_n) is not int or top_n < 1):
        raise RetrievalInputError(f"'top_n' must be an integer >= 1, got {top_n!r}", "top_n")
    return RerankCall(
        model=model,
        query=query,
        documents=texts,
        return_text=bool(_bool(document, "return_documents", False)),
        top_n=top_n,
        objects=objects,
    )


@dataclass(frozen=True, slots=True)
class PredictCall:
    """TEI's ``POST /predict``.

    Attributes:
        model: The model named, or None.
        texts / pairs: First and second text of each row (``pairs`` None for single texts).
        batched: The body held a batch (answered as a list of lists).
        raw_scores: Return logits instead of softmax (sigmoid) scores.
        truncate: As :class:`RerankCall`.
    """

    model: str | None
    texts: list[str]
    pairs: list[str] | None
    batched: bool
    raw_scores: bool
    truncate: bool | None


def _sequence(value: Any) -> tuple[str, str | None] | None:
    """TEI's ``Sequence``: a string, or a pair ``[a, b]``; None when it is neither."""
    if type(value) is str:
        return value, None
    if isinstance(value, list) and len(value) == 2 and all(type(v) is str for v in value):
        return value[0], value[1]
    return None


def parse_predict(document: dict[str, Any]) -> PredictCall:
    """``inputs``: a text, a pair ``[a, b]``, or a batch of either (all singles or all
    pairs); ``raw_scores``, ``truncate``.

    Raises:
        RetrievalInputError: ``inputs`` missing, empty or of another shape; a batch mixing
            single texts and pairs.
    """
    if "inputs" not in document:
        raise RetrievalInputError(
            "'inputs' is required: a text, a pair [text, text], or a list of either", "inputs"
        )
    value = document["inputs"]
    single = _sequence(value)
    if single is not None:
        rows, batched = [single], False
    elif isinstance(value, list):
        if not value:
            raise RetrievalInputError("'inputs' is empty: send at least one text", "inputs", True)
        parsed = [_sequence(v) for v in value]
        if any(p is None for p in parsed):
            raise RetrievalInputError(
                "'inputs' must be a text, a pair [text, text], or a list of either", "inputs"
            )
        rows, batched = [p for p in parsed if p is not None], True
    else:
        raise RetrievalInputError(
            "'inputs' must be a text, a pair [text, text], or a list of either", "inputs"
        )
    kinds = {second is None for _, second in rows}
    if len(kinds) > 1:
        raise RetrievalInputError(
            "'inputs' mixes single texts and pairs: send one kind per call", "inputs"
        )
    pairs = None if kinds == {True} else [second or "" for _, second in rows]
    _direction(document)
    return PredictCall(
        model=_model(document),
        texts=[first for first, _ in rows],
        pairs=pairs,
        batched=batched,
        raw_scores=bool(_bool(document, "raw_scores", False)),
        truncate=_bool(document, "truncate", None),
    )


@dataclass(frozen=True, slots=True)
class TextsCall:
    """TEI's ``/embed``, ``/embed_sparse`` and ``/tokenize``: texts and their options.

    Attributes:
        model: The model named, or None.
        texts: The texts.
        normalize: ``/embed``: L2-normalise (default true).
        truncate: As :class:`RerankCall`.
        add_special_tokens: ``/tokenize``: add the model's special tokens (default true).
        dimensions: ``/embed``: cut each embedding to this width (Matryoshka), or None.
    """

    model: str | None
    texts: list[str]
    normalize: bool = True
    truncate: bool | None = None
    add_special_tokens: bool = True
    dimensions: int | None = None


def parse_texts(document: dict[str, Any]) -> TextsCall:
    """``inputs`` (a string or a list of strings), ``normalize``, ``truncate``,
    ``add_special_tokens``, ``dimensions``.

    Raises:
        RetrievalInputError: a field is missing, empty or of the wrong type.
    """
    dimensions = document.get("dimensions")
    if dimensions is not None and (type(dimensions) is not int or dimensions < 1):
        raise RetrievalInputError(
            f"'dimensions' must be an integer >= 1, got {dimensions!r}", "dimensions"
        )
    _direction(document)
    return TextsCall(
        model=_model(document),
        texts=_texts(document, "inputs"),
        normalize=bool(_bool(document, "normalize", True)),
        truncate=_bool(document, "truncate", None),
        add_special_tokens=bool(_bool(document, "add_special_tokens", True)),
        dimensions=dimensions,
    )


@dataclass(frozen=True, slots=True)
class SimilarityCall:
    """``POST /similarity``: ``inputs.source_sentence`` against ``inputs.sentences``."""

    model: str | None
    source: str
    sentences: list[str]


def is_similarity(document: dict[str, Any]) -> bool:
    """Whether a body is a sentence-similarity one (``inputs`` an object)."""
    return isinstance(document.get("inputs"), dict)


def parse_similarity(document: dict[str, Any]) -> SimilarityCall:
    """``{"inputs": {"source_sentence": str, "sentences": [str, ...]}}``.

    Raises:
        RetrievalInputError: a field is missing, empty or of the wrong type.
    """
    inputs = document.get("inputs")
    if not isinstance(inputs, dict):
        raise RetrievalInputError(
            "'inputs' must be an object with 'source_sentence' and 'sentences'", "inputs"
        )
    source = _text(inputs.get("source_sentence"), "inputs.source_sentence")
    sentences = _texts(inputs, "sentences")
    return SimilarityCall(_model(document), source, sentences)


# -- answers -------------------------------------------------------------------------------


def sigmoid(values: np.ndarray) -> np.ndarray:
    """float32 sigmoid, stable for large magnitudes."""
    x = values.astype(np.float64)
    out: np.ndarray = np.exp(-np.logaddexp(0.0, -x)).astype(np.float32)
    return out


def softmax(values: np.ndarray) -> np.ndarray:
    """float32 softmax over the last axis."""
    x = values.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    out: np.ndarray = (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)
    return out


def ranked(scores: np.ndarray, top_n: int | None) -> list[int]:
    """Row indices by descending score (ties: lower index first), cut to ``top_n``."""
    order: list[int] = np.argsort(-scores.astype(np.float64), kind="stable").tolist()
    return order[:top_n] if top_n is not None else order


def encode_tei_rerank(call: RerankCall, scores: np.ndarray) -> bytes:
    """``[{"index", "score", "text"?}, ...]`` best first."""
    items = []
    for index in ranked(scores, call.top_n):
        item: dict[str, Any] = {"index": index, "score": float(scores[index])}
        if call.return_text:
            item["text"] = call.documents[index]
        items.append(item)
    return orjson.dumps(items)


def encode_cohere_rerank(
    call: RerankCall, scores: np.ndarray, request_id: str, tokens: int
) -> bytes:
    """Cohere's answer (``id``, ``results[{index, relevance_score, document?}]``, ``meta``)
    with Jina's ``model`` and ``usage`` beside it."""
    results = []
    for index in ranked(scores, call.top_n):
        item: dict[str, Any] = {"index": index, "relevance_score": float(scores[index])}
        if call.return_text:
            item["document"] = (
                call.objects[index] if call.objects is not None else {"text": call.documents[index]}
            )
        results.append(item)
    return orjson.dumps(
        {
            "id": request_id,
            "model": call.model,
            "results": results,
            "meta": {"api_version": {"version": "1"}, "billed_units": {"search_units": 1}},
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


def encode_predict(call: PredictCall, scores: np.ndarray, labels: Sequence[str]) -> bytes:
    """Per row ``[{"score", "label"}, ...]`` best first; a single input's list alone."""
    rows = []
    for row in scores:
        order = np.argsort(-row.astype(np.float64), kind="stable").tolist()
        rows.append([{"score": float(row[i]), "label": labels[i]} for i in order])
    return orjson.dumps(rows if call.batched else rows[0])


def encode_sparse(indices: np.ndarray, values: np.ndarray) -> bytes:
    """Per text ``[{"index", "value"}, ...]``, non-zero weights only, by token id."""
    out = []
    for ids, weights in zip(indices, values, strict=True):
        keep = weights != 0
        pairs = sorted(zip(ids[keep].tolist(), weights[keep].tolist(), strict=True))
        out.append([{"index": int(i), "value": float(v)} for i, v in pairs])
    return orjson.dumps(out)
