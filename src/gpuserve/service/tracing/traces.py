"""Request traces: one trace object per sampled request, recorded by one of two sinks.

:class:`~gpuserve.service.tracing.runtime_settings.TraceSettings` (Triton's trace settings) decides
which requests are traced and makes a :class:`Traced` for each, which the service puts on the
request (``InferenceRequest.trace``); the engine nests the trace of an ensemble step or a BLS
call under it (:meth:`Traced.child`), and whoever answers a traced request ends its trace
(:meth:`Traced.end`). The sink records it:

* :class:`JsonLinesSink` (``trace_mode`` ``triton``): one JSON line per request in the trace
  file, Triton's timestamps (``QUEUE_START``, ``COMPUTE_START``, ``COMPUTE_END``,
  ``REQUEST_END``), and ``parent_id`` for a step or a call under another request;
* :class:`~gpuserve.service.tracing.otel.OtelSink` (``opentelemetry``): a span per request with child
  spans for its stages, exported over OTLP/HTTP.

A request's stages are derived from the engine's timing when it is answered (no clock reads
on the request path beyond one at the start): its admission (decoding and the model's
admission step, tokenisation for text models) from the trace's start until it entered the
queue, the queue wait, the batch's compute, and the response (from the result being ready
until the request was answered). Requests that are not sampled get no trace object at all.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Protocol

import orjson

from gpuserve.engine.request import InferenceResponse, RequestTiming, RequestTrace
from gpuserve.engine.runners.base import ResponseStream, StreamedResponse

logger = logging.getLogger(__name__)


class TraceSink(Protocol):
    """Where traces go. ``open`` is called when a trace starts, ``close`` when it ends (any
    thread; a sink is thread-safe)."""

    def open(self, trace: Traced, parent: Traced | None, traceparent: str | None) -> None:
        """A trace started (``parent``: the trace it nests under; ``traceparent``: the W3C
        trace context the client sent, for a request without a parent)."""
        ...

    def close(self, trace: Traced, outcome: InferenceResponse | BaseException | None) -> None:
        """A trace ended with ``outcome`` (a response, an error, None: cancelled) at
        ``trace.end_ns``."""
        ...

    def shutdown(self) -> None:
        """Flush what is buffered and release files or connections."""
        ...


class Traced:
    """The trace of one request (implements the engine's ``RequestTrace``).

    Attributes:
        model / version / request_id: What the request asked for (version: "" when the
            default one; the version that ran it is in the response).
        kind: ``request`` (from a client), ``ensemble_step`` or ``bls``.
        start_ns / end_ns: Wall clock, nanoseconds (``end_ns`` 0 until it ends).
        id / parent_id: Trace numbers (``parent_id`` 0 for a client's request).
        handle: The sink's own state (an OpenTelemetry span).
    """

    __slots__ = (
        "_lock",
        "clock_ns",
        "end_ns",
        "handle",
        "id",
        "kind",
        "model",
        "parent_id",
        "request_id",
        "sink",
        "start_ns",
        "version",
    )

    def __init__(
        self,
        sink: TraceSink,
        model: str,
        version: str,
        request_id: str,
        kind: str,
        clock_ns: Callable[[], int],
        trace_id: int,
        parent_id: int = 0,
    ) -> None:
        self.sink = sink
        self.model = model
        self.version = version
        self.request_id = request_id
        self.kind = kind
        self.clock_ns = clock_ns
        self.start_ns = clock_ns()
        self.end_ns = 0
        self.id = trace_id
        self.parent_id = parent_id
        self.handle: Any = None
        self._lock = threading.Lock()

    def child(self, model: str, version: str | None, kind: str) -> Traced:
        """A trace for a request sent on behalf of this one, started now."""
        child = Traced(
            self.sink,
            model,
            version or "",
            self.request_id,
            kind,
            self.clock_ns,
            next_trace_id(),
            self.id,
        )
        self.sink.open(child, self, None)
        return child

    def end(self, outcome: InferenceResponse | BaseException | None) -> None:
        """End the trace now (only the first call counts)."""
        with self._lock:
            if self.end_ns:
                return
            self.end_ns = max(self.clock_ns(), self.start_ns)
        self.sink.close(self, outcome)


_ids = iter(range(1, 1 << 62))
_ids_lock = threading.Lock()


def next_trace_id() -> int:
    """A process-wide trace number (Triton's ``id``)."""
    with _ids_lock:
        return next(_ids)


def stage_stamps(start_ns: int, end_ns: int, timing: RequestTiming) -> tuple[int, int, int]:
    """(queue start, compute start, compute end), wall-clock ns, of a request that started at
    ``start_ns`` and was answered at ``end_ns``, from the engine's ``timing`` (seconds): the
    engine's total runs from queue entry to the result, so the queue starts ``total_s``
    before the answer; each stamp is kept inside [start_ns, end_ns]."""
    total_ns = int(max(timing.total_s, timing.queue_s + timing.compute_s) * 1e9)
    queue_start = min(max(start_ns, end_ns - total_ns), end_ns)
    compute_start = min(queue_start + int(timing.queue_s * 1e9), end_ns)
    compute_end = min(compute_start + int(timing.compute_s * 1e9), end_ns)
    return queue_start, compute_start, compute_end


class JsonLinesSink:
    """Triton-mode traces: a JSON line per ended trace, into ``path`` (None: the log).

    Args:
        path: The trace file (opened on the first trace, appended to).
        flush_every: Flush after this many lines (0 or 1: every line).
    """

    def __init__(self, path: Path | None, flush_every: int) -> None:
        self.path = path
        self.flush_every = flush_every
        self.written = 0
        self._file: IO[bytes] | None = None
        self._lock = threading.Lock()

    def open(self, trace: Traced, parent: Traced | None, traceparent: str | None) -> None:
        """Nothing to do until the trace ends."""

    def close(self, trace: Traced, outcome: InferenceResponse | BaseException | None) -> None:
        """Write the trace's line (a failed or cancelled request has no stage stamps)."""
        record: dict[str, Any] = {
            "id": trace.id,
            "model_name": trace.model,
            "model_version": trace.version,
            "request_id": trace.request_id,
        }
        if trace.parent_id:
            record["parent_id"] = trace.parent_id
        if isinstance(outcome, InferenceResponse):
            record["model_version"] = outcome.model_version
            record["request_id"] = outcome.id or trace.request_id
            queue, start, end = stage_stamps(trace.start_ns, trace.end_ns, outcome.timing)
            stamps = [
                ("QUEUE_START", queue),
                ("COMPUTE_START", start),
                ("COMPUTE_END", end),
                ("REQUEST_END", trace.end_ns),
            ]
            record["timestamps"] = [{"name": n, "ns": ns} for n, ns in stamps]
        else:
            record["error"] = "cancelled" if outcome is None else str(outcome)
        line = orjson.dumps(record)
        with self._lock:
            if self.path is None:
                logger.info("trace %s", line.decode())
                return
            try:
                if self._file is None:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    self._file = self.path.open("ab")
                self._file.write(line + b"\n")
                self.written += 1
                if self.flush_every <= 1 or self.written % self.flush_every == 0:
                    self._file.flush()
            except OSError as err:
                logger.warning("cannot write trace file %s: %s", self.path, err)

    def shutdown(self) -> None:
        """Flush and close the file."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


class TracedStream(ResponseStream):
    """A traced request's response stream: its trace ends with the final item (the last
    response, or the error), or when the stream is cancelled.

    Args:
        inner: The runner's stream.
        trace: The request's trace.
    """

    def __init__(self, inner: ResponseStream, trace: RequestTrace) -> None:
        self.inner = inner
        self.trace = trace
        self._last: InferenceResponse | None = None

    async def __anext__(self) -> StreamedResponse:
        try:
            item = await self.inner.__anext__()
        except StopAsyncIteration:
            self.trace.end(self._last)
            raise
        if item.response is not None:
            self._last = item.response
        if item.final:
            self.trace.end(item.error if item.error is not None else self._last)
        return item

    def cancel(self, reason: str = "cancelled") -> None:
        self.trace.end(None)
        self.inner.cancel(reason)
