"""Flat memory (issue 20): the pure trim policy on a fake clock, the trim driver's busy/idle
measurement, the mallopt/malloc_trim wrapper (no-op where glibc is absent) and, in a child
process, that ``malloc_trim`` really returns freed heap pages to the kernel."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest

from gpuserve.repository.ondemand import footprint
from gpuserve.server import memory
from gpuserve.server.memory import (
    M_ARENA_MAX,
    M_MMAP_THRESHOLD,
    GlibcMalloc,
    MallocTuning,
    TrimDriver,
    TrimPolicy,
    start_memory_care,
    tune_malloc,
)


class FakeLib:
    """Records mallopt/malloc_trim calls; ``accept`` says what mallopt returns."""

    def __init__(self, accept: bool = True) -> None:
        self.accept = accept
        self.mallopts: list[tuple[int, int]] = []
        self.trims = 0

    def mallopt(self, param: int, value: int) -> int:
        self.mallopts.append((param, value))
        return 1 if self.accept else 0

    def malloc_trim(self, pad: int) -> int:
        assert pad == 0
        self.trims += 1
        return 1


# -- the policy ------------------------------------------------------------------------------


def ticks(policy: TrimPolicy, start_s: float, end_s: float, busy: bool, step_s: float = 0.5):
    """Tick from start_s to end_s (exclusive); the times at which the policy said trim
    (each trim recorded at once)."""
    trims = []
    now = start_s
    while now < end_s - 1e-9:
        if policy.tick(now, busy):
            policy.trimmed(now)
            trims.append(now)
        now += step_s
    return trims


def test_an_idle_process_is_never_trimmed():
    assert ticks(TrimPolicy(interval_s=10, idle_s=1), 0, 120, busy=False) == []


def test_work_then_quiet_trims_once_after_idle_s():
    policy = TrimPolicy(interval_s=30, idle_s=1)
    assert ticks(policy, 0, 5, busy=True) == []
    # quiet from 5.0: the first quiet tick starts the clock, the trim comes idle_s later
    assert ticks(policy, 5, 60, busy=False) == [6.0]


def test_each_pause_after_work_gets_its_trim():
    policy = TrimPolicy(interval_s=100, idle_s=2)
    assert ticks(policy, 0, 3, busy=True) == []
    assert ticks(policy, 3, 10, busy=False) == [5.0]
    assert ticks(policy, 10, 11, busy=True) == []
    assert ticks(policy, 11, 20, busy=False) == [13.0]


def test_a_server_that_is_never_idle_trims_every_interval():
    policy = TrimPolicy(interval_s=10, idle_s=1)
    assert ticks(policy, 0, 41, busy=True) == [10.0, 20.0, 30.0, 40.0]


def test_a_short_quiet_moment_does_not_trim():
    policy = TrimPolicy(interval_s=100, idle_s=2)
    trims = []
    for now, busy in [(0, True), (0.5, False), (1.0, False), (1.5, True), (2.0, False)]:
        if policy.tick(now, busy):
            trims.append(now)
    assert trims == []  # never 2 s quiet in a row


def test_the_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval_s must be > 0, got 0"):
        TrimPolicy(interval_s=0)


# -- the driver ------------------------------------------------------------------------------


@dataclass
class Clocks:
    now_s: float = 0.0
    cpu_s: float = 0.0
    rss: int = 500 * 2**20

    def clock(self) -> float:
        return self.now_s

    def cpu(self) -> float:
        return self.cpu_s


def make_driver(clocks: Clocks, lib: FakeLib, trim_cost_s: float = 0.0) -> TrimDriver:
    malloc = GlibcMalloc(lib)
    real_trim = malloc.trim

    def trim() -> bool:  # a trim that takes CPU and time, and frees 100 MiB
        clocks.now_s += trim_cost_s
        clocks.cpu_s += trim_cost_s
        clocks.rss -= 100 * 2**20
        return real_trim()

    malloc.trim = trim  # type: ignore[method-assign]
    return TrimDriver(
        malloc,
        TrimPolicy(interval_s=30, idle_s=1),
        tick_s=0.5,
        clock=clocks.clock,
        cpu_s=clocks.cpu,
        rss=lambda: clocks.rss,
    )


def test_the_driver_trims_when_cpu_use_stops_and_records_it():
    clocks, lib = Clocks(), FakeLib()
    driver = make_driver(clocks, lib, trim_cost_s=0.02)
    for _ in range(10):  # busy: a whole core
        clocks.now_s += 0.5
        clocks.cpu_s += 0.5
        assert driver.step() is None
    records = []
    for _ in range(20):  # quiet: 1 ms of CPU per tick (under 5 % of a core)
        clocks.now_s += 0.5
        clocks.cpu_s += 0.001
        record = driver.step()
        if record is not None:
            records.append(record)
    assert lib.trims == 1  # the trim's own 20 ms of CPU did not count as work
    (record,) = records
    assert record.rss_before_bytes - record.rss_after_bytes == 100 * 2**20
    assert record.took_s == pytest.approx(0.02)
    assert record.at_s == pytest.approx(5.0 + 1.5)  # first quiet tick at 5.5, + idle_s
    assert driver.records == [record]


def test_the_driver_waits_while_a_load_is_measured():
    clocks, lib = Clocks(), FakeLib()
    driver = make_driver(clocks, lib)
    for _ in range(4):  # busy
        clocks.now_s += 0.5
        clocks.cpu_s += 0.5
        driver.step()
    with footprint.measuring():
        assert footprint.measuring_now()
        for _ in range(10):  # quiet, but a model's footprint is being measured
            clocks.now_s += 0.5
            assert driver.step() is None
    assert not footprint.measuring_now()
    assert lib.trims == 0
    clocks.now_s += 0.5
    assert driver.step() is not None  # the trim it owed, at the first tick after the window
    assert lib.trims == 1


def test_the_driver_thread_starts_and_stops():
    lib = FakeLib()
    driver = TrimDriver(GlibcMalloc(lib), TrimPolicy(interval_s=30), tick_s=0.01).start()
    assert driver._thread is not None and driver._thread.is_alive()
    driver.stop()
    assert not driver._thread.is_alive()


# -- the wrapper -----------------------------------------------------------------------------


def test_tune_malloc_sets_what_is_not_zero():
    lib = FakeLib()
    applied = tune_malloc(MallocTuning(arena_max=2, mmap_threshold_bytes=2**20), GlibcMalloc(lib))
    assert applied == ["M_MMAP_THRESHOLD=1048576", "M_ARENA_MAX=2"]
    assert lib.mallopts == [(M_MMAP_THRESHOLD, 2**20), (M_ARENA_MAX, 2)]
    lib = FakeLib()
    assert tune_malloc(MallocTuning(arena_max=0, mmap_threshold_bytes=0), GlibcMalloc(lib)) == []
    assert lib.mallopts == []


def test_tune_malloc_is_a_no_op_without_glibc_and_warns_when_refused(caplog):
    assert tune_malloc(MallocTuning(arena_max=2), None) == []
    with caplog.at_level(logging.WARNING, logger=memory.__name__):
        assert tune_malloc(MallocTuning(arena_max=2), GlibcMalloc(FakeLib(accept=False))) == []
    assert "mallopt(M_ARENA_MAX, 2) was refused" in caplog.text


def test_load_is_none_off_glibc_or_with_another_allocator(monkeypatch):
    assert GlibcMalloc.load({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}) is None
    monkeypatch.setattr(memory.platform, "libc_ver", lambda: ("", ""))
    assert GlibcMalloc.load({}) is None  # musl
    monkeypatch.setattr(memory.sys, "platform", "darwin")
    assert GlibcMalloc.load({}) is None


@dataclass(frozen=True)
class Settings:
    malloc_arena_max: int = 2
    malloc_mmap_threshold_bytes: int = 2**20
    memory_trim_interval_s: float = 30.0


def test_start_memory_care_on_and_off(monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    lib = FakeLib()
    care = start_memory_care(Settings(), GlibcMalloc(lib))
    try:
        assert care.applied == ["M_MMAP_THRESHOLD=1048576", "M_ARENA_MAX=2"]
        assert care.driver is not None and care.driver._thread is not None
        assert care.driver._thread.is_alive()
    finally:
        care.stop()
    off = start_memory_care(Settings(0, 0, 0.0), GlibcMalloc(FakeLib()))
    assert off.applied == [] and off.driver is None
    off.stop()
    none = start_memory_care(Settings(), None)  # not glibc: nothing at all
    assert none.applied == [] and none.driver is None
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == memory.ONEDNN_CACHE_DEFAULT


def test_the_operators_onednn_cache_capacity_wins(monkeypatch):
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")
    start_memory_care(Settings(0, 0, 0.0), None).stop()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "1024"


glibc = pytest.mark.skipif(
    GlibcMalloc.load() is None, reason="glibc malloc only (Linux with glibc, nothing preloaded)"
)


@glibc
def test_the_real_glibc_accepts_the_settings_and_trim_returns_freed_pages():
    # In a child process: 200 MiB of small blocks, all freed but the last (which pins the top
    # of the heap, so free() cannot shrink it); only malloc_trim gives the pages back.
    code = textwrap.dedent(
        """
        import ctypes
        from gpuserve.server.memory import GlibcMalloc, MallocTuning, rss_bytes, tune_malloc
        malloc = GlibcMalloc.load()
        print(tune_malloc(MallocTuning(arena_max=2, mmap_threshold_bytes=2**20), malloc))
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
        blocks = [libc.malloc(4096) for _ in range(50_000)]
        for block in blocks:
            ctypes.memset(block, 1, 4096)
        for block in blocks[:-1]:
            libc.free(block)
        before = rss_bytes()
        malloc.trim()
        print(before - rss_bytes())
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    applied, released = result.stdout.split("\n")[:2]
    assert applied == "['M_MMAP_THRESHOLD=1048576', 'M_ARENA_MAX=2']"
    assert int(released) > 150 * 2**20
