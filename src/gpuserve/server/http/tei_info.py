"""TEI's client routes on the HTTP port: ``GET /health`` and ``GET /info``, as
text-embeddings-inference serves them (``huggingface_hub``'s ``InferenceClient.health_check()``
and ``get_endpoint_info()`` call them).

Endpoints::

    GET /health               200 (empty body) when the server is ready, else 503
    GET /info                 the model ``POST /`` answers with (the first, by name, serving
                              embeddings, else classification, rerank, sparse embeddings)
    GET /models/{model}/health  200 when the model can serve now (or load on demand)
    GET /models/{model}/info    that model (an ``InferenceClient`` given the URL
                                ``.../models/{model}`` asks there)

``/info`` answers TEI's ``Info`` schema::

    {"model_id": "minilm", "model_sha": null, "model_dtype": "float32",
     "model_type": {"embedding": {"pooling": "mean"}},   # or {"classifier": {"id2label":
                                                          # {...}}}, {"reranker": {...}}
     "max_concurrent_requests": 1024,   # the model's dynamic_batching.max_queue_size
     "max_input_length": 256,           # tokens, where the configuration says (else null)
     "max_batch_tokens": null,          # dynamic_batching.max_batch_tokens
     "max_batch_requests": 64,          # max_batch_size (rows per batch)
     "max_client_batch_size": 2048,     # inputs one call may carry (max_inputs_per_call,
                                        # or the model section's lower cap)
     "auto_truncate": true, "tokenization_workers": 4, "version": "0.1.0",
     "sha": null, "docker_label": null}

``pooling`` is the configured one (``huggingface.pooling``), ``splade`` for a sparse model,
else ``auto`` (the model chooses: its folder or its code). Errors are TEI's
``{"error", "error_type"}`` (:mod:`gpuserve.server.http.retrieval_errors`).
"""

from __future__ import annotations

from typing import Any

import orjson

import gpuserve
from gpuserve.config import ModelConfig
from gpuserve.errors import GpuserveError, ModelNotFoundError
from gpuserve.protocol.limits import RequestLimits
from gpuserve.server.http.request import HttpRequest
from gpuserve.server.http.retrieval_api import RetrievalApi
from gpuserve.server.http.retrieval_errors import tei_error
from gpuserve.server.http.routes import Answer, HttpError, Params
from gpuserve.server.security import Redactor
from gpuserve.service.apis.embedding_models import embedding_spec
from gpuserve.service.inference import InferenceService
from gpuserve.service.apis.retrieval import Kind, serves

MODELS_PREFIX = "/models/"
ACTIONS = ("health", "info")
_SUFFIXES = tuple("/" + action for action in ACTIONS)
_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int8": "int8"}


def model_view_path(path: str) -> bool:
    """Whether ``path`` is ``/models/{model}/health`` or ``/models/{model}/info`` (a "/"
    after it allowed): the row of :meth:`TeiInfoApi.model_view`."""
    path = path.rstrip("/")
    return path.startswith(MODELS_PREFIX) and path.endswith(_SUFFIXES)


