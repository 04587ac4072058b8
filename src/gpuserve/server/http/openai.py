"""The OpenAI-compatible API on the HTTP port: an adapter over the embeddings service.

Endpoints::

    POST /v1/embeddings        embeddings of one or more inputs (OpenAI's body and answer)
    POST /v1/completions       text completion by a generative model (see
    POST /v1/chat/completions  gpuserve.server.http.openai_generate; streamed as events)
    POST /v1/rerank            Cohere/Jina rerank (handed to
                               gpuserve.server.http.retrieval_api; Cohere's errors)
    GET  /v1/models            the models serving embeddings, rerank, classification,
                               sparse embeddings or text generation now
    GET  /v1/models/{model}    one of them
    /v1/files, /v1/batches     OpenAI's Files and Batch API (handed to
                               gpuserve.server.batches.api when the server has it)

The wire is :mod:`gpuserve.protocol.openai_codec`; the work is
:class:`~gpuserve.service.apis.embeddings.EmbeddingsService`, whose every chunk is admitted by the
inference service (so it is batched, refused and counted exactly as V2 requests are). Errors
are OpenAI's ``{"error": {...}}`` (see :mod:`gpuserve.server.http.openai_errors`). With an
API token configured every ``/v1`` endpoint needs ``Authorization: Bearer <token>``, the same
token as V2.

The endpoints are the rows of one table, :meth:`OpenAIApi.routes` (the Files and Batch API's
a table of its own, mounted in it), which the HTTP app mounts at ``/v1``
(:class:`~gpuserve.server.http.routes.Router`). A trailing "/" is ignored. A path no row
takes is OpenAI's 404 ``Invalid URL``, whatever the method; one a row takes with another
method is 405 ``method_not_allowed``.

One embeddings call carries at most the server's ``max_inputs_per_call`` inputs (413
beyond, nothing computed; the check of every embeddings and retrieval route); its chunks are
queued a window at a time, so other clients' requests are served between them. A client's
W3C ``traceparent`` header joins its trace on every ``/v1`` route that runs a model (with
tracing on).

Every answer writes one access line (``gpuserve.access``) with the path ``/v1/...``, the model,
the version that served it, the rows (inputs) of the call and its input shape. A call's
chunks are counted in the Prometheus series of the version as requests of their rows, as V2
requests are; the API a request came by shows in the access line's path (no series label).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from gpuserve.errors import GpuserveError, UnauthenticatedError, UnavailableError
from gpuserve.protocol.limits import RequestLimits
from gpuserve.protocol.openai_codec import (
    EmbeddingsBody,
    encode_embeddings,
    encode_model,
    encode_model_list,
    load_body,
    parse_embeddings,
)
from gpuserve.protocol.openai_generate import Kind
from gpuserve.server.http.openai_errors import OpenAIHttpError, error_answer
from gpuserve.server.http.openai_generate import GenerationApi
from gpuserve.server.http.request import HttpRequest, respond_json, traceparent
from gpuserve.server.http.routes import (
    GET,
    POST,
    Answer,
    Exact,
    Params,
    Route,
    Router,
    Template,
    methods_text,
    mount,
)
from gpuserve.server.security import Redactor, Tokens
from gpuserve.server.timing import (
    COMPUTE_TIME_US_HEADER,
    QUEUE_TIME_US_HEADER,
    TOTAL_TIME_US_HEADER,
    microseconds,
)
from gpuserve.service.apis.embeddings import (
    EmbeddingModelView,
    EmbeddingResult,
    EmbeddingsService,
    created,
)
from gpuserve.service.apis.retrieval import KINDS, serves
from gpuserve.service.inference import InferenceService
from gpuserve.service.outcome import AccessRecord

if TYPE_CHECKING:
    from gpuserve.server.batches.api import BatchApi

logger = logging.getLogger(__name__)

PREFIX = "/v1"
FILES = "/v1/files"
BATCHES = "/v1/batches"
EMBEDDINGS = "/v1/embeddings"
RERANK = "/v1/rerank"
#: Generation endpoints -> the kind of body each takes.
GENERATION: dict[str, Kind] = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
MODELS = "/v1/models"

Spawn = Callable[[Coroutine[Any, Any, None]], None]


class OpenAIApi:
    """The ``/v1`` endpoints (see the module docstring).

    Args:
        service: The inference service.
        tokens: The server's bearer tokens (the API token guards every ``/v1`` endpoint).
        limits: Server-wide tensor limits.
        redactor: Takes file paths out of error messages.
        access_log: Write one access line per answer.
        spawn: Runs a coroutine as a task the HTTP front end keeps until it is done.
    """

    def __init__(
        self,
        service: InferenceService,
        tokens: Tokens,
        limits: RequestLimits,
        redactor: Redactor,
        access_log: bool,
        spawn: Spawn,
    ) -> None:
        self.service = service
        self.embeddings = EmbeddingsService(service)
        self.tokens = tokens
        self.limits = limits
        self.redactor = redactor
        self.access_log = access_log
        self._spawn = spawn
        self.generation = GenerationApi(service, redactor, access_log, self._fail)
        #: ``POST /v1/rerank``: the retrieval API's handler (see :meth:`serve_rerank`).
        self.rerank: Callable[[HttpRequest, str, object], None] | None = None
        #: ``/v1/files`` and ``/v1/batches``: the server's Batch API (see
        #: :meth:`serve_batches`).
        self.batches: BatchApi | None = None
        #: The ``/v1`` table (the HTTP app mounts it): OpenAI's errors and auth.
        self.router = Router(
            self.routes, self._miss, fail=self._error, guard=self._guard, strip=True
        )

    def routes(self) -> list[Route]:
        """The ``/v1`` endpoints, one row each (the paths without their trailing "/"s)."""
        rows = [
            Route(POST, Exact(RERANK), self._rerank, when=self.rerank is not None),
            Route(POST, Exact(EMBEDDINGS), self._embeddings),
            *(Route(POST, Exact(path), self._generation) for path in GENERATION),
            Route(GET, Exact(MODELS), self._model_list),
            Route(GET, Template(MODELS + "/{model:path}"), self._model),
        ]
        if self.batches is not None:  # its own errors, under this API's auth
            rows += [mount(path, self.batches.router) for path in (FILES, BATCHES)]
        return rows

    def serve_rerank(self, rerank: Callable[[HttpRequest, str, object], None]) -> None:
        """Answer ``POST /v1/rerank`` with ``rerank`` (the retrieval API's handler)."""
        self.rerank = rerank
        self.router.reload()

    def serve_batches(self, batches: BatchApi) -> None:
        """Answer ``/v1/files`` and ``/v1/batches`` with ``batches`` (the server's Batch API)."""
        self.batches = batches
        self.router.reload()

    # -- the table's auth rule, "no route" answer and error answer -------------------------

    def _guard(self, request: HttpRequest, path: str) -> None:
        """The API token, when one is configured, on every ``/v1`` path (a refused
        embeddings or generation call is counted as unrouted)."""
        if self.tokens.api is not None and not self.tokens.allows_api(request.headers):
            if path == EMBEDDINGS or path in GENERATION:
                self.service.record_unrouted("", None, UnauthenticatedError.reason)
            raise UnauthenticatedError("this endpoint needs 'Authorization: Bearer <API token>'")

    def _miss(
        self, request: HttpRequest, method: str, path: str, allowed: frozenset[str] | None
    ) -> Answer:
        if allowed is None:
            # any method: an endpoint gpuserve does not serve (audio, ...) is OpenAI's 404
            # ``Invalid URL``, so its client raises NotFoundError
            raise OpenAIHttpError(404, f"Invalid URL ({request.method} {request.path})")
        raise OpenAIHttpError(
            405, f"{method} {path}: use {methods_text(allowed)}", code="method_not_allowed"
        )

    def _error(self, request: HttpRequest, err: BaseException) -> None:
        self._fail(request, err, AccessRecord("", request.method, request.path, 0))

    # -- the rows' handlers: (request, method with HEAD as GET, the matcher's params) ------

    def _rerank(self, request: HttpRequest, method: str, _: Params) -> Answer:
        assert self.rerank is not None  # the row is in the table only then
        self.rerank(request, method, None)
        return None

    def _embeddings(self, request: HttpRequest, _method: str, _: Params) -> Answer:
        body = self._parse(request)
        self._spawn(self._embed(request, body))
        return None

    def _generation(self, request: HttpRequest, _method: str, _: Params) -> Answer:
        kind = GENERATION[request.path.rstrip("/")]
        self._spawn(self.generation.handle(request, kind))
        return None

    def _model_list(self, request: HttpRequest, _method: str, _: Params) -> Answer:
        self._ok(request, encode_model_list(self._models()))
        return None

    def _model(self, request: HttpRequest, _method: str, params: Params) -> Answer:
        (model,) = params
        try:
            view = next((v for v in self._models() if v.id == model), None)
            payload = encode_model(view or self.embeddings.model(model))
        except Exception as err:  # the access line names the model asked for
            self._fail(request, err, AccessRecord("", request.method, request.path, 0, model))
            return None
        self._ok(request, payload)
        return None

    def _ok(self, request: HttpRequest, payload: bytes) -> None:
        self._send(request, 200, payload, AccessRecord("", request.method, request.path, 200))

    def _models(self) -> list[EmbeddingModelView]:
        """Every model serving embeddings, a retrieval kind or generation, by name."""
        views = {view.id: view for view in self.embeddings.models()}
        for name, model in sorted(self.service.manager.models.items()):
            mv = model.route.default
            if name in views or mv is None:
                continue
            if mv.config.generates or any(serves(mv.config, k) for k in KINDS):
                views[name] = EmbeddingModelView(name, created(mv.path))
        return [views[name] for name in sorted(views)]

    def _parse(self, request: HttpRequest) -> EmbeddingsBody:
        """The body of ``POST /v1/embeddings``; a refusal is counted as unrouted."""
        document: dict[str, Any] = {}
        try:
            document = load_body(request.body)
            return parse_embeddings(document, self.limits)
        except Exception as err:
            model = document.get("model")
            reason = getattr(err, "reason", "invalid")
            self.service.record_unrouted(model if type(model) is str else "", None, reason)
            raise

    async def _embed(self, request: HttpRequest, body: EmbeddingsBody) -> None:
        record = AccessRecord("", request.method, request.path, 0, body.model, rows=body.rows)
        try:
            context = traceparent(request) if self.service.tracing else None
            result = await self.embeddings.embed(body, request.is_disconnected, context)
            payload = encode_embeddings(result, body.encoding_format)
        except asyncio.CancelledError:
            self._fail(request, UnavailableError("server is shutting down; retry"), record)
            raise
        except Exception as err:
            self._fail(request, err, record)
            return
        record.version = result.version
        record.shapes = {result.input_name: _shape(body, result)}
        headers = [
            (QUEUE_TIME_US_HEADER, microseconds(result.queue_s).encode()),
            (COMPUTE_TIME_US_HEADER, microseconds(result.compute_s).encode()),
            (TOTAL_TIME_US_HEADER, microseconds(time.monotonic() - request.started_s).encode()),
        ]
        self._send(request, 200, payload, record, headers)

    def _fail(self, request: HttpRequest, err: BaseException, record: AccessRecord) -> None:
        answer = error_answer(err)
        # Messages of gpuserve errors may quote file paths (load failures); the HTTP layer's
        # own name only the URL, which the redactor would take for a file path.
        redact = isinstance(err, GpuserveError)
        body = answer.body(self.redactor.text(answer.message) if redact else None)
        self._send(request, answer.status, body, record, answer.headers)

    def _send(
        self,
        request: HttpRequest,
        status: int,
        payload: bytes,
        record: AccessRecord,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        respond_json(request, status, payload, headers or (), record if self.access_log else None)


def _shape(body: EmbeddingsBody, result: EmbeddingResult) -> list[int]:
    """The call's input shape for the access log: ``[rows]`` of texts, ``[rows, longest]``
    of token ids."""
    if body.token_ids is not None:
        return [result.rows, max(map(len, body.token_ids))]
    return [result.rows]
