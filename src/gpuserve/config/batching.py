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
            of the finished batch's time (see :mod:`gpuserve.engine.batcher`).
        adaptive: Adaptive batching settings; None (default) keeps the fixed delay.
        max_batch_tokens: Most padded tokens (rows x the longest row's tokens) in one batch of
            a model whose requests carry a cost (text models with an admission step); such
            batches also group requests of similar length (see
            :mod:`gpuserve.engine.lengths`). None (default): 512 when every instance is on a
            CPU, 16384 when one is on a GPU. Rows stay bounded by ``max_batch_size``.
        bulk_max_queue_size: Most requests of the bulk lane held in the queue (requests
            marked bulk, and every request of a batch job); one more is refused with 429.
            Bulk requests do not count against ``max_queue_size``.
        bulk_max_batch_size: Most rows of a batch led by a bulk request (and of each chunk a
            bulk call is cut into). An interactive request that arrives while one runs waits
            for it to finish: smaller bulk batches keep that wait short, larger ones run bulk
            work more efficiently. None (default): ``max_batch_size``.
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
