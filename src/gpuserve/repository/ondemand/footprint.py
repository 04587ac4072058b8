"""What a model holds in memory, measured around its load and warm-up (approximate).

The process's resident anonymous host memory (RSS less its file-backed pages) and, when
PyTorch has initialised CUDA, the memory PyTorch has allocated on each GPU are read before and
after a model loads; the difference is the model's footprint. It is approximate: anything
else the process allocates or frees while the model loads counts too (loads on demand run one
at a time, which keeps that small), host memory the allocator keeps after a free is not
returned, and memory outside PyTorch's allocator (ONNX Runtime on CUDA) is not seen on the GPU
side.

Three things would make a load look smaller than it is (and let one model too many in under
a memory limit), and are kept out of the window: file-backed pages the kernel reclaims
meanwhile (shared libraries' cold pages under page-cache reclaim or DAMON's pageout: a 40 MB
model measured 0), left out by counting anonymous memory only (:func:`host_rss_bytes`);
garbage of earlier work that a collection during the load frees, collected first by
:func:`collect_garbage`; and the server's ``malloc_trim`` thread, which asks
:func:`measuring_now` and waits while a load is measured.

A model whose instances run on GPUs is measured by its GPU memory per device, a CPU model by
host memory (key ``cpu``).
"""

from __future__ import annotations

import gc
import os
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

from gpuserve.repository.ondemand.residency import HOST


def host_rss_bytes() -> int:
    """The process's resident anonymous host memory (``resident - shared`` of
    ``/proc/self/statm``: the heap, the mappings of large arrays, tensors), bytes; 0 where it
    cannot be read.

    File-backed resident pages (shared libraries, memory-mapped files) are left out: the
    kernel drops and re-reads them at will (page-cache reclaim, DAMON's proactive pageout),
    so they move by tens of MB while a model loads and have nothing to do with it; a 40 MB
    model measured 0 when cold library pages were reclaimed during its load. A model whose
    weights stay memory-mapped from their file is counted by what it copied out of them.
    """
    try:
        with open("/proc/self/statm", "rb") as statm:
            fields = statm.read().split()
        resident_pages, shared_pages = int(fields[1]), int(fields[2])
        return max(0, resident_pages - shared_pages) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        try:
            import resource

            # ru_maxrss is the peak (KiB on Linux): an upper bound where statm is missing
            return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        except (ImportError, OSError):
            return 0


def gpu_allocated_bytes() -> dict[str, int]:
    """Bytes PyTorch has allocated per CUDA device (``cuda:<n>``); empty without CUDA in use."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    return {
        f"cuda:{i}": int(torch.cuda.memory_allocated(i)) for i in range(torch.cuda.device_count())
    }


_measuring = 0
_measuring_lock = threading.Lock()


def measuring_now() -> bool:
    """Whether a load is being measured now (memory trims wait meanwhile)."""
    return _measuring > 0


def collect_garbage() -> None:
    """Collect the cyclic garbage there is now, before a measured load (blocking: ~0.1 s in a
    large heap, so run it off the event loop)."""
    gc.collect()


@contextmanager
def measuring() -> Iterator[None]:
    """The window of one measured load: :func:`measuring_now` answers True until it closes."""
    global _measuring
    with _measuring_lock:
        _measuring += 1
    try:
        yield
    finally:
        with _measuring_lock:
            _measuring -= 1


def sample() -> dict[str, int]:
    """Host RSS (``cpu``) and GPU memory per device now, bytes."""
    return {HOST: host_rss_bytes(), **gpu_allocated_bytes()}


def footprint(
    before: Mapping[str, int], after: Mapping[str, int], devices: Iterable[str]
) -> dict[str, int]:
    """A model's memory by device from samples around its load.

    Args:
        before / after: :func:`sample` before and after the load and warm-up.
        devices: The devices its instances run on (``cpu``, ``cuda:0``, ...).

    Returns:
        GPU bytes per GPU device it uses when it has one, else host bytes under ``cpu``
        (never negative).
    """
    gpus = sorted({d for d in devices if d.startswith("cuda")})
    keys = [d if ":" in d else "cuda:0" for d in gpus] or [HOST]
    return {k: max(0, after.get(k, 0) - before.get(k, 0)) for k in keys}
