"""Statistics of an ensemble version: the whole, as any model's, and each step's.

The step models' own statistics count the steps' executions (each step runs on its model's
scheduler); these add, per step of the ensemble, how its step requests fared as the ensemble
saw them (submission to answer, and the step model's queue and compute time).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuserve.engine.stats import Duration, ModelStats


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
class EnsembleStats(ModelStats):
    """An ensemble version's statistics: the whole (as any model's) and each step's.

    ``execution_count`` counts the ensemble requests run; the steps' own executions count in
    their models' statistics. The JSON form adds ``ensemble_steps``.
    """

    steps: list[StepStats] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        """The statistics-extension object, plus ``ensemble_steps`` (one per step)."""
        out = ModelStats.as_dict(self)
        out["ensemble_steps"] = [s.as_dict() for s in self.steps]
        return out
