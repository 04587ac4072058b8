"""Per-request records and their summaries: percentiles, windows, stability. Pure code.

Every time is seconds on one monotonic clock (``time.perf_counter`` in the generator, a fake
clock in tests). Latency percentiles are over successful requests only; failures are counted
by status.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 95, 99)


class Recorder:
    """Append-only columns of finished requests, in completion order.

    Columns: ``end_s`` (completion time), ``latency_s``, ``status`` (``"200"``, ``"429"``,
    ``"UNAVAILABLE"``, ``"error:ConnectionResetError"``...), ``queue_us`` / ``compute_us``
    (server-reported, -1 when the server sent none), ``tokens`` (the request's size in
    tokens when the target knows it, see :mod:`gpuserve.bench.tokens`; -1 otherwise).
    """

    def __init__(self) -> None:
        self.end_s: list[float] = []
        self.latency_s: list[float] = []
        self.status: list[str] = []
        self.queue_us: list[int] = []
        self.compute_us: list[int] = []
        self.tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.end_s)

    def add(
        self,
        end_s: float,
        latency_s: float,
        status: str,
        queue_us: int,
        compute_us: int,
        tokens: int = -1,
    ) -> None:
        self.end_s.append(end_s)
        self.latency_s.append(latency_s)
        self.status.append(status)
        self.queue_us.append(queue_us)
        self.compute_us.append(compute_us)
        self.tokens.append(tokens)


@dataclass(slots=True)
class WindowStats:
    """Summary of the requests that finished in ``[start_s, end_s)``.

    Attributes:
        duration_s: Length of the window, seconds.
        requests: Requests finished (successes and failures).
        ok: Successful requests.
        errors: Failures by status.
        throughput: Successful requests per second.
        latency_ms: Percentile -> milliseconds (keys 50, 90, 95, 99) over successes.
        mean_ms: Mean latency of successes, milliseconds.
        max_ms: Largest latency of successes, milliseconds.
        queue_ms / compute_ms: Mean server-reported queue and compute time, milliseconds,
            or None when the server sent no timing headers.
        tokens_per_s: Tokens of the successful requests per second, or None when the
            requests' sizes are unknown.
        mean_tokens: Mean tokens per successful request, or None likewise.
    """

    duration_s: float
    requests: int
    ok: int
    errors: dict[str, int]
    throughput: float
    latency_ms: dict[int, float]
    mean_ms: float
    max_ms: float
    queue_ms: float | None = None
    compute_ms: float | None = None
    tokens_per_s: float | None = None
    mean_tokens: float | None = None
    extra: dict[str, float] = field(default_factory=dict)


def summarize(rec: Recorder, lo: int, hi: int, duration_s: float) -> WindowStats:
    """Summarise records ``lo:hi`` of ``rec`` that span ``duration_s`` seconds."""
    statuses = rec.status[lo:hi]
    ok_mask = np.fromiter((s == "200" or s == "OK" for s in statuses), bool, len(statuses))
    latencies = np.asarray(rec.latency_s[lo:hi], dtype=np.float64)[ok_mask] * 1000.0
    errors = Counter(s for s, ok in zip(statuses, ok_mask, strict=True) if not ok)
    ok = int(ok_mask.sum())
    if ok:
        values = np.percentile(latencies, PERCENTILES)
        latency_ms = {p: float(v) for p, v in zip(PERCENTILES, values, strict=True)}
        mean_ms, max_ms = float(latencies.mean()), float(latencies.max())
    else:
        latency_ms = {p: float("nan") for p in PERCENTILES}
        mean_ms = max_ms = float("nan")
    queue = np.asarray(rec.queue_us[lo:hi], dtype=np.float64)[ok_mask]
    compute = np.asarray(rec.compute_us[lo:hi], dtype=np.float64)[ok_mask]
    queue = queue[queue >= 0]
    compute = compute[compute >= 0]
    tokens = np.asarray(rec.tokens[lo:hi], dtype=np.float64)[ok_mask]
    known = bool(tokens.size) and bool((tokens >= 0).all())
    return WindowStats(
        duration_s=duration_s,
        requests=hi - lo,
        ok=ok,
        errors=dict(sorted(errors.items())),
        throughput=ok / duration_s if duration_s > 0 else 0.0,
        latency_ms=latency_ms,
        mean_ms=mean_ms,
        max_ms=max_ms,
        queue_ms=float(queue.mean()) / 1000.0 if queue.size else None,
        compute_ms=float(compute.mean()) / 1000.0 if compute.size else None,
        tokens_per_s=float(tokens.sum()) / duration_s if known and duration_s > 0 else None,
        mean_tokens=float(tokens.mean()) if known else None,
    )


def is_stable(windows: list[WindowStats], count: int, tolerance: float) -> bool:
    """True when the last ``count`` windows agree within ``tolerance`` (0.1 = 10%).

    Throughput and mean latency of each of those windows must lie within ``tolerance`` of
    their average (perf_analyzer's rule). A window without a success is never stable.
    """
    if len(windows) < count:
        return False
    last = windows[-count:]
    for values in ([w.throughput for w in last], [w.mean_ms for w in last]):
        if any(v != v or v <= 0 for v in values):  # NaN or nothing succeeded
            return False
        mean = sum(values) / len(values)
        if any(abs(v - mean) > tolerance * mean for v in values):
            return False
    return True
