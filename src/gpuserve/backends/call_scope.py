"""The batch running on this thread: its rows' contexts, and the model caller its backend set.

A model that calls another model (:mod:`gpuserve.engine.calls`, a Triton Python model's
``InferenceRequest.exec()``) does so from inside its batch's ``forward``; the call inherits
from the batch, through this one per-thread record (:class:`Scope`):

* **how long the batch is awaited.** A caller gives up on its call after a timeout; the
  callee's request may be running by then, and whatever *it* calls in turn would otherwise
  run on, unawaited (in a cycle of models calling each other: forever). A call made while a
  batch runs is awaited no longer than the batch's rows (:func:`awaited_until`), and is
  refused at once when none of them is awaited any more;
* **the trace** it nests under (:func:`current_trace`: the first traced row's);
* **the model caller** (``caller``) a Triton Python model's ``exec`` uses, which its backend
  sets around ``execute`` (:func:`with_caller`).

The instance driver sets the rows around its ``forward`` (:func:`enter_batch` /
:func:`leave_batch`); a backend handing a call to a worker thread carries the record there
(:func:`current`, :func:`within`). Here, below the engine, so that backends can read it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gpuserve.backends.row_context import RowContext

T = TypeVar("T")


@dataclass(slots=True)
class Scope:
    """What runs on a thread now.

    Attributes:
        rows: The running batch's row contexts (empty outside a batch).
        caller: The model caller of the running backend's calls, or None.
    """

    rows: Sequence[RowContext] = ()
    caller: Any = field(default=None, repr=False)

    @classmethod
    def awaited(cls, until: float | None) -> Scope:
        """A scope of one row awaited until ``until`` (a call's own worker thread)."""
        return cls((RowContext(awaited_until=until),))


_local = threading.local()


def current() -> Scope | None:
    """This thread's scope, or None."""
    scope: Scope | None = getattr(_local, "scope", None)
    return scope


def enter_batch(rows: Sequence[RowContext]) -> None:
    """A batch of ``rows`` runs on this thread now (the caller set by the backend stays)."""
    scope = current()
    _local.scope = Scope(rows, None if scope is None else scope.caller)


def leave_batch() -> None:
    """The batch's ``forward`` is over."""
    _local.scope = None


def rows() -> Sequence[RowContext]:
    """The running batch's row contexts (empty outside a batch)."""
    scope = current()
    return () if scope is None else scope.rows


def awaited_until() -> float | None:
    """Monotonic time (s) after which nobody awaits the batch running on this thread: the
    latest of its rows'; None (no bound) when a row has none or no batch runs here."""
    scope = current()
    if scope is None or not scope.rows:
        return None
    latest = 0.0
    for row in scope.rows:
        mine = row.awaited_until
        if mine is None:
            return None
        latest = max(latest, mine)
    return latest


def current_trace() -> Any:
    """The trace of the first traced row of the running batch, or None."""
    scope = current()
    if scope is None:
        return None
    return next((row.trace for row in scope.rows if row.trace is not None), None)


def caller() -> Any:
    """The model caller set by :func:`with_caller` on this thread, or None."""
    scope = current()
    return None if scope is None else scope.caller


@contextmanager
def with_caller(model_caller: Any) -> Iterator[None]:
    """Make ``model_caller`` the one calls from this thread use while the block runs."""
    scope = current()
    before = None if scope is None else scope.caller
    if scope is None:
        scope = _local.scope = Scope()
    scope.caller = model_caller
    try:
        yield
    finally:
        scope.caller = before


def within(scope: Scope | None, fn: Callable[..., T], *args: object) -> T:
    """Run ``fn(*args)`` on this thread in ``scope`` (a call handed to a worker thread by
    the batch's own thread carries the batch's :func:`current` scope)."""
    before = current()
    _local.scope = scope
    try:
        return fn(*args)
    finally:
        _local.scope = before


__all__ = [
    "Scope",
    "awaited_until",
    "caller",
    "current",
    "current_trace",
    "enter_batch",
    "leave_batch",
    "rows",
    "with_caller",
    "within",
]
