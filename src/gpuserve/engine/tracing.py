"""The engine's side of tracing: NVTX ranges for Nsight Systems, and the request trace a
model's BLS calls are nested under.

**Request traces** (OpenTelemetry spans or Triton's JSON lines, made by the service): while
:data:`state` says request tracing is on, a call a model makes from its batch's ``forward``
nests under the batch's first traced request (:func:`current_request_trace`, read from the
batch's row contexts, :mod:`gpuserve.backends.call_scope`). With tracing off this is one
attribute read per call.

**NVTX**: queue wait, preprocess, forward and postprocess.

Under ``nsys profile gpuserve serve ...`` the timeline then shows, per batch, a range for
each stage on the thread that ran it (``text_embedding:1 forward 32 rows``), and per request
a ``queue`` range from admission to the start of its batch's preprocessing (a process-wide
range, as it starts on the event loop thread and ends on an instance thread). Host-to-device
copies run inside ``preprocess``/``forward`` and show as CUDA memcpy rows under them.

Ranges are emitted only when an instance runs on a CUDA device; otherwise every call here is a
no-op costing a method call, and torch's NVTX module is never touched (CPU builds lack it).
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Iterable
from typing import Any

from gpuserve.backends import call_scope
from gpuserve.engine.batch import BatchResult, Pending
from gpuserve.engine.request import RequestTrace

logger = logging.getLogger(__name__)

_nvtx: Any = None  # torch.cuda.nvtx once an instance on a CUDA device enabled it
_queue_ranges: dict[int, int] = {}  # id(pending item) -> NVTX range id


def _load_nvtx() -> Any:
    global _nvtx
    if _nvtx is None:
        try:
            # torch's NVTX functions are untyped: held as Any
            nvtx: Any = importlib.import_module("torch.cuda.nvtx")
            nvtx.range_push("gpuserve")  # raises on builds without NVTX
            nvtx.range_pop()
            _nvtx = nvtx
        except Exception as err:
            logger.debug("NVTX ranges off: %s", err)
            return None
    return _nvtx


class StageTracer:
    """The stage ranges of one instance.

    Args:
        label: Shown in each range, e.g. ``text_embedding:1``.
        device: The instance's device; ranges only for ``cuda*``.
    """

    __slots__ = ("label", "nvtx")

    def __init__(self, label: str, device: str) -> None:
        self.label = label
        self.nvtx = _load_nvtx() if device.startswith("cuda") else None

    def begin(self, stage: str, job: BatchResult) -> None:
        """Open the range of ``stage`` for ``job`` on this thread; the
        preprocess stage also closes the queue ranges of the batch's requests."""
        if self.nvtx is None:
            return
        batch = job.batch
        if stage == "preprocess":
            queue_exit(batch.items)
        self.nvtx.range_push(f"{self.label} {stage} {batch.rows} rows")

    def end(self) -> None:
        """Close the range opened last on this thread."""
        if self.nvtx is not None:
            self.nvtx.range_pop()


def queue_enter(item: Pending, label: str) -> None:
    """A request entered the queue (event loop thread)."""
    if _nvtx is not None:
        _queue_ranges[id(item)] = _nvtx.range_start(f"{label} queue")


def queue_exit(items: Iterable[Pending]) -> None:
    """Requests left the queue: their batch starts, or they expired or were cancelled."""
    if _nvtx is None:
        return
    for item in items:
        range_id = _queue_ranges.pop(id(item), None)
        if range_id is not None:
            _nvtx.range_end(range_id)


class _RequestTracing:
    """Whether request traces may exist.

    ``on`` is true while at least one tracer is on (a server's trace settings, or
    ``--trace-config``, turn tracing on); tracers say so through :meth:`switch`, so several
    servers in one process (tests) do not turn each other's tracing off.
    """

    __slots__ = ("_lock", "_tracers", "on")

    def __init__(self) -> None:
        self.on = False
        self._tracers: set[int] = set()
        self._lock = threading.Lock()

    def switch(self, tracer: object, on: bool) -> None:
        """``tracer`` (any object, by identity) is on or off now."""
        with self._lock:
            if on:
                self._tracers.add(id(tracer))
            else:
                self._tracers.discard(id(tracer))
            self.on = bool(self._tracers)


state = _RequestTracing()


def current_request_trace() -> RequestTrace | None:
    """The trace a call made on this thread now belongs under (the running batch's first
    traced row, :mod:`gpuserve.backends.call_scope`), or None."""
    if not state.on:
        return None
    trace: RequestTrace | None = call_scope.current_trace()
    return trace
