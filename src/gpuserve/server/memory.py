"""Flat resident memory under varied input shapes (issue 20): malloc tuning and idle trims.

A server that runs batches of ever-changing shapes (text of any length, 1-64 rows) asks the
C allocator for buffers of ever-changing sizes from several threads (the event loop, the
instance's stage threads, the OpenMP and tokenizer pools). With glibc's defaults that memory
is seldom given back:

* **Per-thread arenas.** glibc gives threads their own heaps ("arenas", up to 8 per core);
  memory freed in one arena is reused only by the threads of that arena.
* **The dynamic mmap threshold.** A block above the threshold (128 KiB at start) is
  ``mmap``-ed and returned at ``free``; but each such ``free`` raises the threshold to the
  freed size (up to 32 MiB), so after a few batches every activation tensor comes from the
  arenas, whose free space fragments between differently-sized tensors and stays resident.
* **No trim.** Free pages inside an arena go back to the kernel only at the top of the main
  heap; ``malloc_trim`` releases them from every arena, but nothing calls it.

What this module does, set by three server settings (``gpuserve serve --help``):

* :func:`tune_malloc`, once at start before any worker thread exists: ``mallopt`` a fixed
  ``M_MMAP_THRESHOLD`` (``malloc_mmap_threshold_bytes``: large tensors are mapped and
  unmapped, never left in an arena) and ``M_ARENA_MAX`` (``malloc_arena_max``).
* :class:`TrimDriver`: a daemon thread that calls ``malloc_trim(0)`` once the process has been
  quiet for a moment after work, and at most every ``memory_trim_interval_s`` seconds while it
  is busy. The decision is :class:`TrimPolicy`, pure, on an injected clock. The trim runs on
  that thread (ctypes releases the GIL), never on the event loop.

All of it is glibc's: on other C libraries (musl, macOS) :meth:`GlibcMalloc.load` returns None
and everything here is a no-op, as it is when another allocator (jemalloc, tcmalloc) is
preloaded.

Also: oneDNN (torch's GELU on the CPU) caches one primitive per input shape, up to 1024
(about 24 MiB measured for the BERT encoder's shapes); :func:`start_memory_care` sets
``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` to :data:`ONEDNN_CACHE_DEFAULT` unless the environment
sets it. Re-creating a primitive costs 0.15-0.7 ms, at most once per batch (the encoder's
layers share one shape): a served-like stream of packed 1-3-row document-chunk batches and
single rows (541 distinct token counts) misses on 37% of batches at 256 entries, ~0.3 ms of
a ~200 ms batch; 120 such batches of the real encoder on one core took 20.0 / 20.2 s of CPU
at 256 entries and 20.1 / 19.9 s at 1024 (issue 20). The CUDA caching allocator is set to
expandable segments by the runner (``PYTORCH_CUDA_ALLOC_CONF``). See the README's "Memory".
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gpuserve.repository.ondemand.footprint import measuring_now

logger = logging.getLogger(__name__)

#: ``mallopt`` parameters of glibc's ``<malloc.h>``.
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

#: oneDNN primitive cache entries unless ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` is set.
ONEDNN_CACHE_DEFAULT = "256"

#: Allocators that replace glibc's malloc when preloaded; glibc tuning is moot then.
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


class _MallocLib(Protocol):
    def mallopt(self, param: int, value: int) -> int: ...
    def malloc_trim(self, pad: int) -> int: ...


class GlibcMalloc:
    """``mallopt`` and ``malloc_trim`` of the process's glibc.

    Args:
        lib: The C library (``ctypes.CDLL``), or a stand-in with the same two functions.
    """

    def __init__(self, lib: _MallocLib) -> None:
        self._lib = lib

    @classmethod
    def load(cls, environ: dict[str, str] | None = None) -> GlibcMalloc | None:
        """The process's glibc malloc, or None: not Linux with glibc, a different allocator
        preloaded (``LD_PRELOAD`` naming jemalloc, tcmalloc or mimalloc), or the functions
        cannot be found."""
        env = os.environ if environ is None else environ
        preload = env.get("LD_PRELOAD", "")
        if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
            return None
        if any(name in preload for name in _OTHER_ALLOCATORS):
            return None
        try:
            lib = ctypes.CDLL("libc.so.6")
            lib.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            lib.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            return None
        return cls(lib)

    def mallopt(self, param: int, value: int) -> bool:
        """``mallopt(param, value)``; True when glibc accepted it."""
        return bool(self._lib.mallopt(param, value))

    def trim(self) -> bool:
        """``malloc_trim(0)``: give every arena's free pages back to the kernel. True when
        some memory was released."""
        return bool(self._lib.malloc_trim(0))


@dataclass(frozen=True, slots=True)
class MallocTuning:
    """What :func:`tune_malloc` sets.

    Attributes:
        arena_max: Most glibc arenas (``M_ARENA_MAX``); 0 keeps glibc's default (8 per core).
        mmap_threshold_bytes: Blocks of at least this many bytes are ``mmap``-ed and
            unmapped at ``free`` (``M_MMAP_THRESHOLD``, which also stops glibc raising the
            threshold as large blocks are freed); 0 keeps glibc's dynamic threshold.
    """

    arena_max: int = 0
    mmap_threshold_bytes: int = 0


def tune_malloc(tuning: MallocTuning, malloc: GlibcMalloc | None) -> list[str]:
    """Apply ``tuning`` to glibc's malloc. Call before any worker thread starts: a thread
    keeps the arena it first used.

    Args:
        tuning: The settings; zeros are left alone.
        malloc: :meth:`GlibcMalloc.load`'s answer; None (not glibc) applies nothing.

    Returns:
        What was set, e.g. ``["M_ARENA_MAX=2"]`` (empty when nothing was).
    """
    if malloc is None:
        return []
    applied = []
    for name, param, value in (
        ("M_MMAP_THRESHOLD", M_MMAP_THRESHOLD, tuning.mmap_threshold_bytes),
        ("M_ARENA_MAX", M_ARENA_MAX, tuning.arena_max),
    ):
        if value > 0:
            if malloc.mallopt(param, value):
                applied.append(f"{name}={value}")
            else:
                logger.warning("mallopt(%s, %d) was refused by glibc", name, value)
    return applied


class TrimPolicy:
    """When to call ``malloc_trim``: pure, on the caller's clock.

    The caller ticks it every ``tick_s`` or so with whether the process did work since the
    previous tick. It answers True (trim now) when there has been work since the last trim
    and either the process has been quiet for ``idle_s`` (the usual case: a pause in the
    traffic returns the memory at once), or ``interval_s`` have passed since the last trim
    (a server that is never idle still trims that often).

    Args:
        interval_s: Most seconds between trims while busy; must be > 0.
        idle_s: Seconds of quiet after work before the idle trim.
    """

    def __init__(self, interval_s: float, idle_s: float = 1.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.idle_s = idle_s
        self._last_trim_s: float | None = None
        self._quiet_since_s: float | None = None
        self._dirty = False

    def tick(self, now_s: float, busy: bool) -> bool:
        """Record one tick and say whether to trim now (then call :meth:`trimmed`).

        Args:
            now_s: The clock, seconds (monotonic).
            busy: Whether the process did work since the previous tick.
        """
        if self._last_trim_s is None:
            self._last_trim_s = now_s
        if busy:
            self._dirty = True
            self._quiet_since_s = None
            return now_s - self._last_trim_s >= self.interval_s
        if self._quiet_since_s is None:
            self._quiet_since_s = now_s
        return self._dirty and now_s - self._quiet_since_s >= self.idle_s

    def trimmed(self, now_s: float) -> None:
        """Record a trim at ``now_s``."""
        self._last_trim_s = now_s
        self._dirty = False


def process_cpu_s() -> float:
    """CPU seconds this process has used (all threads, user + system)."""
    return time.process_time()


def rss_bytes() -> int:
    """This process's resident memory (``VmRSS``), bytes; 0 where ``/proc`` has none."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass(frozen=True, slots=True)
