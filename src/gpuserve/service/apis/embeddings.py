"""Embeddings: which models serve them, and one embeddings call served through admission.

A model serves embeddings (the OpenAI-compatible ``/v1/embeddings`` and ``/v1/models``) when
its configuration says which input takes text (or token ids) and which output is the
embedding: an ``embedding:`` section (:class:`~gpuserve.config.EmbeddingConfig`; the default
repository's ``text_embedding`` has one), or automatically for the ``huggingface`` backend's
``feature-extraction`` task. :func:`~gpuserve.service.apis.embedding_models.embedding_spec`
resolves that declaration against the configuration a version is served with (names of that
module are re-exported here).

One call of N inputs is served as requests of the :class:`InferenceService`, never around it:

1. the model must serve embeddings (else ``ModelNotFoundError``, counted as unrouted);
2. the N rows are split into chunks of at most ``max_batch_size`` rows (the smallest of the
   versions the route may pick): texts longer than one chunk are ordered by length first, so
   each chunk pads little, and cut into near-equal chunks; token-id rows are grouped by length
   (a tensor is rectangular), then cut;
3. each chunk is admitted with :meth:`InferenceService.admit` (resolve, canary split, decode
   against the routed version, shutdown refusal, all counted there) and queued with
   :meth:`InferenceService.submit`, so it joins the model's dynamic batcher with V2 traffic
   and is counted as one request of that many rows; at most :data:`~gpuserve.service.apis.chunks.
   WINDOW` chunks of a call are queued or running at once (:mod:`gpuserve.service.apis.chunks`),
   so a long call's rows are interleaved with other clients' requests. The first chunk is
   routed (a canary takes it by a hash of the call's routing id); the rest are pinned to the
   version that took it, so one answer never mixes versions; each carries the client's
   ``traceparent``;
4. the token counts are computed while the chunks queue and run (below);
5. the embeddings come back in input order, cut to ``dimensions`` (and re-normalised) when
   the model allows it.

How many inputs one call may carry is the API's check, before this service is called
(:meth:`~gpuserve.protocol.limits.RequestLimits.check_inputs`). When one chunk is refused
(queue full) or fails, or the client goes away, the call fails: chunks not yet queued are
never sent and queued ones are dropped when their batch forms (they are not run for nobody).

Token counts (``usage.prompt_tokens``) are the model's own. A model with an admission step
(:mod:`gpuserve.engine.admission`; the built-in text models) measured every chunk before it
was queued: the count is the sum of the chunks' costs (tokens per row after truncation), with
no second tokenisation. Otherwise the served version's backend, or a
``python`` model's class, declares ``count_tokens(texts: Sequence[str]) -> list[int]`` (tokens
per text, special tokens included, after the model's truncation: what it embeds). It is
called once per call with every text, after admission, while the batches run: inline for a
short call (at most :data:`INLINE_COUNT_CHARS` characters, cheaper than a thread hop), else in
a small bounded thread pool, so a long text never blocks the event loop. It must be
thread-safe (it runs beside the instance's own threads). Token-id inputs count their ids.
``embedding.token_counts: none``, or a model without the hook, reports 0 for text.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gpuserve.engine.request import InferenceResponse
from gpuserve.errors import BackendError, ConfigError, GpuserveError, ModelNotFoundError
from gpuserve.service.apis.chunks import WINDOW, CallState, route_plan, serve_chunks
from gpuserve.service.apis.embedding_models import (
    COUNT_WORKERS,
    EmbeddingInputError,
    EmbeddingSpec,
    TokenCounter,
    count_pool,
    embedding_spec,
    model_counter,
)
from gpuserve.service.inference import Admission, InferenceService, WireRequest

__all__ = [
    "COUNT_WORKERS",
    "INLINE_COUNT_CHARS",
    "EmbeddingCall",
    "EmbeddingInputError",
    "EmbeddingModelView",
    "EmbeddingResult",
    "EmbeddingSpec",
    "EmbeddingsService",
    "TokenCounter",
    "count_pool",
    "embedding_spec",
    "model_counter",
    "split_rows",
]

logger = logging.getLogger(__name__)

#: Calls with at most this many characters of text are counted on the event loop (tens of
#: microseconds); longer ones in :func:`count_pool`.
INLINE_COUNT_CHARS = 2048


class EmbeddingCall(Protocol):
    """One embeddings call as a front end decoded it (exactly one of ``texts`` and
    ``token_ids`` is set, with at least one row)."""

    @property
    def model(self) -> str:
        """The model name."""
        ...

    @property
    def texts(self) -> Sequence[str] | None:
        """One text per row, or None."""
        ...

    @property
    def token_ids(self) -> Sequence[Sequence[int]] | None:
        """One sequence of token ids per row, or None."""
        ...

    @property
    def dimensions(self) -> int | None:
        """Width to cut each embedding to, or None for the model's."""
        ...

    def wire(self, rows: Sequence[int]) -> WireRequest:
        """The request of the rows ``rows`` (indices into the call, in this order), to
        admit; its ``request_id`` is the call's routing id."""
        ...


