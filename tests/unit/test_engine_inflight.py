"""In-flight records and watchdog deadlines as data, on a fake clock."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gpuserve.engine.batch import Batch
from gpuserve.engine.inflight import InFlightTable


@dataclass(eq=False)
class Worker:
    name: str
    capacity: int = 2
    in_flight: int = 0


def test_records_number_batches_count_them_on_the_instance_and_keep_dispatch_order():
    table: InFlightTable[Worker] = InFlightTable(execution_timeout_s=2.0)
    a, b = Worker("a"), Worker("b")
    first, second, third = Batch([], 0), Batch([], 0), Batch([], 0)
    r1 = table.add(a, first, 1.0)
    table.add(b, second, 1.5)
    table.add(a, third, 2.0)
    assert [first.seq, second.seq, third.seq] == [1, 2, 3]
    assert (a.in_flight, b.in_flight, len(table)) == (2, 1, 3)
    assert r1.deadline_s == 3.0 and table.next_deadline() == 3.0
    assert table.pop(first) is r1 and a.in_flight == 1
    assert table.pop(first) is None and a.in_flight == 1  # once only
    assert table.next_deadline() == 3.5
    assert [r.batch for r in table] == [second, third]


def test_overdue_instances_and_taking_their_records():
    table: InFlightTable[Worker] = InFlightTable(execution_timeout_s=1.0)
    a, b = Worker("a"), Worker("b")
    batches = [Batch([], 0) for _ in range(3)]
    table.add(a, batches[0], 0.0)
    table.add(b, batches[1], 0.5)
    table.add(a, batches[2], 0.6)
    assert table.overdue(0.99) == []
    assert table.overdue(1.0) == [a]
    assert table.overdue(1.6) == [a, b]  # each instance once, oldest first
    taken = table.take(a)
    assert [r.batch for r in taken] == [batches[0], batches[2]]
    assert [r.batch for r in table] == [batches[1]]
    assert table.pop(batches[2]) is None  # a late result of a taken batch


def test_without_a_watchdog_nothing_is_ever_overdue():
    table: InFlightTable[Worker] = InFlightTable(execution_timeout_s=None)
    record = table.add(Worker("a"), Batch([], 0), 0.0)
    assert record.deadline_s == pytest.approx(float("inf"))
    assert table.overdue(1e9) == [] and table.next_deadline() is None
