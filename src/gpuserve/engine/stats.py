"""Statistics the engine records, on one monotonic clock, for the statistics API and metrics.

The engine fills :class:`ModelStats` from the event loop thread only, so no locks are needed.
Listeners (the metrics layer) receive :class:`BatchStats` and :class:`RequestStats` events and
turn them into Prometheus series; the engine itself never imports prometheus_client.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuserve.engine.request import Lane
    from gpuserve.engine.response_stats import ResponseStats


@dataclass(slots=True)
class Duration:
    """A count and a cumulative duration in nanoseconds (Triton's ``StatisticDuration``)."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        """Add ``count`` events that took ``seconds`` in all (seconds, float)."""
        self.count += count
        self.ns += int(seconds * 1e9)

    def as_dict(self) -> dict[str, int]:
        """``{"count": events, "ns": nanoseconds}``, as the statistics extension writes it."""
        return {"count": self.count, "ns": self.ns}


@dataclass(slots=True)
class BatchStats:
    """One executed batch.

    Attributes:
        model / version: The model version that ran it.
        batch_size: Rows in the batch (the sum of its requests' rows).
        requests: Requests in the batch.
        preprocess_s / forward_s / postprocess_s: Stage durations, seconds.
        ok: False when the batch as a whole failed (its requests may be retried in halves).
        tokens: Real tokens of its requests (0 when they carry no cost).
        padded_tokens: Tokens once padded to its longest row (0 when they carry no cost).
    """

    model: str
    version: str
    batch_size: int
    requests: int
    preprocess_s: float
    forward_s: float
    postprocess_s: float
    ok: bool
    tokens: int = 0
    padded_tokens: int = 0


@dataclass(slots=True)
class RequestStats:
    """One finished request (or one refused at admission, with ``rows`` 0).

    Attributes:
        model / version: The model version that answered it.
        rows: Its batch-dimension size.
        queue_s: Admission to the start of its batch (all of its time if it never ran), s.
        compute_s: Its batch's execution time, seconds (0 if it never ran).
        total_s: Admission to its answer, seconds.
        reason: None on success, else the error's ``reason`` (``timeout``, ``cancelled``...).
        lane: The lane of the queue it waited in: ``interactive`` or ``bulk``.
    """

    model: str
    version: str
    rows: int
    queue_s: float
    compute_s: float
    total_s: float
    reason: str | None
    lane: Lane = "interactive"


@dataclass(slots=True)
class _BatchSizeStats:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


StatsListener = Callable[[BatchStats | RequestStats], None]


def _response_stats() -> ResponseStats:
    from gpuserve.engine.response_stats import ResponseStats  # it imports Duration from here

    return ResponseStats()


@dataclass(slots=True)
class StepStats:
    """Cumulative statistics of one step of an ensemble version.

    Attributes:
        index / model: The step and its model.
        success: Step requests that succeeded, and their time from submission to answer.
        fail: Step requests that failed (or timed out), and their time.
        queue / compute: Of the successes: time queued in the step model's batcher, and its
            batch's execution time.
        tensor_inputs: Inputs of its step requests handed over as device tensors (no host
            round trip).
        host_copies: Inputs that arrived as tensors but had to be moved to the host for it
            (its model stopped taking tensors on that device since the producer ran).
    """

    index: int
    model: str
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute: Duration = field(default_factory=Duration)
    tensor_inputs: int = 0
    host_copies: int = 0

    def as_dict(self) -> dict[str, object]:
        """JSON form, in the shape of the statistics extension's durations."""
        return {
            "step": self.index,
            "model": self.model,
            "success": self.success.as_dict(),
            "fail": self.fail.as_dict(),
            "queue": self.queue.as_dict(),
            "compute": self.compute.as_dict(),
            "tensor_inputs": self.tensor_inputs,
            "host_copies": self.host_copies,
        }


@dataclass
class ModelStats:
    """Cumulative statistics of one model version, shaped like Triton's statistics extension.

    ``inference_count`` counts rows that succeeded; ``execution_count`` counts batches run.
    ``fail_reasons`` counts failures by reason (invalid, rejected, timeout, backend_error...).
    ``ensemble_steps`` is an ensemble version's per-step record (None for every other
    model): its ``execution_count`` counts the ensemble requests run, the steps' own
    executions count in their models' statistics.
    """

    name: str
    version: str
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    fail_reasons: Counter[str] = field(default_factory=Counter)
    batch_sizes: dict[int, _BatchSizeStats] = field(default_factory=dict)
    listeners: list[StatsListener] = field(default_factory=list)
    #: Per response index of decoupled streams (Triton's ``response_stats``).
    responses: ResponseStats = field(default_factory=_response_stats)
    ensemble_steps: list[StepStats] | None = None

    def record_batch(self, event: BatchStats) -> None:
        """Count one executed batch (``event.batch_size`` rows) and tell the listeners."""
        self.execution_count += 1
        self.compute_input.add(event.preprocess_s)
        self.compute_infer.add(event.forward_s)
        self.compute_output.add(event.postprocess_s)
        per_size = self.batch_sizes.get(event.batch_size)
        if per_size is None:
            per_size = self.batch_sizes[event.batch_size] = _BatchSizeStats()
        per_size.compute_input.add(event.preprocess_s)
        per_size.compute_infer.add(event.forward_s)
        per_size.compute_output.add(event.postprocess_s)
        for listener in self.listeners:
            listener(event)

    def record_request(self, event: RequestStats) -> None:
        """Count one finished request: its rows as inferences and its total and queue time on
        success, its total time and reason on failure; then tell the listeners."""
        if event.reason is None:
            self.inference_count += event.rows
            self.success.add(event.total_s)
            self.queue.add(event.queue_s)
            self.last_inference_ms = int(time.time() * 1000)
        else:
            self.fail.add(event.total_s)
            self.fail_reasons[event.reason] += 1
        for listener in self.listeners:
            listener(event)

    def as_dict(self) -> dict[str, object]:
        """The V2 statistics-extension JSON object for this version."""
        return {
            "name": self.name,
            "version": self.version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": self.success.as_dict(),
                "fail": self.fail.as_dict(),
                "queue": self.queue.as_dict(),
                "compute_input": self.compute_input.as_dict(),
                "compute_infer": self.compute_infer.as_dict(),
                "compute_output": self.compute_output.as_dict(),
            },
            "failure_reasons": dict(self.fail_reasons),
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": s.compute_input.as_dict(),
                    "compute_infer": s.compute_infer.as_dict(),
                    "compute_output": s.compute_output.as_dict(),
                }
                for size, s in sorted(self.batch_sizes.items())
            ],
            "response_stats": self.responses.as_dict(),
        } | (
            {}
            if self.ensemble_steps is None
            else {"ensemble_steps": [s.as_dict() for s in self.ensemble_steps]}
        )
