"""gpuserve.backends.call_scope with the in-process caller: a call made while serving a
request that is itself a call passes that request's deadline on, and is refused at once
when it has passed (what ends a cycle of models after its first timeout); the scope is the
running batch's row contexts, one per thread, with the caller and the trace calls use."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from gpuserve.backends import call_scope
from gpuserve.backends.row_context import RowContext
from gpuserve.engine.calls import InProcessCaller
from gpuserve.engine.request import InferenceResponse
from gpuserve.errors import RequestTimeoutError


class Recording(InProcessCaller):
    """The caller with ``submit`` recorded and answered at once (no router, no loop)."""

    def __init__(self) -> None:
        super().__init__(router=None, loop=None, caller="a")  # type: ignore[arg-type]
        self.awaited: list[float | None] = []

    def submit(self, model, inputs, **options):  # type: ignore[override]
        self.awaited.append(options.get("awaited_until"))
        done: concurrent.futures.Future[InferenceResponse] = concurrent.futures.Future()
        done.set_result(InferenceResponse(model_name=model, model_version="1", id=None, outputs={}))
        return done


def rows(*until: float | None) -> list[RowContext]:
    return [RowContext(awaited_until=u) for u in until]


def test_the_scope_is_the_latest_deadline_or_none():
    call_scope.enter_batch(rows(5.0, 9.0, 7.0))
    assert call_scope.awaited_until() == 9.0
    call_scope.enter_batch(rows(5.0, None))  # a client's request in the batch: no bound
    assert call_scope.awaited_until() is None
    call_scope.enter_batch(rows(3.0))
    seen: list[float | None] = []
    other = threading.Thread(target=lambda: seen.append(call_scope.awaited_until()))
    other.start()
    other.join()
    assert seen == [None]  # each thread runs its own batch
    call_scope.leave_batch()
    assert call_scope.awaited_until() is None and call_scope.rows() == ()
    assert call_scope.within(call_scope.Scope.awaited(4.0), call_scope.awaited_until) == 4.0
    assert call_scope.awaited_until() is None  # restored


def test_one_scope_carries_the_rows_the_caller_and_the_trace():
    traced = object()
    call_scope.enter_batch([RowContext("a"), RowContext("b", trace=traced), RowContext("c")])
    with call_scope.with_caller("the caller"):
        assert call_scope.caller() == "the caller"
        assert call_scope.current_trace() is traced
        scope = call_scope.current()
        seen: list[object] = []

        def worker() -> None:  # a call handed to a worker thread carries the scope
            seen.extend([call_scope.caller(), call_scope.current_trace(), len(call_scope.rows())])

        other = threading.Thread(target=call_scope.within, args=(scope, worker))
        other.start()
        other.join()
        assert seen == ["the caller", traced, 3]
    assert call_scope.caller() is None  # restored after the block
    call_scope.leave_batch()
    assert call_scope.current_trace() is None


def test_a_call_outside_any_call_waits_its_own_timeout():
    caller = Recording()
    before = time.monotonic()
    caller("b", {}, timeout_s=0.3)
    [until] = caller.awaited
    assert until is not None and before + 0.3 <= until <= time.monotonic() + 0.3


def test_a_call_serving_a_call_passes_its_deadline_on():
    caller = Recording()
    outer = time.monotonic() + 0.1
    call_scope.within(call_scope.Scope.awaited(outer), lambda: caller("b", {}, timeout_s=30.0))
    assert caller.awaited == [pytest.approx(outer, abs=0.01)]


def test_a_call_serving_a_request_nobody_awaits_is_refused_at_once():
    caller = Recording()
    with pytest.raises(RequestTimeoutError, match="no longer awaited") as err:
        call_scope.within(call_scope.Scope.awaited(time.monotonic() - 0.01), caller, "b", {})
    assert "model 'a' calling model 'b'" in str(err.value)
    assert caller.awaited == []  # nothing was queued
