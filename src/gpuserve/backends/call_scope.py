"""How long the requests of the batch running on this thread are still awaited.

A model that calls another model (:mod:`gpuserve.engine.calls`) gives up on its call after a
timeout; the callee's request may be running by then, and whatever *it* calls in turn would
otherwise run on, unawaited. In a cycle of models calling each other that never ends: each
timed-out hop leaves the next one running. So a call made while a batch runs passes the
batch's deadline on (the callee's request is awaited no longer than the batch's requests),
and is refused at once when none of them is awaited any more.

The instance driver marks the batch (:func:`enter_batch` / :func:`leave_batch`) around its
``forward``; :class:`~gpuserve.engine.calls.InProcessCaller` reads :func:`awaited_until`
(here, below the engine, so that a backend handing a call to a worker thread can carry it:
:func:`within`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")

_local = threading.local()


def enter_batch(awaited: Iterable[float | None]) -> None:
    """Mark a batch as running on this thread, given each of its requests'
    ``awaited_until``: awaited until the latest (no bound when any request has none)."""
    latest = 0.0
    for mine in awaited:
        if mine is None:
            _local.until = None
            return
        latest = max(latest, mine)
    _local.until = latest


def leave_batch() -> None:
    """The batch's ``forward`` is over."""
    _local.until = None


def awaited_until() -> float | None:
    """Monotonic time (s) after which nobody awaits the batch running on this thread, or
    None: no bound (a client's request, or no batch running here)."""
    until: float | None = getattr(_local, "until", None)
    return until


def within(until: float | None, fn: Callable[..., T], *args: object) -> T:
    """Run ``fn(*args)`` on this thread as if inside a batch awaited until ``until`` (for a
    call handed to a worker thread by the batch's own thread)."""
    before = awaited_until()
    _local.until = until
    try:
        return fn(*args)
    finally:
        _local.until = before


__all__ = ["awaited_until", "enter_batch", "leave_batch", "within"]
