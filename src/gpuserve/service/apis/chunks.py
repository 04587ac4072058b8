"""One call of many rows served as chunks, a window at a time, through the inference service.

The embeddings service (OpenAI's ``/v1/embeddings``, TEI's ``/embed`` and ``/similarity``)
and the retrieval service (``/rerank``, ``/predict``, ``/embed_sparse``, Cohere's
``/v1/rerank``) cut a call of N rows into chunks of at most ``max_batch_size`` rows (a bulk
call into smaller ones, :func:`chunk_plan`); this module sends them:

1. chunks are admitted (:meth:`InferenceService.admit`) and queued
   (:meth:`InferenceService.submit`) **at most :data:`WINDOW` at a time**: the next one when
   the oldest is answered. A 2,048-input call therefore never fills the model's queue ahead
   of other clients: a request that arrives meanwhile waits for at most the chunks already
   queued (a batch or two) before its own rows run, while the instance always has the long
   call's next chunk ready (no idle gap between its batches);
2. the first chunk is routed (canary split, load on demand); the rest are pinned to the
   version that took it, so one answer never mixes versions;
3. every chunk carries the client's W3C ``traceparent``: each one's span joins the client's
   trace;
4. when a chunk is refused or fails, the call fails with that error: chunks not yet queued
   are never sent, queued ones are dropped when their batch forms (they are not run for
   nobody), and so are they when the client goes away;
5. a bulk call (the ``bulk`` lane) yields the event loop after each chunk it admits: the
   admission step (a text model's tokenisation) of its many small chunks never runs as one
   burst ahead of interactive requests that arrived meanwhile.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpuserve.config import ModelConfig
from gpuserve.engine.request import InferenceResponse
from gpuserve.service.inference import Admission, InferenceService, WireRequest
from gpuserve.service.lanes import LANE

#: Chunks of one call queued or running at once (see step 1 of the module docstring).
WINDOW = 2
#: Rows of a bulk call queued or running at once: its chunks are small
#: (``dynamic_batching.bulk_chunk_rows``), and the batcher needs several of alike length
#: to join into a full batch when no interactive request is about.
BULK_ROWS_IN_FLIGHT = 32


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """How a call is cut and sent.

    Attributes:
        rows: Most rows per chunk.
        window: Chunks queued or running at once.
    """

    rows: int
    window: int


def chunk_plan(configs: Sequence[ModelConfig], bulk: bool, window: int = WINDOW) -> ChunkPlan:
    """The plan of a call that versions of ``configs`` may serve (the default and the canary
    of its route): chunks of at most the smallest ``max_batch_size`` (1 without batching);
    a ``bulk`` call's chunks of at most ``dynamic_batching.bulk_chunk_rows`` (and
    ``bulk_max_batch_size``), more of them in flight (:data:`BULK_ROWS_IN_FLIGHT` rows)."""
    rows = max(1, min((c.max_batch_size for c in configs), default=1))
    if not bulk:
        return ChunkPlan(rows, window)
    for config in configs:
        db = config.dynamic_batching
        rows = min(rows, db.bulk_chunk_rows, db.bulk_max_batch_size or rows)
    return ChunkPlan(rows, max(window, BULK_ROWS_IN_FLIGHT // rows))


def route_plan(service: InferenceService, name: str, window: int = WINDOW) -> ChunkPlan:
    """The :func:`chunk_plan` of a call of model ``name`` naming no version: over the
    versions its route may pick (default and canary), for the call's lane."""
    model = service.manager.models.get(name)
    route = model.route if model is not None else None
    versions = [mv for mv in ((route.default, route.canary) if route is not None else ()) if mv]
    return chunk_plan([mv.config for mv in versions], LANE.get() == "bulk", window)


class CallState:
    """The state one call's chunks share: failing it drops its queued chunks (the
    ``probe`` each chunk's request carries)."""

    __slots__ = ("failed", "is_cancelled")

    def __init__(self, is_cancelled: Callable[[], bool] | None) -> None:
        self.failed = False
        self.is_cancelled = is_cancelled

    def probe(self) -> bool:
        """True once the call failed or its client has gone: its queued chunks are dropped."""
        if self.failed:
            return True
        return self.is_cancelled is not None and self.is_cancelled()


def _retrieve(future: asyncio.Future[InferenceResponse]) -> None:
    # A chunk of a call that already failed: its error is the call's, seen once.
    if not future.cancelled():
        future.exception()


async def serve_chunks(
    service: InferenceService,
    model: str,
    chunk: Callable[[int], WireRequest],
    count: int,
    state: CallState,
    window: int = WINDOW,
    traceparent: str | None = None,
    on_first: Callable[[Admission], None] | None = None,
) -> tuple[list[Admission], list[InferenceResponse]]:
    """Serve ``count`` chunks of one call (steps 1-4 of the module docstring).

    Args:
        service: The inference service every chunk is admitted through.
        model: The model (the first chunk loads it on demand).
        chunk: The wire request of chunk ``i`` (0 <= i < count), built when it is sent.
        count: Chunks of the call (at least 1).
        state: The call's shared state (its probe rides on every chunk).
        window: Chunks queued or running at once (at least 1).
        traceparent: The client's W3C trace context, or None.
        on_first: Called with the first chunk's admission as soon as it is queued (work
            that may overlap the batches, such as counting tokens), or None.

    Returns:
        The chunks' admissions and responses, both in chunk order.

    Raises:
        GpuserveError: why a chunk was refused or failed (counted once, where it happened).
    """
    window = max(1, window)
    bulk = LANE.get() == "bulk"
    admissions: list[Admission] = []
    responses: list[InferenceResponse | None] = [None] * count
    pending: deque[tuple[int, asyncio.Future[InferenceResponse]]] = deque()
    version: str | None = None
    sent = 0
    try:
        while sent < count or pending:
            while sent < count and len(pending) < window:
                wire = chunk(sent)
                admission = (  # the first loads the model on demand; the rest follow it
                    await service.admit_loaded(model, None, wire, state.probe, traceparent)
                    if sent == 0
                    else service.admit(model, version, wire, state.probe, traceparent)
                )
                version = admission.version
                admissions.append(admission)
                pending.append((sent, service.submit(admission)))
                sent += 1
                if sent == 1 and on_first is not None:
                    on_first(admission)
                if bulk:
                    await asyncio.sleep(0)  # step 5: interactive requests go in between
            index, future = pending.popleft()
            responses[index] = await future
    except BaseException:
        state.failed = True  # queued chunks are dropped when their batch forms
        for _, future in pending:
            future.add_done_callback(_retrieve)
        raise
    return admissions, [r for r in responses if r is not None]
