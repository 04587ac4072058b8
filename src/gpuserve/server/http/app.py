"""KServe V2 (Open Inference Protocol) over HTTP/REST: the request handler.

Endpoints (V2 core, plus Triton's model-configuration, statistics and repository-index
extensions):

    GET  /v2/health/live                      200 while the process serves HTTP
    GET  /v2/health/ready                     200 when ready (rule: ModelManager.is_ready)
    GET  /v2                                  server metadata
    GET  /v2/models                           KServe's model list: {"models": [names]}
    GET  /v2/models/{m}[/versions/{v}]        model metadata
    GET  /v2/models/{m}[/versions/{v}]/ready  model readiness
    POST /v2/models/{m}[/versions/{v}]/infer  inference (JSON or binary tensor extension)
    POST /v2/models/{m}[/versions/{v}]/generate[_stream]  Triton's generate extension (JSON;
                                              server-sent events; see
                                              gpuserve.server.http.generate)
    GET  /v2/models/{m}[/versions/{v}]/config the model's configuration as Triton's ModelConfig
                                              JSON (gRPC's content); gpuserve's own fields
                                              at .../config/gpuserve or ?format=gpuserve
    GET  /v2/models[/{m}[/versions/{v}]]/stats statistics extension
    POST /v2/repository/index                 every model version and its state
    POST /v2/repository/models/{m}/...        load, unload, rollback, canary (see
                                              gpuserve.server.http.repository_api)
    GET  /v2/openapi.json                     this API as an OpenAPI 3 document
    .../systemsharedmemory, /cudasharedmemory Triton's shared-memory, trace-setting and
    /v2/trace/setting, /v2/logging            log-setting extensions (see
                                              gpuserve.server.http.extensions_api)
    GET  /metrics                             Prometheus metrics
    POST /v1/embeddings, GET /v1/models[/{m}] OpenAI-compatible embeddings (see
                                              gpuserve.server.http.openai; OpenAI's errors:
                                              any other /v1 path is OpenAI's 404, any method)
    POST /v1/rerank, /v2/rerank               Cohere/Jina rerank; TEI's /rerank, /predict,
    POST /rerank, /predict, /embed, ...       /embed, /embed_sparse, /tokenize, /similarity,
                                              / and /models/{m} (see
                                              gpuserve.server.http.retrieval_api)
    GET  /health, /info, /models/{m}/health   TEI's readiness and model info (see
    GET  /models/{m}/info                     gpuserve.server.http.tei_info)

With an API token configured, every endpoint but the health checks, ``/metrics`` and
``/v2/openapi.json`` needs ``Authorization: Bearer <token>`` (401 without it; see
:mod:`gpuserve.server.security`). Error bodies and load-failure reasons never carry file paths
outside the repository-relative part.

Every endpoint is one row of one ordered table, :meth:`HttpApp.routes` (first match wins; see
:mod:`gpuserve.server.http.routes`); a sub-API (OpenAI's ``/v1``, the repository's
``/v2/repository``, Triton's extensions) is one row there that mounts its own table, with its
own 404/405, errors and auth. The inference row, the per-request hot path, is also tested
before the table, in three C-level string tests that give the table's answer sooner.
A path no row takes is 404, or 405 under ``/v2`` for a method other than GET/POST. Errors are
``{"error": "..."}`` with the status from :mod:`gpuserve.server.status`; no stack trace ever
reaches a client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Coroutine
from typing import TYPE_CHECKING, Any

import orjson

from gpuserve.config import ServerConfig
from gpuserve.errors import GpuserveError, InvalidInputError, UnauthenticatedError
from gpuserve.protocol.http_codec import HttpInferBody, encode_infer_response
from gpuserve.protocol.limits import RequestLimits
from gpuserve.server.http import (
    extensions_api,
    generate,
    openai,
    repository_api,
    retrieval_api,
    tei_info,
)
from gpuserve.server.http import views as encode
from gpuserve.server.http.openapi import openapi_json
from gpuserve.server.http.request import JSON, HttpRequest, traceparent
from gpuserve.server.http.routes import (
    GET,
    POST,
    Answer,
    Exact,
    HttpError,
    ModelAction,
    ModelView,
    Mount,
    Params,
    Route,
    Suffix,
    Where,
    compile_routes,
    mount,
    no_route,
    split_model_path,
)
from gpuserve.server.security import OPEN_HTTP_PATHS, Redactor, Tokens
from gpuserve.server.status import http_status
from gpuserve.server.timing import (
    COMPUTE_TIME_US_HEADER,
    QUEUE_TIME_US_HEADER,
    TOTAL_TIME_US_HEADER,
    microseconds,
)
from gpuserve.service.constants import retry_after_s
from gpuserve.service.inference import Admission, InferenceService
from gpuserve.service.lanes import HEADER as LANE_HEADER
from gpuserve.service.lanes import LANE, parse_lane
from gpuserve.service.outcome import AccessRecord, log_access

if TYPE_CHECKING:
    from gpuserve.engine.request import InferenceResponse

logger = logging.getLogger(__name__)

#: The suffix of the inference row, the hot path (see :meth:`HttpApp.handle`).
INFER = "/infer"


class HttpApp:
    """The request handler of the REST front end (see :mod:`gpuserve.server.http.connection`
    for the HTTP/1.1 transport that calls it): an adapter between HTTP requests and the
    :class:`~gpuserve.service.inference.InferenceService`.

    Args:
        service: The inference service (admission, views, repository commands; its metrics
            serve ``GET /metrics``).
        config: Server settings (API tokens, limits, access log).
    """

    def __init__(self, service: InferenceService, config: ServerConfig) -> None:
        self.service = service
        self.metrics = service.metrics
        self.access_log = config.access_log
        self.config = config
        self.tokens = Tokens(config)
        self.redactor = Redactor(config.model_repository)
        self.repository = repository_api.RepositoryApi(service, self.redactor, self._later)
        self.extensions = extensions_api.ExtensionsApi(service)  # shm, trace, logging
        self.limits = RequestLimits(
            config.max_tensor_elements,
            config.max_bytes_element_bytes,
            config.max_inputs_per_call,
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self.generate = generate.GenerateApi(
            service,
            self.limits,
            self.redactor,
            self._fail,
            lambda request, status, body: self._send(request, status, body),
            lambda request, status, size: self._streamed(request, status, size),
        )
        self.openai = openai.OpenAIApi(
            service, self.tokens, self.limits, self.redactor, config.access_log, self.spawn
        )
        self.retrieval = retrieval_api.RetrievalApi(
            service,
            self.openai.embeddings,
            self.limits,
            self.redactor,
            config.access_log,
            self.spawn,
        )
        self.openai.serve_rerank(self.retrieval.cohere)  # POST /v1/rerank, in OpenAI's table
        self.tei_info = tei_info.TeiInfoApi(
            service, self.retrieval, self.limits, self.redactor, config.admission_workers
        )
        self._table = compile_routes(self.routes())

    def routes(self) -> list[Route]:
        """Every endpoint, one row each, in the order they are tried (first match wins).

        Rows before the first one without ``own_auth`` see the request first; every other
        row (and a path no row takes) needs the API token when one is configured, except the
        open paths (:data:`~gpuserve.server.security.OPEN_HTTP_PATHS`) and the repository's,
        whose commands check their own tokens. A sub-API's table is mounted by one row
        (:func:`~gpuserve.server.http.routes.mount`): its rows, its 404/405, its errors.
        """
        return [
            # OpenAI's table: its own errors and auth, any method (404/405s of its own).
            mount("/v1", self.openai.router, own_auth=True),
            # The hot path: POST .../{m}[/versions/{v}]/infer (inlined at the top of handle).
            Route(POST, Suffix(INFER), self._infer),
            Route(POST, ModelAction(*generate.ENDPOINTS), self._generate),
            Route(GET, Exact("/metrics"), self._metrics_route, when=self.metrics is not None),
            # the repository's table: V2's 404/405; its calls check the repository's tokens.
            mount("/v2/repository", self.repository.router),
            # shared memory, trace and log settings: any method (the table's 404 for the rest).
            mount(Where(extensions_api.handles), self.extensions.router),
            # GET views: "/"s after the path ignored.
            Route(GET, Exact("/v2/health/live", trailing_slash=True), self._live),
            Route(GET, Exact("/v2/health/ready", trailing_slash=True), self._ready),
            Route(GET, Exact("/v2", trailing_slash=True), self._server_metadata),
            Route(GET, Exact("/v2/openapi.json", trailing_slash=True), self._openapi),
            Route(GET, Exact("/v2/models/stats", trailing_slash=True), self._statistics),
            Route(GET, Exact("/v2/models", trailing_slash=True), self._model_list),
            Route(GET, ModelView(), self._model_metadata),
            Route(GET, ModelView("ready"), self._model_ready),
            Route(GET, ModelView("config"), self._model_config),  # ?format=gpuserve: ours
            Route(GET, ModelView("config/gpuserve"), self._gpuserve_config),
            Route(GET, ModelView("stats"), self._statistics),
            # Retrieval: Cohere/Jina's rerank (also /v1/rerank, in the mount) and TEI's routes.
            Route(POST, Exact("/v2/rerank"), self._cohere_rerank),
            *(Route(POST, Exact(path), self._tei) for path in retrieval_api.TEI_PATHS),
            Route(POST, Exact("/"), self._tei),
            Route(POST, Mount("/models"), self._tei_model),
            Route(GET, Exact("/health"), self.tei_info.health),
            Route(GET, Exact("/info"), self.tei_info.info),
            Route(GET, Where(tei_info.model_view_path), self.tei_info.model_view),
        ]

    # -- request handling ------------------------------------------------------------------

    def handle(self, request: HttpRequest) -> None:
        """Answer ``request``: at once, or (inference, ``/metrics``, repository calls) when
        its work is done. Never raises. A call with ``x-gpuserve-lane`` runs in that lane
        (:mod:`gpuserve.service.lanes`), the tasks it spawns included."""
        lane = request.header(LANE_HEADER)
        if lane is None:
            self._handle(request)
            return
        try:
            token = LANE.set(parse_lane(lane.decode("latin-1"), "header x-gpuserve-lane"))
        except InvalidInputError as err:
            self._fail(request, err)
            return
        try:
            self._handle(request)
        finally:
            LANE.reset(token)

    def _handle(self, request: HttpRequest) -> None:
        method = "GET" if request.method == "HEAD" else request.method  # the body is dropped
        path = request.path
        try:
            authorized = self.tokens.api is None
            # The hot path, tested before the table and answered as it would be: the OpenAI
            # mount (row 0) does not take the path, the inference row (row 1) does.
            if method == "POST" and path.endswith(INFER) and not path.startswith("/v1/"):
                if not authorized:
                    self._authorize(request)
                self._infer(request, method, None)
                return
            for methods, quick, match, handler, own_auth in self._table:
                if not quick(path) or (methods is not None and method not in methods):
                    continue
                if not (own_auth or authorized):
                    self._authorize(request)
                    authorized = True
                params = None
                if match is not None:
                    params = match(path)
                    if params is None:
                        continue
                answer = handler(request, method, params)
                break
            else:
                if not authorized:
                    self._authorize(request)
                raise no_route(method, path)
        except Exception as err:
            self._fail(request, err)
            return
        if answer is not None:
            self._send(request, *answer)

    def _authorize(self, request: HttpRequest) -> None:
        """Raise 401 unless the request carries the API token or needs none (the open paths,
        the repository's, whose commands check their own tokens)."""
        path = request.path
        if (
            path not in OPEN_HTTP_PATHS
            and not repository_api.own_tokens(path)
            and not self.tokens.allows_api(request.headers)
        ):
            raise HttpError(
                401,
                "this endpoint needs 'Authorization: Bearer <API token>'",
                [(b"www-authenticate", b"Bearer")],
            )

    def _send(
        self,
        request: HttpRequest,
        status: int,
        payload: bytes,
        content_type: bytes = JSON,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        request.respond(status, payload, content_type, headers or ())
        if self.access_log:
            _log_access(request, status, len(payload), time.monotonic() - request.started_s)

    def _fail(self, request: HttpRequest, err: BaseException) -> None:
        """Answer ``request`` with the status and JSON error for ``err``."""
        headers: list[tuple[bytes, bytes]] = []
        if isinstance(err, GpuserveError):
            status = http_status(err)
            message = err.message
            retry = retry_after_s(err)
            if retry is not None:
                headers = [(b"retry-after", str(retry).encode())]
            elif isinstance(err, UnauthenticatedError):
                headers = [(b"www-authenticate", b"Bearer")]
        elif isinstance(err, HttpError):
            status, message, headers = err.status, err.message, err.headers
            if request.method == "POST" and request.path.endswith("/infer"):  # path, token
                self._count_unrouted(request.path, "unauthorized" if status == 401 else "invalid")
        else:  # a bug: log it, never leak it
            logger.error(
                "unhandled error serving %s %s",
                request.method,
                request.path,
                exc_info=(type(err), err, err.__traceback__),
            )
            status, message = 500, "internal server error"
        self._send(
            request, status, orjson.dumps({"error": self.redactor.text(message)}), JSON, headers
        )

    def _streamed(self, request: HttpRequest, status: int, size: int) -> None:
        """The access line of an answer streamed without :meth:`_send` (generate_stream)."""
        if self.access_log:
            _log_access(request, status, size, time.monotonic() - request.started_s)

    def spawn(
        self, coroutine: Coroutine[Any, Any, None], serving: HttpRequest | None = None
    ) -> None:
        """Run ``coroutine`` as a task; one ``serving`` a request is cancelled when that
        request's client goes away (its queued work leaves the queue then)."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._tasks.discard)
        if serving is not None:
            serving.on_gone = task.cancel

    # -- the rows' handlers: (request, method with HEAD as GET, the matcher's params) ------

    def _cohere_rerank(self, request: HttpRequest, method: str, params: Params) -> Answer:
        self.retrieval.cohere(request, method, params)  # Cohere's errors
        return None

    def _tei(self, request: HttpRequest, method: str, params: Params) -> Answer:
        self.retrieval.tei(request, method, params)  # TEI's errors
        return None

    def _tei_model(self, request: HttpRequest, method: str, params: Params) -> Answer:
        self.retrieval.model_route(request, method, params)
        return None

    def _infer(self, request: HttpRequest, _method: str, _: Params) -> Answer:
        """Admit and queue an inference request through the service; :meth:`_infer_done`
        answers it. No task is created per request: the scheduler's future calls back."""
        name, version, rest = split_model_path(request.path)
        if rest != "infer":
            raise HttpError(404, f"unknown path {request.path}")
        header = request.header(b"inference-header-content-length")
        wire = HttpInferBody(
            request.body,
            None if header is None else header.decode("latin-1"),
            self.limits,
            self.service.extensions.shared_memory,
        )
        if self.service.cold(name):  # loads on demand first; a loaded model never gets here
            self.spawn(self._infer_cold(request, name, version, wire), request)
            return None
        # A request whose client disconnects while it waits leaves the queue at once (the
        # connection cancels its future, see _submit) and never runs; the probe is the
        # backstop read when its batch forms.
        context = traceparent(request) if self.service.tracing else None
        admission = self.service.admit(name, version, wire, request.is_disconnected, context)
        self._submit(request, admission, wire)
        return None

    def _generate(self, request: HttpRequest, _method: str, params: Params) -> Answer:
        name, version, endpoint = params  # Triton's generate extension
        self.spawn(self.generate.handle(request, name, version, endpoint), request)
        return None

    def _metrics_route(self, request: HttpRequest, _method: str, _: Params) -> Answer:
        self.spawn(self._metrics(request))
        return None

    def _live(self, _request: HttpRequest, _method: str, _: Params) -> Answer:
        return 200, b'{"live":true}'

    def _ready(self, _request: HttpRequest, _method: str, _: Params) -> Answer:
        ready = self.service.views.server_ready()
        return (200 if ready else 503), orjson.dumps({"ready": ready})

    def _server_metadata(self, _request: HttpRequest, _method: str, _: Params) -> Answer:
        return 200, orjson.dumps(self.service.views.server_metadata())

    def _openapi(self, _request: HttpRequest, _method: str, _: Params) -> Answer:
        return 200, openapi_json()

    def _statistics(self, _request: HttpRequest, _method: str, params: Params) -> Answer:
        """``/v2/models/stats`` (every model: no params) or a model's (version's)."""
        name, version, _action = params or (None, None, None)
        return 200, encode.statistics(self.service.views.statistics(name, version))

    def _model_list(self, _request: HttpRequest, _method: str, _: Params) -> Answer:
        """KServe's model list: ``{"models": ["name", ...]}``."""
        return 200, orjson.dumps({"models": self.service.views.model_names()})

    def _model_metadata(self, _request: HttpRequest, _method: str, params: Params) -> Answer:
        name, version, _action = params
        metadata = self.service.views.model_metadata(name, version)
        return 200, self.redactor.json(orjson.dumps(metadata))

    def _model_ready(self, _request: HttpRequest, _method: str, params: Params) -> Answer:
        name, version, _action = params
        view = self.service.views.model_ready(name, version)
        return (200 if view.ready else 503), self.redactor.json(encode.ready(view, name))

    def _model_config(self, request: HttpRequest, method: str, params: Params) -> Answer:
        """Triton's ``ModelConfig`` as JSON; gpuserve's own with ``?format=gpuserve``."""
        if b"format=gpuserve" in request.query:
            return self._gpuserve_config(request, method, params)
        name, version, _action = params
        return 200, encode.model_config(self.service.views.model_config(name, version))

    def _gpuserve_config(self, _request: HttpRequest, _method: str, params: Params) -> Answer:
        name, version, _action = params
        return 200, encode.gpuserve_config(self.service.views.model_config(name, version))

    def _submit(self, request: HttpRequest, admission: Admission, wire: HttpInferBody) -> None:
        request.access = admission
        future = self.service.submit(admission)
        request.on_gone = future.cancel  # the client left: out of the queue at once
        future.add_done_callback(lambda done: self._infer_done(request, done, wire, admission))

    async def _infer_cold(
        self, request: HttpRequest, name: str, version: str | None, wire: HttpInferBody
    ) -> None:
        """A request for a model that loads on demand: wait for the load (up to the model's
        queue timeout), then admit it as any other (no await in between, so the model cannot
        be evicted before the request is queued)."""
        try:
            probe = request.is_disconnected
            context = traceparent(request) if self.service.tracing else None
            admission = await self.service.admit_loaded(name, version, wire, probe, context)
            self._submit(request, admission, wire)
        except Exception as err:
            self._fail(request, err)

    def _infer_done(
        self,
        request: HttpRequest,
        future: asyncio.Future[InferenceResponse],
        wire: HttpInferBody,
        admission: Admission,
    ) -> None:
        if future.cancelled():  # the client went away: nobody to answer
            if self.access_log:
                _log_access(request, 499, 0, time.monotonic() - request.started_s)
            return
        try:
            response = future.result()
            if wire.output_options.classification:  # Triton's classification extension
                response = self.service.extensions.classify(
                    admission.model, admission.config, response, wire.output_options.classification
                )
            encoded = encode_infer_response(response, wire.output_options, admission.config)
        except BaseException as err:
            self._fail(request, err)
            return
        timing = response.timing
        headers = [
            (QUEUE_TIME_US_HEADER, microseconds(timing.queue_s).encode()),
            (COMPUTE_TIME_US_HEADER, microseconds(timing.compute_s).encode()),
        ]
        if encoded.header_length is not None:
            headers.append(
                (b"inference-header-content-length", str(encoded.header_length).encode())
            )
        headers.append(
            (TOTAL_TIME_US_HEADER, microseconds(time.monotonic() - request.started_s).encode())
        )
        self._send(request, 200, encoded.body, encoded.content_type.encode(), headers)

    async def _metrics(self, request: HttpRequest) -> None:
        """``GET /metrics``: rendered off the event loop (NVML reads can take milliseconds)."""
        from gpuserve.metrics import render

        assert self.metrics is not None
        accept = request.header(b"accept")
        loop = asyncio.get_running_loop()
        try:
            body, content_type = await loop.run_in_executor(
                None,
                render,
                self.metrics.registry,
                "" if accept is None else accept.decode("latin-1"),
            )
        except Exception as err:
            self._fail(request, err)
            return
        self._send(request, 200, body, content_type.encode())

    def _count_unrouted(self, path: str, reason: str) -> None:
        """Count a failed inference request that never reached the service (bad path,
        missing API token)."""
        parts = path.split("/")  # ['', 'v2', 'models', name, ...]
        self.service.record_unrouted(parts[3] if len(parts) > 3 else "", None, reason)

    def _later(self, request: HttpRequest, result: Awaitable[bytes]) -> None:
        """Answer ``request`` from a task: 200 with the JSON body ``result`` gives, or the
        error it raises (repository commands)."""

        async def answer() -> None:
            try:
                payload = await result
            except Exception as err:
                self._fail(request, err)
                return
            self._send(request, 200, payload)

        self.spawn(answer())


def _log_access(request: HttpRequest, status: int, size: int, total_s: float) -> None:
    """One ``gpuserve.access`` line: client, request line, status, model, version, rows, input
    shapes (never contents), response bytes and total milliseconds; the same fields go to JSON
    logs as keys."""
    client = request.client
    peer = f"{client[0]}:{client[1]}" if client else "-"
    record = AccessRecord(peer, request.method, request.path, status, size=size, total_s=total_s)
    admission: Admission | None = request.access
    if admission is not None:
        record.model, record.version = admission.model, admission.version
        record.rows, record.shapes = admission.rows, admission.shapes()
    elif request.path.startswith("/v2/models/"):
        record.model = request.path.split("/")[3] or "-"
    log_access(record)
