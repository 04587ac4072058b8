"""One batch line through the same in-process services a live call uses (no HTTP loopback).

=======================  =========================================================================
endpoint                 served by
=======================  =========================================================================
/v1/embeddings           the OpenAI API's embeddings service (``parse_embeddings``, ``embed``,
                         ``encode_embeddings``)
/v1/chat/completions,    the generation service (``parse_generation``, ``open``), the answer
/v1/completions          collected and encoded as the HTTP endpoint does (``whole_answer``)
/v1/rerank               the retrieval API's rerank (``parse_cohere_rerank``, ``rerank_scores``,
                         ``encode_cohere_rerank``)
=======================  =========================================================================

Every request a line sends is marked bulk (:mod:`gpuserve.server.batches.bulk`). A line's
answer is the status and JSON body a live call would have got: 200 and its answer, or
OpenAI's error body with its status (the same table as the ``/v1`` endpoints).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuserve.errors import (
    GpuserveError,
    InvalidInputError,
    ModelNotReadyError,
    OverloadedError,
    UnavailableError,
)
from gpuserve.protocol import retrieval_codec
from gpuserve.protocol.limits import RequestLimits
from gpuserve.protocol.openai_codec import encode_embeddings, parse_embeddings
from gpuserve.protocol.openai_generate import parse_generation
from gpuserve.server.batches.bulk import BulkEmbeddings, BulkWire, bulk_wires
from gpuserve.server.http.openai_errors import error_answer
from gpuserve.server.http.openai_generate import whole_answer
from gpuserve.server.http.retrieval_api import RetrievalApi
from gpuserve.server.security import Redactor
from gpuserve.service.apis.embeddings import EmbeddingsService
from gpuserve.service.apis.generation import GenerationService
from gpuserve.service.lanes import LANE

Probe = Callable[[], bool]

#: Refusals that say "later", not "never": a line refused so is tried again.
TRANSIENT: tuple[type[GpuserveError], ...] = (OverloadedError, ModelNotReadyError, UnavailableError)


@dataclass(frozen=True, slots=True)
class LineAnswer:
    """What one line's call answered.

    Attributes:
        status: HTTP status a live call would have got.
        body: Its JSON body (bytes of one JSON value).
        transient: A refusal that may pass (queue full, model loading, shutting down):
            the line is worth trying again rather than recording.
    """

    status: int
    body: bytes
    transient: bool = False

    @property
    def ok(self) -> bool:
        """Whether the call succeeded (2xx)."""
        return 200 <= self.status < 300


class LineRunner:
    """Runs batch lines on the server's services.

    Args:
        embeddings: The OpenAI API's embeddings service.
        generation: The generation service.
        retrieval: The retrieval API (rerank).
        limits: Server-wide tensor limits (embeddings bodies).
        redactor: Takes file paths out of error messages.
    """

    def __init__(
        self,
        embeddings: EmbeddingsService,
        generation: GenerationService,
        retrieval: RetrievalApi,
        limits: RequestLimits,
        redactor: Redactor,
    ) -> None:
        self.embeddings = embeddings
        self.generation = generation
        self.retrieval = retrieval
        self.limits = limits
        self.redactor = redactor

    async def run(self, endpoint: str, body: dict[str, Any], is_gone: Probe) -> LineAnswer:
        """Send one line's ``body`` to ``endpoint``; never raises but for cancellation.

        Args:
            endpoint: One of the Batch API's endpoints.
            body: The line's request body.
            is_gone: True once nobody waits for the answer (the batch stops): queued requests
                are dropped, sequences cancelled.
        """
        lane = LANE.set("bulk")  # short chunks, in the bulk lane (gpuserve.service.lanes)
        try:
            if endpoint == "/v1/embeddings":
                payload = await self._embeddings(body, is_gone)
            elif endpoint == "/v1/chat/completions":
                payload = await self._generation(body, "chat", is_gone)
            elif endpoint == "/v1/completions":
                payload = await self._generation(body, "completion", is_gone)
            elif endpoint == "/v1/rerank":
                payload = await self._rerank(body, is_gone)
            else:  # the wire refuses other endpoints when the batch is created
                raise InvalidInputError(f"endpoint {endpoint} is not served in batches")
        except Exception as err:
            answer = error_answer(err)
            redact = isinstance(err, GpuserveError)
            message = self.redactor.text(answer.message) if redact else None
            return LineAnswer(answer.status, answer.body(message), isinstance(err, TRANSIENT))
        finally:
            LANE.reset(lane)
        return LineAnswer(200, payload)

    async def _embeddings(self, document: dict[str, Any], is_gone: Probe) -> bytes:
        body = parse_embeddings(document, self.limits)
        result = await self.embeddings.embed(BulkEmbeddings(body), is_gone)
        return encode_embeddings(result, body.encoding_format)

    async def _generation(self, document: dict[str, Any], kind: Any, is_gone: Probe) -> bytes:
        body = parse_generation(document, kind)
        if body.stream:
            raise InvalidInputError("'stream' is not allowed in a batch: the answer is a line")
        call = await self.generation.open(body.model, bulk_wires(body.wires()), is_gone)
        try:
            return await whole_answer(body, call, is_gone)
        finally:
            call.cancel()  # a no-op for finished sequences

    async def _rerank(self, document: dict[str, Any], is_gone: Probe) -> bytes:
        call = retrieval_codec.parse_cohere_rerank(document)
        scores, result = await self.retrieval.rerank_scores(call, is_gone, BulkWire)
        return retrieval_codec.encode_cohere_rerank(call, scores, str(uuid.uuid4()), result.tokens)
