"""The engine's units of work: a queued request, a batch of them, and what an instance reports;
and the protocol of the queues that form batches (:class:`Batcher`).

These are plain typed records passed between the scheduling core (event-loop thread) and the
instances (their own threads); none of them does anything. Every time is seconds on the
scheduler's monotonic clock except :class:`BatchResult`'s, which the instance threads take from
``time.monotonic``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from gpuserve.backends.row_context import RowContext
from gpuserve.backends.streaming import ResponseSink
from gpuserve.engine.request import InferenceRequest, InferenceResponse
from gpuserve.errors import GpuserveError

#: Output name -> array, as a backend's ``postprocess`` returns them (batch dimension first
#: when the model batches).
Outputs = dict[str, np.ndarray]


@dataclass(slots=True, eq=False)
class Pending:
    """One admitted request, from admission until it is answered (the scheduler's handle on it).

    Compared and hashed by identity, so a driver can map it to its own waiter (a future).

    Attributes:
        request: The validated request.
        rows: Its batch-dimension size, counted once at admission (1 for models without
            batching); batch assembly splits outputs by it.
        shape_key: Hashable description of its non-batch input shapes; only equal keys batch.
        arrival_s: Admission time, seconds.
        deadline_s: Queue deadline, seconds, or None.
        priority: Level, 1 = served first.
        queued: True while in the batcher's queue.
        outcome: Set when the request is finished: its response, or the error it failed with.
        length: Its longest row's length (tokens) from the model's admission step, 0 when the
            request carries no cost; the batcher groups requests of similar length by it.
        tokens: Sum of its rows' lengths (0 without a cost).
        cancelled: Its caller went away after its batch formed (it runs, or ran, for
            nobody): it is counted ``cancelled`` whatever its batch gives it, and not retried.
        started_s: When its batch was dispatched to an instance, seconds (0.0 before; set
            for a decoupled model's requests, whose stream outlives the batch's result).
        sink: Where a decoupled model's responses to it go (its stream's bounded buffer);
            None for a request answered by one response. The instance hands it to the
            backend's ``stream`` / ``stream_batch`` instead of stacking its inputs.
    """

    request: InferenceRequest
    rows: int
    shape_key: Hashable
    arrival_s: float
    deadline_s: float | None = None
    priority: int = 1
    queued: bool = False
    outcome: InferenceResponse | GpuserveError | None = None
    length: int = 0
    tokens: int = 0
    cancelled: bool = False
    started_s: float = 0.0
    sink: ResponseSink | None = field(default=None, repr=False)


@dataclass(slots=True)
class Batch:
    """Requests that run together, in order.

    Attributes:
        items: The requests; their inputs are stacked in this order along the batch dimension.
        rows: Sum of the items' rows.
        formed_s: When the batch was formed, seconds.
        seq: Dispatch number, set by the scheduling core when the batch goes to an instance
            (unique per core; 0 before dispatch). The core finds its in-flight record by it.
        tokens: Real tokens of its requests (sum of ``Pending.tokens``; 0 without costs).
        padded_tokens: Tokens once padded to its longest row, ``rows * max(length)`` (0
            without costs).
    """

    items: list[Pending]
    rows: int
    formed_s: float = 0.0
    seq: int = 0
    tokens: int = 0
    padded_tokens: int = 0

    @classmethod
    def of(cls, items: list[Pending], formed_s: float) -> Batch:
        """A batch of ``items`` with its rows and token counts summed from them."""
        rows = sum(item.rows for item in items)
        longest = max((item.length for item in items), default=0)
        tokens = sum(item.tokens for item in items)
        return cls(items, rows, formed_s, tokens=tokens, padded_tokens=rows * longest)


@dataclass(slots=True)
class BatchResult:
    """What an instance reports for one batch.

    Attributes:
        batch: The batch that ran.
        results: Per item of ``batch.items``: its outputs or its own error; empty when the whole
            batch failed (see ``error``).
        error: Set when the batch as a whole failed.
        retryable: Whether running smaller parts of the batch could succeed (False for a model
            that returns the wrong outputs or rows: that is the model's bug on any batch).
        started_s / finished_s: Monotonic seconds, first stage start and last stage end.
        preprocess_s / forward_s / postprocess_s: Stage durations, seconds.
        prepared: What the backend's ``preprocess`` returned, until ``forward`` took it.
        raw: What the backend's ``forward`` returned, until ``postprocess`` took it.
        rows: The batch's row contexts (one per row, built on first use), set when its
            stages start (None before).
    """

    batch: Batch
    results: list[Outputs | GpuserveError] = field(default_factory=list)
    error: GpuserveError | None = None
    retryable: bool = True
    started_s: float = 0.0
    finished_s: float = 0.0
    preprocess_s: float = 0.0
    forward_s: float = 0.0
    postprocess_s: float = 0.0
    prepared: object = None
    raw: object = None
    rows: Sequence[RowContext] | None = None


class Batcher(Protocol):
    """The queue and batch-formation policy a scheduling core drives (one per version).

    Implemented by :class:`DynamicBatcher` and by
    :class:`~gpuserve.engine.sequence.batcher.SequenceBatcher`; each is built complete from the
    version's config and capabilities (token budget, padding, unpadded), nothing written
    afterwards but the adaptive policy's two live controls (``max_queue_delay_s``,
    ``row_cap``). Times are seconds on the core's clock.
    """

    max_queue_delay_s: float
    row_cap: int | None
    #: Whether a batch may be led by a bulk request now (an idle instance takes it).
    bulk_may_lead: bool

    def __len__(self) -> int:
        """Requests queued."""
        ...

    def lane_queued(self) -> tuple[int, int]:
        """Rows queued in each lane: (interactive, bulk)."""
        ...

    @property
    def queued_rows(self) -> int:
        """Rows of the queued requests."""
        ...

    @property
    def has_deadlines(self) -> bool:
        """Whether a queued request has a queue deadline (``expire`` has work)."""
        ...

    @property
    def has_cancelled(self) -> bool:
        """Whether requests left the queue as cancelled (``take_cancelled`` has work)."""
        ...

    def add(self, item: Pending) -> None:
        """Queue ``item``; raises OverloadedError (queue full) or InvalidInputError."""
        ...

    def remove(self, item: Pending) -> bool:
        """Take a queued ``item`` out (its caller went away); False when not queued."""
        ...

    def expire(self, now: float) -> list[Pending]:
        """Take out the queued requests whose deadline passed."""
        ...

    def take_cancelled(self) -> list[Pending]:
        """The requests found cancelled (client gone) since the last call."""
        ...

    def next_batch(self, now: float) -> Batch | None:
        """The next batch due at ``now``, or None."""
        ...

    def next_wakeup(self, can_dispatch: bool) -> float | None:
        """When to ask again if nothing happens (None: not before the next event)."""
        ...

    def instance_freed(self, now: float, service_s: float, rows: int) -> None:
        """A batch of ``rows`` finished after ``service_s`` seconds."""
        ...

    def ran(self, result: BatchResult, now: float) -> None:
        """A batch finished (or failed): settle what the batcher keeps per request."""
        ...

    def drain(self) -> list[Pending]:
        """Take out every queued request (the version unloads)."""
        ...