class TrimRecord:
    """One trim: when (clock seconds), how long it took (seconds) and resident memory before
    and after (bytes)."""

    at_s: float
    took_s: float
    rss_before_bytes: int
    rss_after_bytes: int


class TrimDriver:
    """Ticks a :class:`TrimPolicy` from a daemon thread and trims when it says so.

    "Busy" means the process used more than ``busy_cpu_fraction`` of one core since the
    previous tick (measured after the previous trim, so a trim's own work does not count):
    a server answering requests burns CPU; an idle one does not.

    Args:
        malloc: Where to trim.
        policy: When to trim.
        tick_s: Seconds between ticks.
        busy_cpu_fraction: CPU seconds per second above which a tick counts as busy.
        clock: Monotonic seconds (injected for tests).
        cpu_s: CPU seconds used so far (injected for tests).
        rss: Resident bytes (for the log and :attr:`records`).
        paused: True while trims must wait (default: a model load is being measured, see
            :func:`gpuserve.repository.ondemand.footprint.measuring_now`: a trim inside the window
            would make the model look smaller by what the trim returned).
    """

    def __init__(
        self,
        malloc: GlibcMalloc,
        policy: TrimPolicy,
        *,
        tick_s: float = 0.5,
        busy_cpu_fraction: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        cpu_s: Callable[[], float] = process_cpu_s,
        rss: Callable[[], int] = rss_bytes,
        paused: Callable[[], bool] = measuring_now,
    ) -> None:
        self.malloc = malloc
        self.policy = policy
        self.tick_s = tick_s
        self.busy_cpu_fraction = busy_cpu_fraction
        self._clock = clock
        self._cpu_s = cpu_s
        self._rss = rss
        self._paused = paused
        self._last_s = clock()
        self._last_cpu_s = cpu_s()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: The last trims, newest last (at most 64).
        self.records: list[TrimRecord] = []

    def step(self) -> TrimRecord | None:
        """One tick: measure, ask the policy, trim if it says so. Returns the trim's record."""
        now_s, cpu_s = self._clock(), self._cpu_s()
        elapsed_s = max(now_s - self._last_s, 1e-9)
        busy = (cpu_s - self._last_cpu_s) > self.busy_cpu_fraction * elapsed_s
        self._last_s, self._last_cpu_s = now_s, cpu_s
        if not self.policy.tick(now_s, busy) or self._paused():
            return None  # paused: the policy asks again at the next tick
        before = self._rss()
        self.malloc.trim()
        done_s = self._clock()
        record = TrimRecord(now_s, done_s - now_s, before, self._rss())
        self.policy.trimmed(done_s)
        self._last_s, self._last_cpu_s = done_s, self._cpu_s()
        self.records = [*self.records[-63:], record]
        logger.debug(
            "malloc_trim: %.1f ms, resident %.0f -> %.0f MiB",
            record.took_s * 1e3,
            before / 2**20,
            record.rss_after_bytes / 2**20,
        )
        return record

    def start(self) -> TrimDriver:
        """Start the daemon thread (``gpuserve-memory-trim``); returns self."""
        self._thread = threading.Thread(target=self._run, name="gpuserve-memory-trim", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (waits for a trim in progress)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            self.step()


class _MemorySettings(Protocol):
    @property
    def malloc_arena_max(self) -> int: ...
    @property
    def malloc_mmap_threshold_bytes(self) -> int: ...
    @property
    def memory_trim_interval_s(self) -> float: ...


@dataclass(slots=True)
class MemoryCare:
    """What :func:`start_memory_care` set up; :meth:`stop` ends the trim thread.

    Attributes:
        applied: The ``mallopt`` settings applied (empty when none, or not glibc).
        driver: The trim thread, or None (trims off, or not glibc).
    """

    applied: list[str]
    driver: TrimDriver | None

    def stop(self) -> None:
        if self.driver is not None:
            self.driver.stop()


def start_memory_care(
    settings: _MemorySettings, malloc: GlibcMalloc | bool | None = True
) -> MemoryCare:
    """Tune malloc, bound oneDNN's primitive cache (an environment default) and start the
    trim thread as ``settings`` say. Call once, at start, before torch runs and before the
    server creates any thread.

    Args:
        settings: The server config (``malloc_arena_max``, ``malloc_mmap_threshold_bytes``,
            ``memory_trim_interval_s``; zeros turn each off).
        malloc: The allocator; True (default) loads glibc's (:meth:`GlibcMalloc.load`).
    """
    # read by oneDNN when torch first runs a primitive: set before the models load
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_CACHE_DEFAULT)
    lib = GlibcMalloc.load() if malloc is True else malloc or None
    tuning = MallocTuning(settings.malloc_arena_max, settings.malloc_mmap_threshold_bytes)
    applied = tune_malloc(tuning, lib)
    driver = None
    if lib is not None and settings.memory_trim_interval_s > 0:
        driver = TrimDriver(lib, TrimPolicy(settings.memory_trim_interval_s)).start()
    if lib is None:
        logger.info("memory: not glibc malloc; no malloc tuning or trims")
    else:
        logger.info(
            "memory: %s; malloc_trim %s",
            ", ".join(applied) or "glibc malloc defaults",
            f"when idle and every {settings.memory_trim_interval_s:g} s"
            if driver is not None
            else "off",
        )
    return MemoryCare(applied, driver)
