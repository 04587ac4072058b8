"""Rerank, classification and sparse embeddings: which models serve them, and one call served
as rows through the inference service.

A model serves a kind when its served configuration has the section
(:mod:`gpuserve.config.retrieval`; the huggingface backend fills them in at load): ``rerank``
(query/passage pairs -> one score), ``classification`` (text or pair -> a score per label)
and ``sparse`` (text -> top-k term ids and weights).

One call of N rows (a query against N passages is N pairs) is served as requests of the
:class:`InferenceService`, never around it, like the embeddings API
(:mod:`gpuserve.service.apis.embeddings`):

1. the rows are ordered by length and cut into chunks of at most ``max_batch_size`` rows, so
   each chunk pads little (the model's admission step then measures every pair's tokens,
   which the dynamic batcher groups and bounds batches by, with other clients' requests);
2. chunks are admitted (:meth:`InferenceService.admit`) and queued
   (:meth:`InferenceService.submit`) **at most :data:`WINDOW` at a time**
   (:mod:`gpuserve.service.apis.chunks`, as the embeddings service does): a request that arrives
   meanwhile waits for at most the chunks already queued (a batch or two) before its own
   rows run, while the instance always has the next chunk of the long call ready;
3. the first chunk is routed (canary split, load on demand); the rest are pinned to the
   version that took it, so an answer never mixes versions; each carries the client's
   ``traceparent``;
4. outputs come back in input order; scores stay raw (logits): the API adapters apply the
   sigmoid / softmax their clients expect.

How many rows one call may carry is the API's check, before this service is called
(:meth:`~gpuserve.protocol.limits.RequestLimits.check_inputs`). When a chunk is refused or
fails the call fails with that error; chunks not yet queued are never sent, and queued ones
are dropped when their batch forms.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from gpuserve.config import ModelConfig
from gpuserve.engine.request import InferenceRequest, InferenceResponse
from gpuserve.errors import BackendError, InvalidInputError, ModelNotFoundError
from gpuserve.service.apis.chunks import WINDOW, CallState, route_plan, serve_chunks
from gpuserve.service.apis.embeddings import even_chunks
from gpuserve.service.inference import InferenceService, WireRequest

Kind = Literal["rerank", "classification", "sparse"]
KINDS: tuple[Kind, ...] = ("rerank", "classification", "sparse")


def serves(config: ModelConfig, kind: Kind) -> bool:
    """Whether ``config`` (a served, completed configuration) serves ``kind``."""
    section = getattr(config, kind)  # one of three declared fields, never a probe
    return section is not None and bool(section.enabled)


@dataclass(frozen=True, slots=True)
class RowsResult:
    """The answer of one call.

    Attributes:
        model / version: The model and the version that served every row.
        config: That version's configuration (its retrieval sections name the outputs).
        outputs: Output name -> array, row i = input row i (batch dimension first).
        tokens: Tokens the model read, all rows (its admission step's counts; 0 without).
        requests: Chunks the call was served as.
        queue_s / compute_s: The longest queue and compute time among the chunks, seconds.
    """

    model: str
    version: str
    config: ModelConfig
    outputs: dict[str, np.ndarray]
    tokens: int
    requests: int
    queue_s: float
    compute_s: float


class RowsWire:
    """Some rows of a call as one inference request (the service's ``WireRequest``).

    Args:
        kind: The kind served (its section names the tensors).
        texts: The first text of every row of the call.
        pairs: The second text of every row (rerank passages, classifier pairs), or None.
        rows: Indices of the rows of this request, in tensor order.
        request_id: The call's routing id (canary split), or None.
    """

    __slots__ = ("kind", "pairs", "request_id_", "rows", "texts")

    def __init__(
        self,
        kind: Kind,
        texts: Sequence[str],
        pairs: Sequence[str] | None,
        rows: Sequence[int],
        request_id: str | None = None,
    ) -> None:
        self.kind = kind
        self.texts = texts
        self.pairs = pairs
        self.rows = rows
        self.request_id_ = request_id

    def request_id(self) -> str | None:
        """The call's routing id."""
        return self.request_id_

    def decode(
        self, config: ModelConfig, model_name: str, model_version: str | None
    ) -> InferenceRequest:
        """The request of these rows for the routed version's ``config``: BYTES ``[rows, 1]``
        text (and pair) inputs, the kind's outputs requested.

        Raises:
            ModelNotFoundError: the version does not serve the kind.
            InvalidInputError: pairs sent to a classifier that takes single texts.
        """
        inputs: dict[str, np.ndarray] = {}
        names: tuple[str, str | None]
        if self.kind == "rerank" and config.rerank is not None and config.rerank.enabled:
            names = (config.rerank.text_input, config.rerank.pair_input)
            outputs = [config.rerank.output]
        elif self.kind == "classification" and config.classification is not None:
            section = config.classification
            if self.pairs is not None and section.pair_input is None:
                raise InvalidInputError(f"model '{model_name}' classifies single texts, not pairs")
            names = (section.text_input, section.pair_input)
            outputs = [section.output]
        elif self.kind == "sparse" and config.sparse is not None:
            names = (config.sparse.text_input, None)
            outputs = [config.sparse.indices_output, config.sparse.values_output]
        else:
            raise ModelNotFoundError(f"model '{model_name}' does not serve {self.kind}")
        batched = config.max_batch_size > 0
        for name, values in ((names[0], self.texts), (names[1], self.pairs)):
            if name is None or values is None:
                continue
            array = np.empty(len(self.rows), dtype=object)
            for slot, row in enumerate(self.rows):
                array[slot] = values[row].encode("utf-8")
            inputs[name] = array.reshape(-1, 1) if batched else array.reshape(1)
        return InferenceRequest(
            model_name=model_name,
            model_version=model_version,
            inputs=inputs,
            requested_outputs=outputs,
        )


def chunk_rows(lengths: Sequence[int], per: int) -> list[list[int]]:
    """Row indices ordered by ``lengths`` and cut into chunks of at most ``per`` (at least
    1) rows whose sizes differ by at most one; every index appears once."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    return even_chunks(order, max(1, per))


class RetrievalService:
    """Rerank, classification and sparse calls over an :class:`InferenceService` (see the
    module docstring).

    Args:
        service: The inference service every chunk is admitted through.
        window: Chunks of one call in flight at once.
    """

    def __init__(self, service: InferenceService, window: int = WINDOW) -> None:
        self.service = service
        self.window = max(1, window)

    # -- models ----------------------------------------------------------------------------

    def models(self, kind: Kind) -> list[str]:
        """The models that serve ``kind`` now (a ready default version), by name."""
        names = []
        for name, model in sorted(self.service.manager.models.items()):
            mv = model.route.default
            if mv is not None and serves(mv.config, kind):
                names.append(name)
        return names

    def config(self, name: str) -> ModelConfig:
        """The configuration model ``name``'s default version serves with.

        Raises:
            ModelNotFoundError / ModelNotReadyError: no such model, or none serving.
        """
        return self.service.manager.version(name, None).config

    def resolve(self, kind: Kind, requested: str | None) -> str:
        """The model a call for ``kind`` goes to: ``requested``, or (None) the first by name
        of those serving it (for classification, of those that are not rerankers if any).

        Raises:
            ModelNotFoundError: the model does not exist or does not serve ``kind``, or
                (None) no model serves it; counted as unrouted.
        """
        serving = self.models(kind)
        if requested is None and serving:
            if kind == "classification":  # a classifier before a reranker (one label)
                plain = [n for n in serving if n not in self.models("rerank")]
                return (plain or serving)[0]
            return serving[0]
        model = self.service.manager.models.get(requested or "")
        if model is not None:
            default = model.route.default
            config = default.config if default is not None else model.config
            if config is not None and (
                serves(config, kind) or (default is None and _declares(config, kind))
            ):
                return requested or ""
        if requested is None:
            what = f"no model serves {kind}"
        elif model is None:
            what = f"model '{requested}' does not exist"
        else:
            what = f"model '{requested}' does not serve {kind}"
        err = ModelNotFoundError(f"{what} (models serving {kind}: {', '.join(serving) or 'none'})")
        self.service.record_unrouted(requested or "", None, err.reason)
        raise err

    # -- one call --------------------------------------------------------------------------

    async def run(
        self,
        kind: Kind,
        model: str,
        texts: Sequence[str],
        pairs: Sequence[str] | None = None,
        is_cancelled: Callable[[], bool] | None = None,
        request_id: str | None = None,
        wrap: Callable[[WireRequest], WireRequest] | None = None,
        traceparent: str | None = None,
    ) -> RowsResult:
        """Serve ``len(texts)`` rows of ``kind`` on ``model`` (steps 1-4 of the module
        docstring).

        Args:
            kind: What the rows are.
            model: The model (see :meth:`resolve`).
            texts: First text of each row (at least one).
            pairs: Second text of each row, or None.
            is_cancelled: Probe, True once the client has gone away.
            request_id: Routing id for a canary split.
            wrap: Applied to each chunk's wire request before admission (the Batch API
                marks its requests bulk this way), or None.
            traceparent: The client's W3C trace context (every chunk's span joins it), or
                None.

        Raises:
            GpuserveError: why the call is refused or failed (counted once).
        """
        lengths = [len(t) for t in texts]
        if pairs is not None:
            lengths = [n + len(p) for n, p in zip(lengths, pairs, strict=True)]
        plan = route_plan(self.service, model, self.window)
        chunks = chunk_rows(lengths, plan.rows)

        def chunk(index: int) -> WireRequest:
            wire: WireRequest = RowsWire(kind, texts, pairs, chunks[index], request_id)
            return wire if wrap is None else wrap(wire)

        admissions, done = await serve_chunks(
            self.service,
            model,
            chunk,
            len(chunks),
            CallState(is_cancelled),
            plan.window,
            traceparent,
        )
        first = admissions[0]
        return RowsResult(
            model=model,
            version=first.version,
            config=first.config,
            outputs=_assemble(chunks, done, len(texts)),
            tokens=sum(a.request.cost.tokens for a in admissions if a.request.cost is not None),
            requests=len(chunks),
            queue_s=max(r.timing.queue_s for r in done),
            compute_s=max(r.timing.compute_s for r in done),
        )


def _declares(config: ModelConfig, kind: Kind) -> bool:
    """Whether a model not loaded yet will serve ``kind``: its section, or a huggingface task
    whose completion fills it in. A task left unset is read from the folder at load: it may
    serve any kind (the loaded version answers "does not serve" if it does not)."""
    if serves(config, kind):
        return True
    if config.backend != "huggingface":
        return False
    task = config.huggingface.task
    if task is None:
        return config.generate is None
    if kind == "sparse":
        return task == "sparse-embedding"
    return task == "sequence-classification"


def _assemble(
    chunks: list[list[int]], responses: Sequence[InferenceResponse], total: int
) -> dict[str, np.ndarray]:
    """Every output of the chunks' responses, rows back in input order.

    Raises:
        BackendError: a response lacks an output or has the wrong number of rows.
    """
    names = list(responses[0].outputs)
    out: dict[str, np.ndarray] = {}
    for name in names:
        parts = []
        for rows, response in zip(chunks, responses, strict=True):
            values = response.outputs.get(name)
            if values is None:
                raise BackendError(f"the model returned no {name!r} output")
            values = np.asarray(values)
            if values.ndim == 1 and len(rows) == 1:
                values = values.reshape(1, -1)
            if values.shape[0] != len(rows):
                raise BackendError(
                    f"the model returned {values.shape[0]} rows of {name!r} for {len(rows)}"
                )
            parts.append(values)
        merged = np.empty((total, *parts[0].shape[1:]), dtype=parts[0].dtype)
        for rows, values in zip(chunks, parts, strict=True):
            merged[rows] = values
        out[name] = merged
    return out


__all__ = [
    "KINDS",
    "WINDOW",
    "Kind",
    "RetrievalService",
    "RowsResult",
    "RowsWire",
    "chunk_rows",
    "serves",
]
