"""Batches of decoupled requests: which queued streams one ``execute`` call serves together.

A decoupled model with ``dynamic_batching`` and ``max_batch_size > 0`` whose backend runs
several streams in one call (``stream_batch``: Triton's ``execute(requests)``, each request
with its own response sender) gets its queued requests grouped by the dynamic batcher's rules
(:class:`~gpuserve.engine.batcher.DynamicBatcher`: ``max_batch_size`` rows at most,
``max_queue_delay_us``, preferred sizes, priority levels, queue timeouts). Requests are never
stacked into one tensor: each keeps its own inputs and its own stream, so requests of any
shapes share a batch (one shape key for all).

:class:`StreamBatcher` is pure (no threads, no clock of its own; the executor passes ``now``,
seconds on its monotonic clock), generic over the executor's job type so the engine's
:class:`~gpuserve.engine.streaming.executor.StreamJob` and tests' fakes both fit::

    batcher.add(job, request, rows, now)     # admission (OverloadedError when full)
    ready = batcher.next_batch(now)          # when an instance is free: jobs or None
    batcher.expired(now) / batcher.gone()    # queue timeouts passed / clients gone
    batcher.next_wakeup(can_dispatch)        # when to look again without a new arrival
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from gpuserve.config import ModelConfig
from gpuserve.engine.batch import Pending
from gpuserve.engine.batcher import DynamicBatcher
from gpuserve.engine.request import InferenceRequest

J = TypeVar("J")

#: Every decoupled request of a batch keeps its own tensors: all share one shape key.
_ONE_SHAPE = "decoupled"


def batches_streams(config: ModelConfig) -> bool:
    """Whether ``config`` asks for batches of decoupled requests: decoupled, batching
    (``max_batch_size > 0``) and ``dynamic_batching`` given in its configuration (as in
    Triton, where a model without it runs one request per ``execute``)."""
    return (
        config.model_transaction_policy.decoupled
        and config.max_batch_size > 0
        and "dynamic_batching" in config.model_fields_set
    )


@dataclass(slots=True)
class StreamBatch(Generic[J]):
    """Jobs that one backend call serves, in queue order.

    Attributes:
        jobs: The jobs (at least one).
        rows: Sum of their requests' batch-dimension sizes (at most ``max_batch_size``).
    """

    jobs: list[J]
    rows: int


class StreamBatcher(Generic[J]):
    """The queue of one decoupled version's requests, batched (module docstring).

    Args:
        config: The version's configuration (``max_batch_size`` and ``dynamic_batching``).
    """

    def __init__(self, config: ModelConfig) -> None:
        db = config.dynamic_batching
        self._batcher = DynamicBatcher.for_config(config)
        self._default_level = db.default_priority_level
        self._jobs: dict[Pending, J] = {}  # Pending hashes by identity
        self._pending: dict[int, Pending] = {}  # id(job) -> its queue entry

    def __len__(self) -> int:
        """Queued jobs."""
        return len(self._batcher)

    def add(
        self,
        job: J,
        request: InferenceRequest,
        rows: int,
        now: float,
        deadline_s: float | None = None,
    ) -> None:
        """Queue ``job`` (its ``request`` of ``rows`` rows) at ``now``.

        Raises:
            OverloadedError: ``max_queue_size`` requests already wait.
        """
        level = request.priority or self._default_level
        item = Pending(
            request,
            rows,
            _ONE_SHAPE,
            now,
            deadline_s=deadline_s,
            priority=level,  # a level of the model: the runner's entry checked it
        )
        self._batcher.add(item)
        self._jobs[item] = job
        self._pending[id(job)] = item

    def remove(self, job: J) -> bool:
        """Take ``job`` out of the queue (its stream ended while it waited); False when it
        is not queued."""
        item = self._pending.pop(id(job), None)
        if item is None:
            return False
        self._jobs.pop(item, None)
        return self._batcher.remove(item)

    def _take(self, items: list[Pending]) -> list[J]:
        jobs = []
        for item in items:
            job = self._jobs.pop(item, None)
            if job is not None:
                self._pending.pop(id(job), None)
                jobs.append(job)
        return jobs

    def next_batch(self, now: float) -> StreamBatch[J] | None:
        """The next batch due at ``now`` (taken out of the queue), or None: wait."""
        batch = self._batcher.next_batch(now)
        if batch is None:
            return None
        jobs = self._take(batch.items)
        return StreamBatch(jobs, batch.rows) if jobs else None

    def expired(self, now: float) -> list[J]:
        """Jobs whose queue deadline passed by ``now``, taken out of the queue."""
        if not self._batcher.has_deadlines:
            return []
        return self._take(self._batcher.expire(now))

    def gone(self) -> list[J]:
        """Jobs found cancelled by their request's probe while batches formed (taken out)."""
        if not self._batcher.has_cancelled:
            return []
        return self._take(self._batcher.take_cancelled())

    def instance_freed(self, now: float, service_s: float, rows: int) -> None:
        """An instance's call of ``rows`` rows returned after ``service_s`` seconds (the
        batcher's regather window, ``early_dispatch``)."""
        self._batcher.instance_freed(now, service_s, rows)

    def next_wakeup(self, can_dispatch: bool) -> float | None:
        """When :meth:`next_batch` or :meth:`expired` could change without a new arrival
        (seconds, the caller's clock), or None."""
        return self._batcher.next_wakeup(can_dispatch)

    def drain(self) -> list[J]:
        """Every queued job, taken out (unload)."""
        return self._take(self._batcher.drain())
