"""The retrieval APIs on the HTTP port: adapters over the retrieval and embeddings services.

Endpoints (TEI's, as text-embeddings-inference serves them, and Cohere/Jina's rerank)::

    POST /rerank          {query, texts, raw_scores, return_text, truncate}
                          -> [{index, score, text?}] best first
    POST /predict         {inputs: text | [a, b] | [text, ...] | [[a, b], ...], raw_scores}
                          -> [{label, score}] best first (a batch: one list per input)
    POST /embed           {inputs, normalize, dimensions} -> [[float, ...], ...]
    POST /embed_sparse    {inputs} -> [[{index, value}, ...], ...] (non-zero terms only)
    POST /tokenize        {inputs, add_special_tokens} -> [[{id, text, special, start, stop}]]
    POST /similarity      {inputs: {source_sentence, sentences}} -> [cosine, ...]
    POST /                the first of: similarity (inputs an object), embed, predict,
                          rerank, embed_sparse that the repository serves (TEI's root route)
    POST /models/{model}  the same for one model, a classifier answering per input
                          (the Hugging Face Inference API's shape, ``InferenceClient``'s)
    POST /v1/rerank       Cohere/Jina: {model, query, documents, top_n, return_documents}
    POST /v2/rerank       -> {id, model, results[{index, relevance_score, document?}],
                              meta, usage}

A TEI body may name its ``model``; without it the first model (by name) serving the kind
answers. Scores are the sigmoid of a cross-encoder's logit (``raw_scores``: the logit), and
per label the softmax of a classifier's logits (sigmoid for a multi-label model). Every call
is served by :class:`~gpuserve.service.apis.retrieval.RetrievalService` (or the embeddings
service), so every row is admitted, batched, refused and counted as V2 requests are, a
window of chunks at a time (other clients' requests are served between them). Errors are in
each API's shape (:mod:`gpuserve.server.http.retrieval_errors`).

One call carries at most the server's ``max_inputs_per_call`` texts, documents or inputs
(or the model section's lower cap): past it, 413 naming the cap and the count, before
anything is queued (:meth:`~gpuserve.protocol.limits.RequestLimits.check_inputs`, the check
of ``/v1/embeddings`` too). A client's W3C ``traceparent`` header joins its trace: every
chunk's span is a child of the client's span (with tracing on). TEI's ``GET /health`` and
``GET /info`` are :mod:`gpuserve.server.http.tei_info`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import numpy as np
import orjson

from gpuserve.errors import (
    GpuserveError,
    InvalidInputError,
    ModelNotFoundError,
    UnavailableError,
)
from gpuserve.protocol import retrieval_codec as codec
from gpuserve.protocol.limits import RequestLimits
from gpuserve.protocol.openai_codec import EmbeddingsBody
from gpuserve.server.http.request import HttpRequest, respond_json, traceparent
from gpuserve.server.http.retrieval_errors import RetrievalError, cohere_error, tei_error
from gpuserve.server.security import Redactor
from gpuserve.server.timing import (
    COMPUTE_TIME_US_HEADER,
    QUEUE_TIME_US_HEADER,
    TOTAL_TIME_US_HEADER,
    microseconds,
)
from gpuserve.service.apis.embedding_models import count_pool
from gpuserve.service.apis.embeddings import EmbeddingsService
from gpuserve.service.apis.retrieval import KINDS, Kind, RetrievalService, RowsResult
from gpuserve.service.inference import InferenceService, WireRequest
from gpuserve.service.outcome import AccessRecord

Spawn = Callable[[Coroutine[Any, Any, None]], None]
Header = tuple[bytes, bytes]
Probe = Callable[[], bool]
#: A TEI endpoint's answer: its JSON body, and the rows' result (None: no rows counted).
Answered = tuple[bytes, "RowsResult | None"]
#: A TEI endpoint: (document, disconnect probe, traceparent, asked as /models/{model}).
Endpoint = Callable[[dict[str, Any], Probe, "str | None", bool], Awaitable[Answered]]

#: TEI's endpoints, by path.
TEI_PATHS = ("/rerank", "/predict", "/embed", "/embed_sparse", "/tokenize", "/similarity")
COHERE_PATHS = ("/v1/rerank", "/v2/rerank")
MODELS_PREFIX = "/models/"


class RetrievalApi:
    """The endpoints of the module docstring.

    Args:
        service: The inference service.
        embeddings: The embeddings service (``/embed``, ``/similarity``).
        limits: Server-wide tensor limits.
        redactor: Takes file paths out of error messages.
        access_log: Write one access line per answer.
        spawn: Runs a coroutine as a task the HTTP front end keeps until it is done.
    """

    def __init__(
        self,
        service: InferenceService,
        embeddings: EmbeddingsService,
        limits: RequestLimits,
        redactor: Redactor,
        access_log: bool,
        spawn: Spawn,
    ) -> None:
        self.service = service
        self.retrieval = RetrievalService(service)
        self.embeddings = embeddings
        self.limits = limits
        self.redactor = redactor
        self.access_log = access_log
        self._spawn = spawn
        #: TEI's endpoints by path (the HTTP app's rows for :data:`TEI_PATHS` and the
        #: one ``POST /`` and ``/models/{model}`` pick).
        self._endpoints: dict[str, Endpoint] = {
            "/rerank": self._tei_rerank,
            "/predict": self._tei_predict,
            "/embed": self._tei_embed,
            "/embed_sparse": self._tei_embed_sparse,
            "/tokenize": self._tei_tokenize,
            "/similarity": self._tei_similarity,
        }

    # -- the rows' handlers ----------------------------------------------------------------

    def tei(self, request: HttpRequest, _method: str, _params: Any) -> None:
        """A TEI endpoint (the path picks it); answered from a task."""
        self._spawn(self._tei(request, request.path.rstrip("/") or "/", None))

    def model_route(self, request: HttpRequest, _method: str, _params: Any) -> None:
        """``POST /models/{model}``: the model's kind decides (see the module docstring)."""
        name = request.path.rstrip("/")[len(MODELS_PREFIX) :]
        self._spawn(self._tei(request, "/", name))

    def cohere(self, request: HttpRequest, _method: str, _params: Any) -> None:
        """``POST /v1/rerank`` or ``/v2/rerank`` (Cohere/Jina); answered from a task."""
        self._spawn(self._cohere(request))

    # -- TEI -------------------------------------------------------------------------------

    async def _tei(self, request: HttpRequest, path: str, model: str | None) -> None:
        record = AccessRecord("", request.method, request.path, 0, model or "-")
        try:
            document = codec.load(request.body)
            if model is not None:
                document = {**document, "model": model}
            if path == "/":
                path = self._root(document, model)
            payload, result = await self._endpoint(path, document, request, model is not None)
        except asyncio.CancelledError:
            self._fail(request, UnavailableError("server is shutting down; retry"), record, True)
            raise
        except Exception as err:
            self._fail(request, err, record, True)
            return
        self._answer(request, payload, record, result)

    def _root(self, document: dict[str, Any], model: str | None) -> str:
        """The endpoint ``POST /`` (or ``/models/{model}``) stands for."""
        if codec.is_similarity(document):
            return "/similarity"
        embedders = [view.id for view in self.embeddings.models()]
        if (model is None and embedders) or model in embedders:
            return "/embed"
        routes: tuple[tuple[str, Kind], ...] = (
            ("/predict", "classification"),
            ("/rerank", "rerank"),
            ("/embed_sparse", "sparse"),
        )
        for path, kind in routes:
            names = self.retrieval.models(kind)
            if (model is None and names) or model in names:
                return path
        what = f"model '{model}'" if model is not None else "no model"
        raise ModelNotFoundError(f"{what} serves embeddings, classification or rerank")

    async def _endpoint(
        self, path: str, document: dict[str, Any], request: HttpRequest, nested: bool
    ) -> tuple[bytes, RowsResult | None]:
        """The answer of TEI endpoint ``path`` (its row of :attr:`_endpoints`) to
        ``document``; ``nested``: asked as ``/models/{model}``."""
        endpoint = self._endpoints.get(path)
        if endpoint is None:
            raise ModelNotFoundError(f"no endpoint POST {path}")
        context = traceparent(request) if self.service.tracing else None
        return await endpoint(document, request.is_disconnected, context, nested)

    # -- TEI's endpoints: (document, disconnect probe, traceparent, nested) -> (body, rows) --

    async def _tei_rerank(
        self, document: dict[str, Any], probe: Probe, context: str | None, _nested: bool
    ) -> Answered:
        call = codec.parse_tei_rerank(document)
        scores, result = await self.rerank_scores(call, probe, traceparent=context)
        return codec.encode_tei_rerank(call, scores), result

    async def _tei_predict(
        self, document: dict[str, Any], probe: Probe, context: str | None, nested: bool
    ) -> Answered:
        predict = codec.parse_predict(document)
        model = self.retrieval.resolve("classification", predict.model)
        self._bound(model, "classification", len(predict.texts), "inputs")
        result = await self.retrieval.run(
            "classification",
            model,
            predict.texts,
            predict.pairs,
            probe,
            traceparent=context,
        )
        section = result.config.classification
        assert section is not None  # the wire refused a version without it
        logits = result.outputs[section.output].astype(np.float32)
        if predict.raw_scores:
            scores = logits
        else:
            # one label, or several independent ones: a sigmoid each (as transformers'
            # pipeline), else a softmax over the labels
            single = section.multi_label or logits.shape[1] == 1
            scores = codec.sigmoid(logits) if single else codec.softmax(logits)
        labels = section.labels or [f"LABEL_{i}" for i in range(logits.shape[1])]
        if nested and not predict.batched:  # the Inference API's shape
            predict = codec.PredictCall(**{**_fields(predict), "batched": True})
        return codec.encode_predict(predict, scores, labels), result

    async def _tei_embed_sparse(
        self, document: dict[str, Any], probe: Probe, context: str | None, _nested: bool
    ) -> Answered:
        texts = codec.parse_texts(document)
        model = self.retrieval.resolve("sparse", texts.model)
        self._bound(model, "sparse", len(texts.texts), "inputs")
        result = await self.retrieval.run(
            "sparse", model, texts.texts, None, probe, traceparent=context
        )
        sparse = result.config.sparse
        assert sparse is not None
        indices = result.outputs[sparse.indices_output]
        values = result.outputs[sparse.values_output].astype(np.float32)
        return codec.encode_sparse(indices, values), result

    async def _tei_embed(
        self, document: dict[str, Any], probe: Probe, context: str | None, _nested: bool
    ) -> Answered:
        texts = codec.parse_texts(document)
        self.limits.check_inputs("inputs", len(texts.texts))
        vectors = await self._embed(texts.model, texts.texts, texts.dimensions, probe, context)
        if texts.normalize:
            vectors = _normalized(vectors)
        return orjson.dumps(vectors, option=orjson.OPT_SERIALIZE_NUMPY), None

    async def _tei_similarity(
        self, document: dict[str, Any], probe: Probe, context: str | None, _nested: bool
    ) -> Answered:
        similar = codec.parse_similarity(document)
        self.limits.check_inputs("inputs", len(similar.sentences) + 1)  # and the source
        rows = [similar.source, *similar.sentences]
        vectors = _normalized(await self._embed(similar.model, rows, None, probe, context))
        cosines = vectors[1:] @ vectors[0]
        return orjson.dumps([float(c) for c in cosines]), None

    async def _tei_tokenize(
        self, document: dict[str, Any], _probe: Probe, _context: str | None, _nested: bool
    ) -> Answered:
        texts = codec.parse_texts(document)
        self.limits.check_inputs("inputs", len(texts.texts))
        return await self._tokenize(texts), None

    async def rerank_scores(
        self,
        call: codec.RerankCall,
        probe: Callable[[], bool],
        wrap: Callable[[WireRequest], WireRequest] | None = None,
        traceparent: str | None = None,
    ) -> tuple[np.ndarray, RowsResult]:
        """Raw or sigmoid scores of ``call``'s documents, in input order (``wrap``: applied
        to each chunk's wire request; the Batch API marks its requests bulk with it;
        ``traceparent``: the client's trace context)."""
        model = self.retrieval.resolve("rerank", call.model)
        self._bound(model, "rerank", len(call.documents), "documents")
        queries = [call.query] * len(call.documents)
        result = await self.retrieval.run(
            "rerank", model, queries, call.documents, probe, wrap=wrap, traceparent=traceparent
        )
        section = result.config.rerank
        assert section is not None
        logits = result.outputs[section.output].astype(np.float32)
        column = logits.reshape(logits.shape[0], -1)[:, section.score_index]
        return (column if call.raw_scores else codec.sigmoid(column)), result

    def _bound(self, model: str, kind: Kind, count: int, field: str) -> None:
        """Refuse more rows than one call may carry: the server's ``max_inputs_per_call``,
        or the model's ``kind`` section's lower cap (when the model is loaded; the first
        call of a model loaded on demand is held to the server's)."""
        self.limits.check_inputs(field, count, self.model_cap(model, kind))

    def model_cap(self, model: str, kind: Kind) -> tuple[str, str, int | None] | None:
        """``(model, setting, cap)`` of the model's ``kind`` section (cap None: the
        server's), or None when the model has no version serving now."""
        try:
            config = self.retrieval.config(model)
        except GpuserveError:
            return None
        if kind == "rerank" and config.rerank is not None:
            return model, "rerank.max_documents", config.rerank.max_documents
        if kind == "classification" and config.classification is not None:
            return model, "classification.max_inputs", config.classification.max_inputs
        if kind == "sparse" and config.sparse is not None:
            return model, "sparse.max_inputs", config.sparse.max_inputs
        return None

    async def _embed(
        self,
        model: str | None,
        texts: list[str],
        dimensions: int | None,
        probe: Callable[[], bool],
        context: str | None,
    ) -> np.ndarray:
        if model is None:
            serving = self.embeddings.models()
            if not serving:
                raise ModelNotFoundError("no model serves embeddings")
            model = serving[0].id
        body = EmbeddingsBody(model, texts, None, dimensions=dimensions, limits=self.limits)
        result = await self.embeddings.embed(body, probe, context)
        return result.embeddings

    async def _tokenize(self, call: codec.TextsCall) -> bytes:
        model = call.model
        if model is None:
            serving = [v.id for v in self.embeddings.models()] or [
                name for kind in KINDS for name in self.retrieval.models(kind)
            ]
            if not serving:
                raise ModelNotFoundError("no model serves text")
            model = serving[0]
        runner = self.service.manager.version(model, None).runner
        tokenize = runner.capabilities.tokenize if runner is not None else None
        if tokenize is None:
            raise InvalidInputError(f"model '{model}' has no tokenizer to show")
        loop = asyncio.get_running_loop()
        tokens = await loop.run_in_executor(
            count_pool(), tokenize, call.texts, call.add_special_tokens
        )
        rows = [
            [
                {"id": t.id, "text": t.text, "special": t.special, "start": t.start, "stop": t.stop}
                for t in row
            ]
            for row in tokens
        ]
        return orjson.dumps(rows)

    # -- Cohere / Jina ---------------------------------------------------------------------

    async def _cohere(self, request: HttpRequest) -> None:
        record = AccessRecord("", request.method, request.path, 0)
        try:
            call = codec.parse_cohere_rerank(codec.load(request.body))
            record.model = call.model or "-"
            context = traceparent(request) if self.service.tracing else None
            scores, result = await self.rerank_scores(
                call, request.is_disconnected, traceparent=context
            )
            payload = codec.encode_cohere_rerank(call, scores, str(uuid.uuid4()), result.tokens)
        except asyncio.CancelledError:
            self._fail(request, UnavailableError("server is shutting down; retry"), record, False)
            raise
        except Exception as err:
            self._fail(request, err, record, False)
            return
        self._answer(request, payload, record, result)

    # -- answers ---------------------------------------------------------------------------

    def _answer(
        self, request: HttpRequest, payload: bytes, record: AccessRecord, result: RowsResult | None
    ) -> None:
        headers: list[Header] = [
            (TOTAL_TIME_US_HEADER, microseconds(time.monotonic() - request.started_s).encode())
        ]
        if result is not None:
            record.model, record.version = result.model, result.version
            headers += [
                (QUEUE_TIME_US_HEADER, microseconds(result.queue_s).encode()),
                (COMPUTE_TIME_US_HEADER, microseconds(result.compute_s).encode()),
            ]
        self._send(request, 200, payload, record, headers)

    def _fail(
        self, request: HttpRequest, err: BaseException, record: AccessRecord, tei: bool
    ) -> None:
        answer: RetrievalError = (tei_error if tei else cohere_error)(err, self.redactor)
        self._send(request, answer.status, answer.body, record, answer.headers)

    def _send(
        self,
        request: HttpRequest,
        status: int,
        payload: bytes,
        record: AccessRecord,
        headers: list[Header],
    ) -> None:
        respond_json(request, status, payload, headers, record if self.access_log else None)


def _fields(call: codec.PredictCall) -> dict[str, Any]:
    return {name: getattr(call, name) for name in codec.PredictCall.__dataclass_fields__}


def _normalized(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return (vectors / np.maximum(norms, np.float32(1e-12))).astype(np.float32)
