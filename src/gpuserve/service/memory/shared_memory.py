"""Registry of client system (POSIX) shared-memory regions (Triton's shared-memory extension).

A client creates a region (``/dev/shm/<key>``, e.g. with ``tritonclient.utils.shared_memory``)
and registers it under a name with an offset and a byte size; requests then name the region,
an offset into it and a byte size per input or output instead of carrying the bytes.

The registry maps each region once (``mmap`` of ``/dev/shm/<key>``) and hands out zero-copy
views. Every bound is checked before any byte is read or written: a bad name, offset or size
is refused with :class:`~gpuserve.errors.InvalidInputError` (HTTP 400, gRPC
INVALID_ARGUMENT) whose message names the region, the offset and the sizes; nothing crashes.

The codecs receive the registry through the small :class:`SharedMemoryReader` interface, as
they receive ``limits``, so they stay pure. The front ends hold one registry per server (the
inference service's, when client shared memory is allowed) and call it on the event loop.

Unregistering a region that a request in flight still reads or writes is safe: the request
holds a view, which keeps the mapping alive until the request ends (the mapping is closed when
the last view goes).

:class:`~gpuserve.service.memory.cuda_shared_memory.CudaSharedMemoryRegistry` (re-exported here) holds
the CUDA regions. System and CUDA region names share one namespace, as in Triton, and the
codecs reach both through this registry's :meth:`SharedMemoryRegistry.view`: a CUDA region's
range comes back as a :class:`~gpuserve.service.memory.cuda_shared_memory.DeviceRange`, which the
codecs use as they use a view (``toreadonly()`` for an input copies it device -> host once;
slice assignment for an output copies it host -> device once).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast

from gpuserve.errors import InvalidInputError
from gpuserve.service.memory.cuda_shared_memory import (
    CudaRegionStatus,
    CudaSharedMemoryRegistry,
    DeviceRange,
)

__all__ = [
    "SHM_ROOT",
    "CudaRegionStatus",
    "CudaSharedMemoryRegistry",
    "DeviceRange",
    "RegionStatus",
    "SharedMemoryReader",
    "SharedMemoryRegistry",
]

#: Where POSIX shared-memory objects live on Linux (``shm_open(key)`` is ``/dev/shm/key``).
SHM_ROOT = Path("/dev/shm")


class SharedMemoryReader(Protocol):
    """What a codec needs: views of registered regions, bounds-checked."""

    def view(self, name: str, offset: int, byte_size: int) -> memoryview:
        """Bytes ``[offset, offset + byte_size)`` of region ``name`` (relative to its
        registered offset), zero-copy and writable.

        Raises:
            InvalidInputError: unknown region, or the range falls outside it.
        """
        ...


@dataclass(frozen=True, slots=True)
class RegionStatus:
    """One registered region, as the status API reports it.

    Attributes:
        name: The name the client registered it under.
        key: The POSIX shared-memory key (``/dev/shm/<key>``, leading ``/`` optional).
        offset: Start of the region within the shared-memory object, bytes.
        byte_size: Length of the region, bytes.
    """

    name: str
    key: str
    offset: int
    byte_size: int


@dataclass(slots=True)
class _Region:
    status: RegionStatus
    mapping: mmap.mmap


def _shm_path(key: str) -> Path:
    bare = key[1:] if key.startswith("/") else key
    if not bare or "/" in bare or bare in (".", ".."):
        raise InvalidInputError(f"shared-memory key {key!r} is not a valid POSIX shm name")
    return SHM_ROOT / bare


class SharedMemoryRegistry:
    """Registered system shared-memory regions by name (thread-safe).

    Args:
        root: Folder of the shared-memory objects (``/dev/shm``; a temporary folder in tests).
        cuda: The server's CUDA regions, which share this registry's namespace and are
            reached through :meth:`view` too; None: system regions only.
    """

    def __init__(
        self, root: Path | None = None, cuda: CudaSharedMemoryRegistry | None = None
    ) -> None:
        self.root = root
        self.cuda = cuda
        self._regions: dict[str, _Region] = {}
        self._lock = threading.Lock()
        if cuda is not None:
            cuda.names_in_use = self.has

    def has(self, name: str) -> bool:
        """Whether ``name`` is a registered system region."""
        return name in self._regions

    def _path(self, key: str) -> Path:
        path = _shm_path(key)
        return path if self.root is None else self.root / path.name

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Map ``byte_size`` bytes at ``offset`` of shared-memory object ``key`` as ``name``.

        Raises:
            InvalidInputError: name already registered, negative offset or size, no such
                object, or the object is smaller than ``offset + byte_size``.
        """
        if not name:
            raise InvalidInputError("shared-memory region name must not be empty")
        if offset < 0 or byte_size < 0:  # Triton's words first (its qa tests compare them)
            raise InvalidInputError(
                f"failed to register shared memory region '{name}': invalid args (offset "
                f"{offset} and byte_size {byte_size} must be non-negative)"
            )
        path = self._path(key)
        with self._lock:
            if name in self._regions or (self.cuda is not None and self.cuda.has(name)):
                raise InvalidInputError(
                    f"shared memory region '{name}' already in manager (it is registered; "
                    "unregister it first)"
                )
            try:
                # never through a symbolic link: a client must not make the server map a
                # file it could not open itself
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
            except OSError as err:
                raise InvalidInputError(  # Triton's words first
                    f"Unable to open shared memory region: '{key}' (region {name!r}: cannot "
                    f"open key {key!r}: {err.strerror})"
                ) from None
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode):
                    raise InvalidInputError(
                        f"shared-memory region {name!r}: key {key!r} is not a shared-memory object"
                    )
                size = info.st_size
                if offset + byte_size > size:
                    raise InvalidInputError(
                        f"failed to register shared memory region '{name}': invalid args "
                        f"(offset {offset} + byte_size {byte_size} exceeds the size {size} "
                        f"of key {key!r})"
                    )
                mapping = mmap.mmap(fd, size) if size else mmap.mmap(-1, 1)
            finally:
                os.close(fd)
            self._regions[name] = _Region(RegionStatus(name, key, offset, byte_size), mapping)

    def unregister(self, name: str | None = None) -> None:
        """Forget region ``name``, or every region when ``name`` is None or empty (as
        Triton's API). Unknown names are ignored, as in Triton.

        A mapping still viewed by a request in flight stays alive until that request ends.
        """
        with self._lock:
            names = [name] if name else list(self._regions)
            for key in names:
                region = self._regions.pop(key, None)
                if region is not None:
                    # A view still alive keeps the mapping open; the GC closes it after.
                    with contextlib.suppress(BufferError):
                        region.mapping.close()

    def status(self, name: str | None = None) -> list[RegionStatus]:
        """The registered regions, or just ``name``.

        Raises:
            InvalidInputError: ``name`` is given and not registered.
        """
        with self._lock:
            if not name:
                return [r.status for r in self._regions.values()]
            region = self._regions.get(name)
        if region is None:
            raise InvalidInputError(f"Unable to find system shared memory region: {name!r}")
        return [region.status]

    def view(self, name: str, offset: int, byte_size: int) -> memoryview:
        """See :meth:`SharedMemoryReader.view`; a CUDA region's range is a
        :class:`~gpuserve.service.memory.cuda_shared_memory.DeviceRange` (what the codecs call on a
        view, it has: ``toreadonly()`` and slice assignment)."""
        region = self._regions.get(name)
        if region is None and self.cuda is not None:
            device = self.cuda.device_range(name, offset, byte_size)
            if device is not None:
                return cast(memoryview, device)
        if region is None:
            raise InvalidInputError(f"Unable to find system shared memory region: {name!r}")
        limit = region.status.byte_size
        if offset < 0 or byte_size < 0 or offset + byte_size > limit:
            raise InvalidInputError(
                f"shared-memory region {name!r}: offset {offset} + byte_size {byte_size} "
                f"is outside the region's registered byte_size {limit}"
            )
        start = region.status.offset + offset
        try:
            return memoryview(region.mapping)[start : start + byte_size]
        except ValueError:  # closed by an unregister from another thread meanwhile
            raise InvalidInputError(
                f"Unable to find system shared memory region: {name!r}"
            ) from None

    def close(self) -> None:
        """Unregister every region, CUDA regions too (server shutdown)."""
        self.unregister(None)
        if self.cuda is not None:
            self.cuda.close()
