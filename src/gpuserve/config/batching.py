"""The ``dynamic_batching`` section of a model's config (Triton's), with its adaptive part
and the bulk lane's settings."""

from __future__ import annotations

from pydantic import Field, model_validator

from gpuserve.config.base import Strict as _Strict


class AdaptiveBatchingConfig(_Strict):
    """Adaptive batching (``dynamic_batching.adaptive``): the batcher sets its own queue delay
    and batch-size cap from measured batch latency to keep p99 latency near the target.

    Attributes:
        target_p99_ms: Latency target, milliseconds. ``max_queue_delay_us`` is then only the
            delay used until the first batch has been measured.
    """

    target_p99_ms: float = Field(gt=0, le=600_000)


class DynamicBatchingConfig(_Strict):
    """How requests are merged into batches (Triton's ``dynamic_batching``).

    Attributes:
        max_queue_delay_us: Longest a request waits for others to join its batch,
            microseconds. 0 sends whatever is queued as soon as an instance is free, which
            still batches under load (requests gather while the instance is busy).
        preferred_batch_sizes: Batch sizes (rows) to send at once when reachable, without
            waiting out ``max_queue_delay_us``.
        max_queue_size: Most requests held in the queue; one more is refused with 429.
        default_timeout_us: Queue timeout of a request that names none, microseconds;
            0 means no timeout. A request past it is refused with 503 and never run.
        priority_levels: Number of priority levels; level 1 is served first.
        default_priority_level: Level of a request that names none.
        early_dispatch: Send a batch before ``max_queue_delay_us`` runs out once as many rows
            are queued as the previous batch carried (under a steady load that is all that is
            coming: waiting longer only idles the instance); and when an instance frees up,
            let a batch regather to that size for up to the smaller of the delay and a tenth
            of the finished batch's time; for one CPU instance whose threads take every
            core, up to the tenth alone once answered clients are seen coming back at once,
            a closed loop (see :mod:`gpuserve.engine.batcher` and
            :mod:`gpuserve.engine.regather`).
        adaptive: Adaptive batching settings; None (default) keeps the fixed delay.
        max_batch_tokens: Most padded tokens (rows x the longest row's tokens) in one batch of
            a model whose requests carry a cost (text models with an admission step); such
            batches also group requests of similar length (see
            :mod:`gpuserve.engine.lengths`). None (default): 512 when every instance is on a
            CPU, 16384 when one is on a GPU. Rows stay bounded by ``max_batch_size``.
        bulk_max_queue_size: Most requests of the bulk lane held in the queue (requests
            marked bulk, and every request of a batch job); one more is refused with 429.
            Bulk requests do not count against ``max_queue_size``.
        bulk_max_batch_size: Most bulk rows in one batch. None (default):
            ``max_batch_size``.
        bulk_chunk_rows: Rows of each chunk a bulk call (marked bulk, or a batch job's line)
            is cut into, at most ``bulk_max_batch_size``. A chunk is the smallest piece of
            bulk work a batch takes, so an interactive request that arrives while a bulk-led
            batch runs waits for at least one chunk's compute; when no interactive request is
            about, the batcher joins many chunks into full batches.
        bulk_max_compute_us: While interactive requests are about (one arrived within
            ``bulk_quiet_us``), the most estimated compute of a batch led by a bulk request
            (its first chunk runs whatever its size), and twice the most that bulk rows may
            add to a batch led by an interactive one, microseconds. Estimated from the
            model's measured batch times (a fixed cost per batch plus a cost per padded
            token, or per row). 0: bulk batches of one chunk and no bulk rows in interactive
            batches.
        bulk_quiet_us: How long after the last interactive arrival ``bulk_max_compute_us``
            holds, microseconds; after that, batches led by bulk requests take the whole row
            and token budget. 0: never.
    """

    max_queue_delay_us: int = Field(default=0, ge=0, le=60_000_000)
    preferred_batch_sizes: list[int] = Field(default_factory=list)
    max_queue_size: int = Field(default=1024, ge=1)
    default_timeout_us: int = Field(default=0, ge=0)
    priority_levels: int = Field(default=1, ge=1, le=16)
    default_priority_level: int = Field(default=1, ge=1)
    early_dispatch: bool = True
    adaptive: AdaptiveBatchingConfig | None = None
    max_batch_tokens: int | None = Field(default=None, ge=1)
    bulk_max_queue_size: int = Field(default=4096, ge=1)
    bulk_max_batch_size: int | None = Field(default=None, ge=1)
    bulk_chunk_rows: int = Field(default=1, ge=1)
    bulk_max_compute_us: int = Field(default=5000, ge=0, le=60_000_000)
    bulk_quiet_us: int = Field(default=1_000_000, ge=0, le=3_600_000_000)

    @model_validator(mode="after")
    def _check(self) -> DynamicBatchingConfig:
        if self.default_priority_level > self.priority_levels:
            raise ValueError(
                f"default_priority_level={self.default_priority_level} exceeds "
                f"priority_levels={self.priority_levels}"
            )
        for size in self.preferred_batch_sizes:
            if size < 1:
                raise ValueError(f"preferred_batch_sizes must be >= 1, got {size}")
        return self


__all__ = ["AdaptiveBatchingConfig", "DynamicBatchingConfig"]