class TeiInfoApi:
    """The endpoints of the module docstring.

    Args:
        service: The inference service (readiness, the served configurations).
        retrieval: The retrieval API (which models serve which kind, their caps).
        limits: Server-wide limits (``max_inputs_per_call``).
        redactor: Takes file paths out of error messages.
        tokenization_workers: Threads that run models' admission steps
            (``admission_workers``), TEI's ``tokenization_workers``.
    """

    def __init__(
        self,
        service: InferenceService,
        retrieval: RetrievalApi,
        limits: RequestLimits,
        redactor: Redactor,
        tokenization_workers: int,
    ) -> None:
        self.service = service
        self.retrieval = retrieval
        self.limits = limits
        self.redactor = redactor
        self.tokenization_workers = tokenization_workers

    # -- handlers (rows of the HTTP routing table) ---------------------------------------------

    def health(self, _request: HttpRequest, _method: str, _params: Params) -> Answer:
        """``GET /health``: the server's readiness, TEI's way (an empty 200)."""
        if self.service.views.server_ready():
            return 200, b""
        return 503, orjson.dumps({"error": "server is not ready", "error_type": "Unhealthy"})

    def info(self, _request: HttpRequest, _method: str, _params: Params) -> Answer:
        """``GET /info``: the model ``POST /`` answers with."""
        try:
            return 200, orjson.dumps(self.describe(self._root_model()))
        except GpuserveError as err:
            answer = tei_error(err, self.redactor)
            return answer.status, answer.body

    def model_view(self, request: HttpRequest, _method: str, _params: Params) -> Answer:
        """``GET /models/{model}/health`` or ``/info``."""
        name, _, action = request.path.rstrip("/")[len(MODELS_PREFIX) :].rpartition("/")
        if not name or action not in ACTIONS:
            raise HttpError(404, "a model's TEI views are GET models/{model}/info and /health")
        try:
            if action == "health":
                view = self.service.views.model_ready(name, None)
                if view.ready:
                    return 200, b""
                reason = self.redactor.text(view.reason or "not ready")
                return 503, orjson.dumps({"error": reason, "error_type": "Unhealthy"})
            return 200, orjson.dumps(self.describe(name))
        except GpuserveError as err:
            answer = tei_error(err, self.redactor)
            return answer.status, answer.body

    # -- the Info document -------------------------------------------------------------------

    def _root_model(self) -> str:
        """The model ``POST /`` goes to (the order of the retrieval API's root route)."""
        embedders = [view.id for view in self.retrieval.embeddings.models()]
        if embedders:
            return embedders[0]
        kinds: tuple[Kind, ...] = ("classification", "rerank", "sparse")
        for kind in kinds:
            names = self.retrieval.retrieval.models(kind)
            if names:
                return names[0]
        raise ModelNotFoundError(
            "no model serves embeddings, classification, rerank or sparse embeddings"
        )

    def describe(self, name: str) -> dict[str, Any]:
        """TEI's ``Info`` of model ``name``'s default version.

        Raises:
            ModelNotFoundError / ModelNotReadyError: no such model, or none serving now.
        """
        config = self.service.manager.version(name, None).config
        kind, model_type = _model_type(config)
        cap = self.retrieval.model_cap(name, kind) if kind is not None else None
        client_batch = self.limits.max_inputs_per_call
        if cap is not None and cap[2] is not None:
            client_batch = min(client_batch, cap[2])
        hf = config.huggingface if config.backend == "huggingface" else None
        return {
            "model_id": name,
            "model_sha": None,
            "model_dtype": _DTYPES.get(config.precision, config.precision),
            "model_type": model_type,
            "max_concurrent_requests": config.dynamic_batching.max_queue_size,
            "max_input_length": _max_input_length(config),
            "max_batch_tokens": config.dynamic_batching.max_batch_tokens,
            "max_batch_requests": config.max_batch_size or 1,
            "max_client_batch_size": client_batch,
            "auto_truncate": hf.truncation if hf is not None else True,
            "tokenization_workers": self.tokenization_workers,
            "version": gpuserve.__version__,
            "sha": None,
            "docker_label": None,
        }


def _model_type(config: ModelConfig) -> tuple[Kind | None, dict[str, Any]]:
    """TEI's ``model_type`` of a served configuration, and the retrieval kind whose cap
    applies (None for embeddings)."""
    if embedding_spec(config) is not None:
        return None, {"embedding": {"pooling": _pooling(config)}}
    if serves(config, "rerank"):
        return "rerank", {"reranker": {"id2label": _labels(config)}}
    if serves(config, "classification"):
        return "classification", {"classifier": {"id2label": _labels(config)}}
    if serves(config, "sparse"):
        return "sparse", {"embedding": {"pooling": "splade"}}
    raise ModelNotFoundError(
        f"model '{config.name}' serves no embeddings, classification, rerank or sparse embeddings"
    )


def _pooling(config: ModelConfig) -> str:
    if config.backend == "huggingface" and config.huggingface.pooling != "auto":
        return config.huggingface.pooling
    return "auto"


def _labels(config: ModelConfig) -> dict[str, str]:
    """``id2label`` of a classifier or reranker (``LABEL_<i>`` where no label is named)."""
    section = config.classification
    if section is not None and section.labels:
        return {str(i): label for i, label in enumerate(section.labels)}
    output = section.output if section is not None else None
    if output is None and config.rerank is not None:
        output = config.rerank.output
    spec = next((t for t in config.outputs if t.name == output), None)
    width = spec.shape[0] if spec is not None and len(spec.shape) == 1 else -1
    return {str(i): f"LABEL_{i}" for i in range(max(1, width))}


def _max_input_length(config: ModelConfig) -> int | None:
    """Tokens one input may have, where the configuration says: ``huggingface.max_length``
    or a ``max_seq_len`` parameter (the built-in text models'); else None."""
    if config.backend == "huggingface" and config.huggingface.max_length is not None:
        return config.huggingface.max_length
    value = config.parameters.get("max_seq_len")
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None
