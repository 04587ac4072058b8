"""What the CPU offers: its instruction sets (the probe behind ``precision: bf16`` on a CPU),
and the cores and compute threads this process has (:func:`usable_cpus`,
:func:`compute_threads`).

bf16 on a CPU runs at its speed only on cores with bf16 dot products (AVX-512 BF16, or AMX
tiles on recent Xeons); elsewhere torch emulates it, slower than fp32. So a CPU instance
with ``bf16`` on a core without them is refused at load, with the missing instruction set
named, rather than served slower than the precision it replaces. ``int8`` still runs on a
core without int8 dot products (VNNI, AMX), where it is often no faster than fp32: that
load logs a warning naming the missing instruction set.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

#: ``/proc/cpuinfo`` flags any one of which gives bf16 matrix products their speed.
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
#: Flags of the int8 dot products (VNNI, AMX); int8 runs without them, often slower than fp32.
INT8_FLAGS = ("amx_int8", "avx512_vnni", "avx_vnni")

CpuFlagProbe = Callable[[], frozenset[str]]


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The flags of the first processor in ``cpuinfo`` (Linux); empty where unreadable."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def _has_any(wanted: tuple[str, ...], probe: CpuFlagProbe | None) -> bool:
    """Whether the CPU has one of ``wanted`` (``probe`` None: :func:`cpu_flags`, looked up at
    the call)."""
    flags = (probe or cpu_flags)()
    return any(flag in flags for flag in wanted)


def bf16_refusal(probe: CpuFlagProbe | None = None) -> str | None:
    """Why bf16 cannot run at speed on this CPU, or None when it can.

    Args:
        probe: Returns the CPU's flags; None: :func:`cpu_flags`, looked up at the call (so
            tests may replace the module's ``cpu_flags``).
    """
    if _has_any(BF16_FLAGS, probe):
        return None
    return (
        "precision bf16 on a CPU needs the AVX-512 BF16 or AMX-BF16 instruction set "
        f"(cpu flag {' or '.join(BF16_FLAGS[::-1])}), which this CPU lacks; "
        "use precision fp32 (or int8)"
    )


def int8_caveat(probe: CpuFlagProbe | None = None) -> str | None:
    """Why int8 may be no faster than fp32 on this CPU, or None when it has int8 products.

    Args:
        probe: As for :func:`bf16_refusal`.
    """
    if _has_any(INT8_FLAGS, probe):
        return None
    return (
        "precision int8 on a CPU without int8 dot products (cpu flag "
        f"{', '.join(INT8_FLAGS[::-1])}): its int8 kernels widen every product in software "
        "and may run slower than fp32 here; compare the two with benchmarks/precision.py "
        "or gpuserve tune"
    )


def require_cpu_precision(precision: str, probe: CpuFlagProbe | None = None) -> None:
    """Refuse a CPU precision the cores cannot run at speed; warn of one that may be slow.

    Raises:
        ValueError: ``bf16`` without :data:`BF16_FLAGS`, naming the instruction set.
            (``int8`` without :data:`INT8_FLAGS` loads, with :func:`int8_caveat` logged.)
    """
    if precision == "bf16":
        reason = bf16_refusal(probe)
        if reason is not None:
            raise ValueError(reason)
    elif precision == "int8":
        caveat = int8_caveat(probe)
        if caveat is not None:
            logger.warning(caveat)


def usable_cpu_set() -> frozenset[int]:
    """The cores this process may run on (its affinity); empty where the OS does not say."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return frozenset()


def usable_cpus() -> int:
    """How many cores this process may run on (:func:`usable_cpu_set`, else the CPU count)."""
    return len(usable_cpu_set()) or os.cpu_count() or 1


def compute_threads() -> int:
    """Threads a CPU model computes its operators with: torch's (``OMP_NUM_THREADS`` or the
    physical cores) when torch is loaded, else every usable core (what ONNX Runtime and most
    runtimes take by default); torch is not imported for this."""
    torch = sys.modules.get("torch")
    if torch is None:
        return usable_cpus()
    return int(torch.get_num_threads())
