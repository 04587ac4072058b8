"""Requests a batch job sends are bulk work: :func:`mark_bulk` is the one place that says so.

Every request of a batch line is decoded through a :class:`BulkWire` (embeddings chunks,
generation sequences and rerank chunks alike), which decodes it as a live call would and then
hands the request and the routed version's configuration to :func:`mark_bulk`, which puts it
in the bulk lane: it takes only the capacity interactive traffic leaves
(:mod:`gpuserve.engine.batcher`, and the generation scheduler for generative models).
"""

from __future__ import annotations

from collections.abc import Sequence

from gpuserve.config import ModelConfig
from gpuserve.engine.request import InferenceRequest
from gpuserve.protocol.openai_codec import EmbeddingsBody
from gpuserve.service.inference import WireRequest


def mark_bulk(request: InferenceRequest, config: ModelConfig) -> None:
    """Mark ``request`` (decoded for a version with ``config``) as bulk work.

    Called once per request a batch job sends, after decoding, before admission queues it.
    """
    request.lane = "bulk"


class BulkWire:
    """A front end's wire request whose decoded request is marked bulk (a
    :class:`~gpuserve.service.inference.WireRequest`).

    Args:
        wire: The request as a live call would send it.
    """

    __slots__ = ("wire",)

    def __init__(self, wire: WireRequest) -> None:
        self.wire = wire

    def request_id(self) -> str | None:
        """The wrapped request's id (the canary split is by it)."""
        return self.wire.request_id()

    def decode(
        self, config: ModelConfig, model_name: str, model_version: str | None
    ) -> InferenceRequest:
        """Decode as the wrapped request does, then :func:`mark_bulk`."""
        request = self.wire.decode(config, model_name, model_version)
        mark_bulk(request, config)
        return request


class BulkEmbeddings:
    """An embeddings call whose chunks are bulk (the embeddings service's ``EmbeddingCall``).

    Args:
        body: The decoded ``/v1/embeddings`` body of a batch line.
    """

    __slots__ = ("body",)

    def __init__(self, body: EmbeddingsBody) -> None:
        self.body = body

    @property
    def model(self) -> str:
        return self.body.model

    @property
    def texts(self) -> Sequence[str] | None:
        return self.body.texts

    @property
    def token_ids(self) -> Sequence[Sequence[int]] | None:
        return self.body.token_ids

    @property
    def dimensions(self) -> int | None:
        return self.body.dimensions

    def wire(self, rows: Sequence[int]) -> WireRequest:
        """The chunk of inputs ``rows``, marked bulk."""
        return BulkWire(self.body.wire(rows))


def bulk_wires(wires: Sequence[WireRequest]) -> list[WireRequest]:
    """Each of ``wires`` marked bulk (the sequences of a generation call)."""
    return [BulkWire(wire) for wire in wires]