@dataclass(frozen=True, slots=True)
class EmbeddingResult:
    """The answer of one call.

    Attributes:
        model / version: The model and the version that served every row.
        embeddings: float32 [N, D], C-contiguous; row i is input i (D = ``dimensions`` when
            given, else the model's width).
        prompt_tokens: Tokens the model embedded, all rows together.
        requests: Chunks the call was served as.
        input_name: The input the rows went to.
        queue_s / compute_s: The longest queue and batch compute time among the chunks,
            seconds.
    """

    model: str
    version: str
    embeddings: np.ndarray
    prompt_tokens: int
    requests: int
    input_name: str
    queue_s: float
    compute_s: float

    @property
    def rows(self) -> int:
        """N, the number of inputs."""
        return int(self.embeddings.shape[0])


@dataclass(frozen=True, slots=True)
class EmbeddingModelView:
    """One model of ``GET /v1/models``.

    Attributes:
        id: The model name.
        created: When its served version folder was last changed, Unix seconds.
        owned_by: Always ``gpuserve``.
    """

    id: str
    created: int
    owned_by: str = "gpuserve"


def split_rows(call: EmbeddingCall, max_rows: int) -> list[list[int]]:
    """Row indices of each chunk (see step 2 of the module docstring).

    Args:
        call: The call.
        max_rows: Most rows in one chunk (``max_batch_size``; at least 1).

    Returns:
        Chunks of at most ``max_rows`` indices; every index appears once.
    """
    per = max(1, max_rows)
    if call.token_ids is not None:
        by_length: dict[int, list[int]] = {}
        for index, ids in enumerate(call.token_ids):
            by_length.setdefault(len(ids), []).append(index)
        return [chunk for group in by_length.values() for chunk in even_chunks(group, per)]
    texts = call.texts or ()
    order = list(range(len(texts)))
    if len(order) > per:
        order.sort(key=lambda index: len(texts[index]))
    return even_chunks(order, per)


