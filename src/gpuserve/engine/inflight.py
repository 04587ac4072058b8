"""In-flight bookkeeping and watchdog deadlines as data: which batch runs on which instance,
since when, and until when it may run.

Pure and synchronous, like the rest of the scheduling core (``scheduling.py``): times are
seconds on the caller's monotonic clock. One record per dispatched batch, keyed by the batch's
dispatch number (``Batch.seq``, given here), kept in dispatch order. Every deadline is the
dispatch time plus the same ``execution_timeout_s``, so dispatch order is deadline order and the
oldest record holds the earliest deadline (the clock never goes back).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from gpuserve.engine.batch import Batch


class Worker(Protocol):
    """What the scheduling core needs of an instance.

    Attributes:
        name: For logs and error messages, e.g. ``text_embedding:1#0``.
        capacity: Most batches it may hold at once (its pipeline depth).
        in_flight: Batches dispatched to it and not yet completed; counted here.
    """

    name: str
    capacity: int
    in_flight: int


W = TypeVar("W", bound=Worker)


@dataclass(slots=True, eq=False)
class InFlight(Generic[W]):
    """A batch dispatched to an instance and not yet completed: the dispatch decision and the
    watchdog's record.

    Attributes:
        batch: The batch (``batch.seq`` identifies the record).
        instance: The instance it went to.
        dispatched_s: When, seconds.
        deadline_s: When the instance counts as hung if the batch has not completed, seconds;
            ``inf`` without a watchdog.
    """

    batch: Batch
    instance: W
    dispatched_s: float
    deadline_s: float


class InFlightTable(Generic[W]):
    """The batches running on instances, oldest first.

    Args:
        execution_timeout_s: Seconds a batch may run before its instance counts as hung; None
            for no watchdog.
    """

    def __init__(self, execution_timeout_s: float | None) -> None:
        self.execution_timeout_s = execution_timeout_s
        self._records: dict[int, InFlight[W]] = {}  # by batch.seq, in dispatch order
        self._seq = 0

    def __len__(self) -> int:
        """Batches in flight."""
        return len(self._records)

    def __iter__(self) -> Iterator[InFlight[W]]:
        """The records, oldest (earliest deadline) first."""
        return iter(self._records.values())

    def add(self, instance: W, batch: Batch, now: float) -> InFlight[W]:
        """Record ``batch`` dispatched to ``instance`` at ``now``: number the batch, count it on
        the instance, and set its deadline."""
        instance.in_flight += 1
        self._seq += 1
        batch.seq = seq = self._seq
        timeout_s = self.execution_timeout_s
        record = InFlight(batch, instance, now, now + timeout_s if timeout_s else float("inf"))
        self._records[seq] = record
        return record

    def pop(self, batch: Batch) -> InFlight[W] | None:
        """The record of ``batch``, which completed, removed; its instance counts one batch
        less. None when there is none (its instance was declared hung: a late result)."""
        record = self._records.pop(batch.seq, None)
        if record is not None:
            record.instance.in_flight -= 1
        return record

    def next_deadline(self) -> float | None:
        """The earliest watchdog deadline, seconds, or None (no watchdog, or nothing runs)."""
        if self.execution_timeout_s is None or not self._records:
            return None
        return next(iter(self._records.values())).deadline_s

    def overdue(self, now: float) -> list[W]:
        """Instances holding a batch whose deadline is at or before ``now``, oldest first."""
        if self.execution_timeout_s is None:
            return []
        stuck: list[W] = []
        for record in self._records.values():  # deadline order
            if record.deadline_s > now:
                break
            if record.instance not in stuck:
                stuck.append(record.instance)
        return stuck

    def take(self, instance: W) -> list[InFlight[W]]:
        """Remove and return every record of ``instance`` (declared hung: its results will no
        longer be accepted), oldest first."""
        taken = [record for record in self._records.values() if record.instance is instance]
        for record in taken:
            del self._records[record.batch.seq]
        return taken
