"""Triton's CPU gauges from the Linux ``/proc`` filesystem, read at scrape time.

* ``nv_cpu_utilization``: busy share of all cores, 0..1, since the previous reading (the first
  scrape covers the time since boot); readings closer together than ``min_interval_s`` reuse
  the last value, so two scrapers a moment apart do not see a ratio of a few jiffies.
* ``nv_cpu_memory_total_bytes``: ``MemTotal`` of ``/proc/meminfo``.
* ``nv_cpu_memory_used_bytes``: ``MemTotal - MemAvailable``.

On a system without ``/proc`` (not Linux) the collector yields nothing, as Triton does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from gpuserve.metrics.triton import TritonFamily


def _gauge(name: str, documentation: str, value: float) -> TritonFamily:
    family = TritonFamily(name, documentation, (), "gauge")
    family.add_metric((), float(value))
    return family


def read_cpu_jiffies(stat: str) -> tuple[int, int] | None:
    """(busy, total) jiffies of the aggregate ``cpu`` line of ``/proc/stat`` text; idle and
    iowait are the idle part."""
    for line in stat.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            values = [int(v) for v in fields[1:]]
            idle = values[3] + (values[4] if len(values) > 4 else 0)
            total = sum(values[:8])  # guest time is already inside user/nice
            return total - idle, total
    return None


def read_meminfo_bytes(meminfo: str) -> tuple[int, int] | None:
    """(total, used) bytes from ``/proc/meminfo`` text: MemTotal and MemTotal - MemAvailable."""
    fields: dict[str, int] = {}
    for line in meminfo.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            fields[key] = int(parts[0]) * 1024  # kB
    if "MemTotal" not in fields or "MemAvailable" not in fields:
        return None
    return fields["MemTotal"], fields["MemTotal"] - fields["MemAvailable"]


class CpuCollector(Collector):
    """``nv_cpu_utilization``, ``nv_cpu_memory_total_bytes``, ``nv_cpu_memory_used_bytes``.

    Args:
        proc: The ``/proc`` folder (a test passes a folder of fake files).
        min_interval_s: Shortest span, seconds (monotonic), a utilisation reading covers.
        clock: Monotonic seconds.
    """

    def __init__(
        self,
        proc: Path = Path("/proc"),
        min_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.proc = proc
        self.min_interval_s = min_interval_s
        self.clock = clock
        self._lock = threading.Lock()
        self._last: tuple[float, int, int] | None = None  # (when, busy, total)
        self._ratio: float | None = None

    def describe(self) -> list[Metric]:
        return []

    def _utilization(self) -> float | None:
        try:
            jiffies = read_cpu_jiffies((self.proc / "stat").read_text())
        except OSError:
            return None
        if jiffies is None:
            return None
        busy, total = jiffies
        now = self.clock()
        with self._lock:
            if self._last is None:
                self._ratio = busy / total if total else 0.0
                self._last = (now, busy, total)
            elif now - self._last[0] >= self.min_interval_s:
                _, busy0, total0 = self._last
                span = total - total0
                self._ratio = (busy - busy0) / span if span > 0 else self._ratio
                self._last = (now, busy, total)
            return self._ratio

    def collect(self) -> Iterator[Metric]:
        ratio = self._utilization()
        if ratio is not None:
            yield _gauge("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", ratio)
        try:
            memory = read_meminfo_bytes((self.proc / "meminfo").read_text())
        except OSError:
            memory = None
        if memory is not None:
            yield _gauge("nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes", memory[0])
            yield _gauge("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes", memory[1])
