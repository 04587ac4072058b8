"""The load generator: closed-loop concurrency and open-loop arrival rates, in windows.

One level (a concurrency or a request rate) runs as::

    warm-up (discarded) -> windows of window_s until the last `stable_windows` agree within
    `tolerance` (or `max_windows` ran) -> report = all requests of those last windows

*Closed loop*: ``concurrency`` workers, each sending its next request as soon as its previous
one is answered (perf_analyzer's default). *Open loop*: requests are sent at a fixed rate,
evenly spaced (``constant``) or with exponential gaps (``poisson``), whatever the server's
answers; latency counts from the scheduled send time, so a generator that falls behind shows
up as latency rather than hiding it (no coordinated omission).

Times are ``time.perf_counter`` seconds. The generator runs on one event loop (uvloop when
installed); everything per request is an append to a :class:`~gpuserve.bench.stats.Recorder`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from gpuserve.bench import server_info
from gpuserve.bench.stats import Recorder, WindowStats, is_stable, summarize
from gpuserve.bench.targets import Session, Target

Mode = Literal["concurrency", "rate"]


@dataclass(slots=True)
class LoadSettings:
    """How each level is measured.

    Attributes:
        warmup_s: Load before measuring, seconds (discarded).
        window_s: Length of one measurement window, seconds.
        stable_windows: Windows that must agree for the level to count as stable.
        tolerance: Allowed spread (0.1 = 10%) of throughput and mean latency across them.
        max_windows: Most windows per level; the level is then reported as not stable.
        timeout_s: A request unanswered this long counts as a ``timeout`` error.
        arrival: Open loop only: ``constant`` or ``poisson`` gaps.
        max_connections: Open loop only: most connections (requests in flight).
        seed: Seed of the Poisson arrivals.
    """

    warmup_s: float = 2.0
    window_s: float = 2.0
    stable_windows: int = 3
    tolerance: float = 0.10
    max_windows: int = 10
    timeout_s: float = 30.0
    arrival: Literal["constant", "poisson"] = "constant"
    max_connections: int = 512
    seed: int = 0


@dataclass(slots=True)
class ServerProbe:
    """Control-plane reads around each level: the statistics extension and GPU metrics.

    Attributes:
        base_url: HTTP base URL of the server (also used for gRPC targets).
        model / version: The model under test.
        metrics_url: Prometheus endpoint to scrape for GPU series, or None.
        token: The server's API bearer token (for the statistics reads), or None.
        ca_file: PEM file the server's TLS certificate is checked against, or None.
    """

    base_url: str | None
    model: str
    version: str | None = None
    metrics_url: str | None = None
    token: str | None = None
    ca_file: str | Path | None = None


@dataclass
class LevelResult:
    """One measured level.

    Attributes:
        mode / level: ``concurrency`` (workers) or ``rate`` (requests per second offered).
        summary: Merged statistics of the last ``stable_windows`` windows.
        windows: Every measurement window, in order.
        stable: Whether those windows agreed within the tolerance.
        batch_size: Rows per request.
        server: Server-side split from the statistics extension (``queue_ms``,
            ``compute_ms``, ``rows_per_batch``), when the server has it.
        gpu: GPU utilisation / memory averages when the server exports them.
        sent_rate: Open loop: requests per second actually sent.
        client_cpu: CPU time of the generator process per second of measurement (1.0 = one
            core busy); near 1 means the generator itself may be the limit.
        failing: Measuring stopped early: requests had failed and none had succeeded
            since the level started (warm-up included) when a window ended.
    """

    mode: Mode
    level: float
    summary: WindowStats
    windows: list[WindowStats]
    stable: bool
    batch_size: int = 1
    server: dict[str, float] | None = None
    gpu: dict[str, float] = field(default_factory=dict)
    sent_rate: float | None = None
    client_cpu: float | None = None
    failing: bool = False

    @property
    def p99_ms(self) -> float:
        return self.summary.latency_ms[99]

    @property
    def throughput(self) -> float:
        return self.summary.throughput

    @property
    def queue_ms(self) -> float | None:
        """Server-side queue time: the timing headers, else the statistics extension."""
        if self.summary.queue_ms is not None:
            return self.summary.queue_ms
        return self.server.get("queue_ms") if self.server else None

    @property
    def compute_ms(self) -> float | None:
        if self.summary.compute_ms is not None:
            return self.summary.compute_ms
        return self.server.get("compute_ms") if self.server else None

    def as_dict(self) -> dict[str, Any]:
        s = self.summary
        return {
            "mode": self.mode,
            "level": self.level,
            "batch_size": self.batch_size,
            "stable": self.stable,
            "throughput_infer_per_s": s.throughput,
            "throughput_rows_per_s": s.throughput * self.batch_size,
            "throughput_tokens_per_s": s.tokens_per_s,
            "mean_tokens_per_request": s.mean_tokens,
            "requests": s.requests,
            "ok": s.ok,
            "errors": s.errors,
            "latency_ms": {f"p{p}": v for p, v in s.latency_ms.items()}
            | {"mean": s.mean_ms, "max": s.max_ms},
            "server_queue_ms": self.queue_ms,
            "server_compute_ms": self.compute_ms,
            "timing_source": "headers"
            if s.queue_ms is not None
            else "statistics"
            if self.server
            else None,
            "server_stats": self.server,
            "gpu": self.gpu,
            "sent_rate": self.sent_rate,
            "client_cpu": self.client_cpu,
            "failing": self.failing,
            "windows": [
                {
                    "duration_s": w.duration_s,
                    "throughput": w.throughput,
                    "p50_ms": w.latency_ms[50],
                    "p99_ms": w.latency_ms[99],
                    "mean_ms": w.mean_ms,
                    "tokens_per_s": w.tokens_per_s,
                    "errors": w.errors,
                }
                for w in self.windows
            ],
        }


#: Progress callback: (level, windows so far, latest window) -> None.
OnWindow = Callable[[float, int, WindowStats], None]


class _Run:
    """State shared by the tasks of one level."""

    def __init__(self, target: Target, rec: Recorder, settings: LoadSettings) -> None:
        self.target = target
        self.rec = rec
        self.settings = settings
        self.stopping = False
        self.sessions: list[Session] = []
        # tokens per sample (gpuserve.bench.tokens), when the target knows them
        self.tokens: list[int] | None = getattr(target, "sample_tokens", None) or None


async def _send(run: _Run, session: Session, index: int, start: float) -> None:
    try:
        status, queue_us, compute_us = await session.infer(index)
    except TimeoutError:
        status, queue_us, compute_us = "timeout", -1, -1
        session.close()
    except Exception as err:  # connection refused/reset, bad reply: count it, go on
        status, queue_us, compute_us = f"error:{type(err).__name__}", -1, -1
        session.close()
        await asyncio.sleep(0.01)  # a refused connection must not spin the loop
    end = time.perf_counter()
    tokens = run.tokens[index % len(run.tokens)] if run.tokens is not None else -1
    run.rec.add(end, end - start, status, queue_us, compute_us, tokens)


async def _closed_worker(run: _Run, offset: int) -> None:
    session = await run.target.session()
    run.sessions.append(session)
    index = offset
    clock = time.perf_counter
    while not run.stopping:
        await _send(run, session, index, clock())
        index += 1


async def _open_loop(run: _Run, rate: float, counter: list[int]) -> None:
    settings = run.settings
    rng = np.random.default_rng(settings.seed)
    idle: asyncio.Queue[Session] = asyncio.Queue()
    created = 0
    tasks: set[asyncio.Task[None]] = set()
    clock = time.perf_counter

    async def one(index: int, scheduled: float) -> None:
        nonlocal created
        if idle.empty() and created < settings.max_connections:
            created += 1
            session = await run.target.session()
            run.sessions.append(session)
        else:
            session = await idle.get()
        try:
            await _send(run, session, index, scheduled)
        finally:
            idle.put_nowait(session)

    def gap() -> float:
        return float(rng.exponential(1.0 / rate)) if settings.arrival == "poisson" else 1.0 / rate

    next_at = clock()
    index = 0
    try:
        while not run.stopping:
            now = clock()
            while next_at <= now:
                task = asyncio.ensure_future(one(index, next_at))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                index += 1
                counter[0] += 1
                next_at += gap()
            await asyncio.sleep(max(0.0, next_at - clock()))
    finally:
        if tasks:
            await asyncio.wait(tasks, timeout=settings.timeout_s + 1)
            for task in tasks:
                task.cancel()


async def _watchdog(run: _Run) -> None:
    while True:
        await asyncio.sleep(min(1.0, run.settings.timeout_s / 4))
        run.target.check_timeouts(time.perf_counter())


async def _gpu_sampler(probe: ServerProbe, sampler: server_info.GpuSampler) -> None:
    if probe.metrics_url is None:
        return
    while True:
        text = await asyncio.to_thread(server_info.get_text, probe.metrics_url, 2.0, probe.ca_file)
        values = server_info.parse_gpu_metrics(text) if text else {}
        if not values and sampler.count == 0:
            return  # the server exports no GPU series: stop scraping
        sampler.add(values)
        await asyncio.sleep(1.0)


async def _fetch_stats(probe: ServerProbe | None) -> server_info.StatsSnapshot | None:
    if probe is None or probe.base_url is None:
        return None
    return await asyncio.to_thread(
        server_info.fetch_stats,
        probe.base_url,
        probe.model,
        probe.version,
        probe.token,
        probe.ca_file,
    )


async def run_level(
    target: Target,
    mode: Mode,
    level: float,
    settings: LoadSettings,
    probe: ServerProbe | None = None,
    batch_size: int = 1,
    on_window: OnWindow | None = None,
) -> LevelResult:
    """Measure one concurrency or request rate (see the module docstring)."""
    rec = Recorder()
    run = _Run(target, rec, settings)
    sent = [0]
    if mode == "concurrency":
        load = [asyncio.ensure_future(_closed_worker(run, i * 7919)) for i in range(int(level))]
    else:
        load = [asyncio.ensure_future(_open_loop(run, level, sent))]
    helpers = [asyncio.ensure_future(_watchdog(run))]
    sampler = server_info.GpuSampler()
    try:
        await asyncio.sleep(settings.warmup_s)
        before = await _fetch_stats(probe)
        if probe is not None:
            helpers.append(asyncio.ensure_future(_gpu_sampler(probe, sampler)))
        windows: list[WindowStats] = []
        marks: list[tuple[int, int, float, float]] = []
        start_index, start_s, sent_start = len(rec), time.perf_counter(), sent[0]
        first_s, first_cpu = start_s, time.process_time()
        failing = False
        while len(windows) < settings.max_windows:
            await asyncio.sleep(settings.window_s)
            now, index = time.perf_counter(), len(rec)
            window = summarize(rec, start_index, index, now - start_s)
            windows.append(window)
            marks.append((start_index, index, start_s, now))
            start_index, start_s = index, now
            if on_window is not None:
                on_window(level, len(windows), window)
            if _failing(rec, index):
                failing = True
                break
            if is_stable(windows, settings.stable_windows, settings.tolerance):
                break
        sent_end, end_s, end_cpu = sent[0], time.perf_counter(), time.process_time()
        after = await _fetch_stats(probe)
    finally:
        run.stopping = True
        for task in helpers:
            task.cancel()
        done, pending = await asyncio.wait(load, timeout=settings.timeout_s + 1)
        for task in pending:
            task.cancel()
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        for session in run.sessions:
            session.close()
    last = marks[-min(settings.stable_windows, len(marks)) :]
    lo, hi = last[0][0], last[-1][1]
    summary = summarize(rec, lo, hi, last[-1][3] - last[0][2])
    sent_rate = (sent_end - sent_start) / (end_s - first_s) if mode == "rate" else None
    return LevelResult(
        mode=mode,
        level=level,
        summary=summary,
        windows=windows,
        stable=is_stable(windows, settings.stable_windows, settings.tolerance),
        batch_size=batch_size,
        server=server_info.stats_split(before, after),
        gpu=server_info.gpu_summary(sampler.means()),
        sent_rate=sent_rate,
        client_cpu=(end_cpu - first_cpu) / (end_s - first_s),
        failing=failing,
    )


def _failing(rec: Recorder, upto: int) -> bool:
    """Requests finished, and not one of the first ``upto`` succeeded (any success ends the
    scan at once, so this costs nothing on a healthy run)."""
    return upto > 0 and not any(s == "200" or s == "OK" for s in rec.status[:upto])


def describe_failing(result: LevelResult, target: str) -> str:
    """One line for a level that failed every request: where, how often, and what to check."""
    errors = result.windows[-1].errors if result.windows else {}
    counts = ", ".join(f"{n} x {status}" for status, n in sorted(errors.items())[:3])
    unit = "concurrency" if result.mode == "concurrency" else "request rate"
    return (
        f"every request to {target} failed at {unit} {result.level:g} ({counts or 'no answer'})"
        "; stopped: check the URL, the gRPC address, the model and the server's log"
    )


StopRule = Callable[[LevelResult], bool]


async def run_sweep(
    target: Target,
    mode: Mode,
    levels: list[float],
    settings: LoadSettings,
    probe: ServerProbe | None = None,
    batch_size: int = 1,
    on_window: OnWindow | None = None,
    on_level: Callable[[LevelResult], None] | None = None,
    stop: StopRule | None = None,
) -> list[LevelResult]:
    """Measure each level in order; ``stop(result)`` True ends the sweep early, and so does a
    level that fails every request (:attr:`LevelResult.failing`; it is the last result)."""
    results = []
    for level in levels:
        result = await run_level(target, mode, level, settings, probe, batch_size, on_window)
        results.append(result)
        if on_level is not None:
            on_level(result)
        if result.failing or (stop is not None and stop(result)):
            break
    return results


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop when installed (the generator's per-request cost halves), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run_async(coro: Any) -> Any:
    """Run ``coro`` to completion on a fresh :func:`new_event_loop`."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coro)