def even_chunks(rows: list[int], per: int) -> list[list[int]]:
    """``rows`` in ceil(len/per) consecutive chunks whose sizes differ by at most one."""
    count = -(-len(rows) // per)
    if count <= 1:
        return [rows]
    size, extra = divmod(len(rows), count)
    chunks, start = [], 0
    for index in range(count):
        stop = start + size + (1 if index < extra else 0)
        chunks.append(rows[start:stop])
        start = stop
    return chunks


class EmbeddingsService:
    """Embeddings over an :class:`InferenceService` (see the module docstring).

    Args:
        service: The inference service every chunk is admitted through.
        window: Chunks of one call queued or running at once.
    """

    def __init__(self, service: InferenceService, window: int = WINDOW) -> None:
        self.service = service
        self.window = max(1, window)
        self._uncounted: set[tuple[str, str]] = set()

    # -- models ----------------------------------------------------------------------------

    def models(self) -> list[EmbeddingModelView]:
        """The models that serve embeddings now (a READY default version), by name."""
        views = []
        for name, model in sorted(self.service.manager.models.items()):
            mv = model.route.default
            if mv is None:
                continue
            try:
                spec = embedding_spec(mv.config)
            except ConfigError:
                continue
            if spec is not None:
                views.append(EmbeddingModelView(name, created(mv.path)))
        return views

    def model(self, name: str) -> EmbeddingModelView:
        """Model ``name`` as ``GET /v1/models/{name}`` shows it.

        Raises:
            ModelNotFoundError: no such model, or it does not serve embeddings.
            ModelNotReadyError: it does, but no version serves now.
        """
        self._require(name)
        mv = self.service.manager.version(name, None)
        return EmbeddingModelView(name, created(mv.path))

    def _require(self, name: str) -> None:
        """Raise unless model ``name`` serves embeddings (per its current configuration; a
        model whose configuration is unreadable passes: admission then says why)."""
        model = self.service.manager.models.get(name)
        if model is None or (model.config is not None and embedding_spec(model.config) is None):
            serving = ", ".join(view.id for view in self.models()) or "none"
            what = "does not exist" if model is None else "does not serve embeddings"
            raise ModelNotFoundError(
                f"model '{name}' {what} (models serving embeddings: {serving})"
            )

    # -- one call --------------------------------------------------------------------------

    async def embed(
        self,
        call: EmbeddingCall,
        is_cancelled: Callable[[], bool] | None = None,
        traceparent: str | None = None,
    ) -> EmbeddingResult:
        """Serve ``call`` (steps 1-5 of the module docstring).

        Args:
            call: The decoded call.
            is_cancelled: Probe, True once the client has gone away.
            traceparent: The client's W3C trace context (every chunk's span joins it), or
                None.

        Raises:
            GpuserveError: why the call is refused or failed (counted once: by admission,
                by the version that took the chunk, or as unrouted).
        """
        try:
            self._require(call.model)
        except GpuserveError as err:
            self.service.record_unrouted(call.model, None, err.reason)
            raise
        plan = route_plan(self.service, call.model, self.window)
        chunks = split_rows(call, plan.rows)
        # The token count overlaps the batches: started once the first chunk is queued
        # (every chunk runs on its version; a model whose admission step measured each
        # chunk needs none).
        counting: list[int | asyncio.Future[list[int]] | None] = []

        def count(first: Admission) -> None:
            spec = embedding_spec(first.config)
            assert spec is not None  # decode refuses a configuration that serves none
            measured = first.runner.capabilities.admission is not None
            counting.append(None if measured else self._count(first, call, spec))

        try:
            admissions, responses = await serve_chunks(
                self.service,
                call.model,
                lambda index: call.wire(chunks[index]),
                len(chunks),
                CallState(is_cancelled),
                plan.window,
                traceparent,
                count,
            )
        except BaseException:
            if counting and isinstance(counting[0], asyncio.Future):
                counting[0].cancel()  # nobody will read the count
            raise
        first = admissions[0]
        spec = embedding_spec(first.config)
        assert spec is not None
        pending = counting[0]
        if pending is None:
            tokens = _admitted_tokens(admissions, call, spec)
        else:
            tokens = pending if isinstance(pending, int) else sum(await pending)
        embeddings = _assemble(chunks, responses, spec, call.dimensions)
        return EmbeddingResult(
            model=call.model,
            version=first.version,
            embeddings=embeddings,
            prompt_tokens=tokens,
            requests=len(chunks),
            input_name=next(iter(first.request.inputs)),
            queue_s=max(r.timing.queue_s for r in responses),
            compute_s=max(r.timing.compute_s for r in responses),
        )

    def _count(
        self, admission: Admission, call: EmbeddingCall, spec: EmbeddingSpec
    ) -> int | asyncio.Future[list[int]]:
        """The call's token count, or a future of the per-text counts (worker thread)."""
        if call.token_ids is not None:
            return sum(map(len, call.token_ids))
        texts = call.texts or ()
        if spec.token_counts == "none":
            return 0
        counter = model_counter(admission.runner)
        if counter is None:
            key = (admission.model, admission.version)
            if key not in self._uncounted:
                self._uncounted.add(key)
                logger.warning(
                    "model %s version %s has no count_tokens: /v1/embeddings reports 0 "
                    "prompt tokens (set embedding.token_counts: none to silence this)",
                    *key,
                )
            return 0
        if sum(map(len, texts)) <= INLINE_COUNT_CHARS:
            try:
                return sum(counter(texts))
            except Exception as err:
                raise _count_failed(admission, err) from err
        future = asyncio.get_running_loop().run_in_executor(count_pool(), counter, list(texts))
        return asyncio.ensure_future(_guarded(future, admission))


def _admitted_tokens(admissions: list[Admission], call: EmbeddingCall, spec: EmbeddingSpec) -> int:
    """The call's token count from its chunks' admission costs (token-id rows count their
    ids; ``token_counts: none`` reports 0)."""
    if call.token_ids is not None:
        return sum(map(len, call.token_ids))
    if spec.token_counts == "none":
        return 0
    return sum(a.request.cost.tokens for a in admissions if a.request.cost is not None)


async def _guarded(future: asyncio.Future[list[int]], admission: Admission) -> list[int]:
    try:
        return await future
    except Exception as err:
        raise _count_failed(admission, err) from err


def _count_failed(admission: Admission, err: Exception) -> BackendError:
    logger.error(
        "count_tokens of model %s version %s failed",
        admission.model,
        admission.version,
        exc_info=(type(err), err, err.__traceback__),
    )
    return BackendError(f"model '{admission.model}' failed to count the tokens of the input")


def _assemble(
    chunks: list[list[int]],
    responses: Sequence[InferenceResponse],
    spec: EmbeddingSpec,
    dimensions: int | None,
) -> np.ndarray:
    """The chunks' embeddings in input order, float32 [N, D], cut to ``dimensions``.

    Raises:
        BackendError: a response lacks the output or has the wrong number of rows.
    """
    parts = []
    for rows, response in zip(chunks, responses, strict=True):
        values = response.outputs.get(spec.output)
        if values is None or values.ndim not in (1, 2):
            raise BackendError(f"the model returned no {spec.output!r} embeddings")
        if values.ndim == 1:  # a model without batching: one row, no batch dimension
            values = values.reshape(1, -1)
        if values.shape[0] != len(rows):
            raise BackendError(
                f"the model returned {values.shape[0]} embeddings for {len(rows)} inputs"
            )
        parts.append(values)
    total = sum(map(len, chunks))
    if len(chunks) == 1 and chunks[0] == list(range(total)):
        out = np.ascontiguousarray(parts[0], dtype=np.float32)
    else:
        out = np.empty((total, parts[0].shape[1]), dtype=np.float32)
        for rows, values in zip(chunks, parts, strict=True):
            out[rows] = values
    if dimensions is not None and dimensions < out.shape[1]:
        out = np.ascontiguousarray(out[:, :dimensions])
        if spec.normalize_truncated:
            norms = np.linalg.norm(out, axis=1, keepdims=True)
            out /= np.maximum(norms, np.float32(1e-12))
    return out


def created(path: os.PathLike[str] | str) -> int:
    """When ``path`` (a version folder) last changed, Unix seconds (0 when unreadable)."""
    try:
        return int(os.stat(path).st_mtime)
    except OSError:
        return 0
