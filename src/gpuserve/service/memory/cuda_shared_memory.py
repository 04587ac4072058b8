"""Registry of client CUDA shared-memory regions (Triton's CUDA shared-memory extension).

A client registers a device allocation under a name with its ``cudaIpcMemHandle_t`` (64
bytes), its device and a byte size; requests then name the region, an offset into it and a
byte size per input or output instead of carrying the bytes. The registry opens each handle
once through a :class:`~gpuserve.service.memory.cuda_ipc.CudaIpcDriver` and closes it when the region
is unregistered.

gpuserve's engine hands host arrays to the backends, so an input is copied device -> host once
(into a fresh host buffer the request owns) and an output host -> device once, straight from the
encoded array; :meth:`CudaSharedMemoryRegistry.tensor` is the no-copy path (a torch tensor
aliasing the client's memory) for a torch backend on the same device.

The driver is the CUDA runtime (:func:`~gpuserve.service.memory.cuda_ipc.load_cuda_driver`) where torch
sees a CUDA device, resolved at the first registration; a test or an embedding application
sets :attr:`CudaSharedMemoryRegistry.driver` (e.g. a fake over host memory) before that. On a
server without CUDA, status and unregister answer (nothing is registered) and registration is
refused with a message that says why and what to use instead.

Every bound is checked before a byte moves: a bad name, handle, device, offset or size is
refused with :class:`~gpuserve.errors.InvalidInputError` (HTTP 400, gRPC INVALID_ARGUMENT)
naming the region and the values; a failed CUDA call is refused the same way with the CUDA
error string; nothing crashes. Unregistering a region that a request in flight still uses is
safe: the request holds a lease on the region and the handle is closed when the last lease goes
(a lease is given back when its range is used, or when a request that failed before using it
is collected).

The copies run on the calling thread (the event loop, when the codecs decode and encode): they
are synchronous ``cudaMemcpyAsync`` + stream waits of the tensor's bytes, short next to a batch.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuserve.errors import InvalidInputError
from gpuserve.service.memory.cuda_ipc import (
    IPC_HANDLE_BYTES,
    CudaIpcDriver,
    CudaIpcError,
    CudaIpcUnavailable,
    DeviceMapping,
    load_cuda_driver,
)

logger = logging.getLogger(__name__)

#: What a refused registration tells the client to use instead.
USE_SYSTEM = "register system shared memory instead (tritonclient.utils.shared_memory)"


@dataclass(frozen=True, slots=True)
class CudaRegionStatus:
    """One registered CUDA shared-memory region, as the status API reports it.

    Attributes:
        name: The name the client registered it under.
        device_id: The CUDA device of the allocation.
        byte_size: Length of the region, bytes.
    """

    name: str
    device_id: int
    byte_size: int


@dataclass(slots=True)
class _Region:
    status: CudaRegionStatus
    mapping: DeviceMapping
    leases: int = 0
    retired: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class DeviceRange:
    """``byte_size`` bytes at ``offset`` of a registered CUDA region, as the codecs use a
    region view: :meth:`toreadonly` for an input (copies the bytes to the host) and slice
    assignment for an output (copies the bytes to the device). It holds a lease on the region
    until it is used once (or dropped), so an unregister meanwhile does not close the handle
    under it.
    """

    def __init__(
        self, registry: CudaSharedMemoryRegistry, region: _Region, offset: int, byte_size: int
    ) -> None:
        self.name = region.status.name
        self.offset = offset
        self.byte_size = byte_size
        self._registry = registry
        self._region = region
        self._release = weakref.finalize(self, registry._release, region)

    def __len__(self) -> int:
        return self.byte_size

    @property
    def nbytes(self) -> int:
        """The range's length, bytes."""
        return self.byte_size

    def _check_leased(self) -> None:
        if not self._release.alive:  # used once already: its handle may be closed since
            raise InvalidInputError(
                f"CUDA shared-memory region {self.name!r}: this range was already used"
            )

    def toreadonly(self) -> memoryview:
        """The range's bytes, copied device -> host into a new buffer (read-only view)."""
        self._check_leased()
        try:
            host = self._registry._read(self._region, self.offset, self.byte_size)
            return host.data.toreadonly()
        finally:
            self._release()

    def __setitem__(self, index: slice, data: Any) -> None:
        """Copy ``data`` (bytes or a byte memoryview) to ``[index.start, index.stop)`` of the
        range on the device.

        Raises:
            InvalidInputError: the slice is not a plain slice inside the range, or its length
                is not the length of ``data``.
        """
        self._check_leased()
        try:
            start, stop, step = index.indices(self.byte_size)
            payload = np.frombuffer(data, dtype=np.uint8)
            if step != 1 or stop - start != payload.size:
                raise InvalidInputError(
                    f"CUDA shared-memory region {self.name!r}: cannot write {payload.size} "
                    f"bytes to [{start}, {stop}) of a {self.byte_size}-byte range"
                )
            self._registry._write(self._region, self.offset + start, payload)
        finally:
            self._release()


class CudaSharedMemoryRegistry:
    """Registered CUDA shared-memory regions by name (thread-safe).

    Args:
        driver: The CUDA IPC driver; None: the CUDA runtime where torch sees a device (found
            at the first registration), else registration is refused.
        cuda_available: Whether this process sees a CUDA device; None: asked of torch. False
            refuses registration without importing torch; True with no loadable driver refuses
            it saying gpuserve does not open CUDA IPC handles here.

    Attributes:
        driver: The driver in use (settable before the first registration, e.g. by a test).
        names_in_use: Asked whether a name is taken elsewhere (the system shared-memory
            registry: the two share one namespace, as in Triton); None: nothing else.
    """

    def __init__(
        self, driver: CudaIpcDriver | None = None, *, cuda_available: bool | None = None
    ) -> None:
        self.driver = driver
        self.names_in_use: Callable[[str], bool] | None = None
        self._cuda = cuda_available
        self._unavailable: str | None = None
        self._regions: dict[str, _Region] = {}
        self._lock = threading.Lock()

    @property
    def cuda_available(self) -> bool:
        """Whether this process sees a CUDA device (or a driver was given)."""
        if self.driver is not None:
            return True
        if self._cuda is None:
            try:
                import torch

                self._cuda = bool(torch.cuda.is_available())
            except Exception:  # torch missing or broken: no device to talk about
                self._cuda = False
        return self._cuda

    def _driver(self) -> CudaIpcDriver | None:
        """The driver, loaded at the first call where CUDA is there; None (and the reason in
        ``_unavailable``) where it is not."""
        if self.driver is None and self._unavailable is None:
            if not self.cuda_available:
                self._unavailable = "this server has no CUDA device"
            else:
                try:
                    self.driver = load_cuda_driver()
                except (CudaIpcUnavailable, CudaIpcError, OSError) as err:
                    self._unavailable = f"gpuserve does not open CUDA IPC handles here ({err})"
                    logger.warning("CUDA shared memory is off: %s", err)
        return self.driver

    def check_available(self, name: str, device_id: int, byte_size: int) -> CudaIpcDriver:
        """The driver, or the refusal of a registration on a server without CUDA IPC.

        Raises:
            InvalidInputError: no CUDA IPC here; says why and to use system shared memory.
        """
        driver = self._driver()
        if driver is None:
            raise InvalidInputError(
                f"cannot register CUDA shared-memory region {name!r} (device {device_id}, "
                f"{byte_size} bytes): {self._unavailable}; {USE_SYSTEM}"
            )
        return driver

    def has(self, name: str) -> bool:
        """Whether ``name`` is a registered CUDA region."""
        return name in self._regions

    def register(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        """Open the client allocation ``raw_handle`` names on ``device_id`` as ``name``.

        Args:
            name: The region's name (unique among system and CUDA regions).
            raw_handle: The 64 bytes of the client's ``cudaIpcMemHandle_t``.
            device_id: The device the allocation is on.
            byte_size: The region's length, bytes (> 0, within the allocation).

        Raises:
            InvalidInputError: no CUDA IPC on this server, an empty or taken name, a handle
                that is not 64 bytes, a device this server does not see, a byte size of 0 or
                past the allocation, or a handle the CUDA runtime cannot open.
        """
        driver = self.check_available(name, device_id, byte_size)
        what = f"failed to register CUDA shared-memory region {name!r}"
        if not name:
            raise InvalidInputError("CUDA shared-memory region name must not be empty")
        if byte_size <= 0:
            raise InvalidInputError(f"{what}: byte_size must be > 0, got {byte_size}")
        if len(raw_handle) != IPC_HANDLE_BYTES:
            raise InvalidInputError(
                f"{what}: raw_handle must be the {IPC_HANDLE_BYTES} bytes of a "
                f"cudaIpcMemHandle_t, got {len(raw_handle)} bytes"
            )
        count = driver.device_count()
        if not 0 <= device_id < count:
            raise InvalidInputError(
                f"{what}: device_id {device_id} does not exist (this server sees {count} CUDA "
                f"device{'' if count == 1 else 's'}: expected 0..{count - 1})"
            )
        with self._lock:
            taken = self.names_in_use is not None and self.names_in_use(name)
            if name in self._regions or taken:
                raise InvalidInputError(
                    f"shared memory region {name!r} already in manager; unregister it first"
                )
            try:
                mapping = driver.open_mem_handle(bytes(raw_handle), device_id)
            except CudaIpcError as err:
                raise InvalidInputError(
                    f"{what}: cannot open the CUDA IPC handle on device {device_id} ({err})"
                ) from None
            size = mapping.allocation_bytes
            if size is not None and byte_size > size:
                self._close(mapping)
                raise InvalidInputError(
                    f"{what}: byte_size {byte_size} exceeds the {size} bytes of the "
                    f"allocation the handle names"
                )
            status = CudaRegionStatus(name, device_id, byte_size)
            self._regions[name] = _Region(status, mapping)

    def _close(self, mapping: DeviceMapping) -> None:
        driver = self.driver
        if driver is None:
            return
        try:
            driver.close_mem_handle(mapping)
        except CudaIpcError as err:  # the client may have freed it: nothing left to do
            logger.warning("closing a CUDA IPC handle failed: %s", err)

    def _release(self, region: _Region) -> None:
        with region.lock:
            region.leases -= 1
            close = region.retired and region.leases == 0
        if close:
            self._close(region.mapping)

    def unregister(self, name: str | None = None) -> None:
        """Forget region ``name``, or every region when ``name`` is None or empty, and close
        their handles (once no request in flight uses them). Unknown names are ignored, as in
        Triton."""
        with self._lock:
            names = [name] if name else list(self._regions)
            gone = [self._regions.pop(key) for key in names if key in self._regions]
        for region in gone:
            with region.lock:
                region.retired = True
                close = region.leases == 0
            if close:
                self._close(region.mapping)

    def status(self, name: str | None = None) -> list[CudaRegionStatus]:
        """The registered regions, or just ``name``.

        Raises:
            InvalidInputError: ``name`` is given and not registered.
        """
        with self._lock:
            if not name:
                return [r.status for r in self._regions.values()]
            region = self._regions.get(name)
        if region is None:
            raise InvalidInputError(f"Unable to find cuda shared memory region: {name!r}")
        return [region.status]

    def device_range(self, name: str, offset: int, byte_size: int) -> DeviceRange | None:
        """A leased range of region ``name`` (relative to its start); None when ``name`` is
        not a CUDA region.

        Raises:
            InvalidInputError: the range falls outside the region.
        """
        with self._lock:
            region = self._regions.get(name)
            if region is None:
                return None
            limit = region.status.byte_size
            if offset < 0 or byte_size < 0 or offset + byte_size > limit:
                raise InvalidInputError(
                    f"shared-memory region {name!r}: offset {offset} + byte_size {byte_size} "
                    f"is outside the region's registered byte_size {limit}"
                )
            with region.lock:
                region.leases += 1
        return DeviceRange(self, region, offset, byte_size)

    def _range(self, name: str, offset: int, byte_size: int) -> DeviceRange:
        found = self.device_range(name, offset, byte_size)
        if found is None:
            raise InvalidInputError(f"Unable to find cuda shared memory region: {name!r}")
        return found

    def read(self, name: str, offset: int, byte_size: int) -> np.ndarray:
        """Bytes ``[offset, offset + byte_size)`` of region ``name``, copied to the host.

        Returns:
            uint8 [byte_size], a new host buffer.

        Raises:
            InvalidInputError: unknown region, a range outside it, or a failed copy.
        """
        leased = self._range(name, offset, byte_size)
        try:
            return self._read(leased._region, offset, byte_size)
        finally:
            leased._release()

    def write(self, name: str, offset: int, data: bytes | np.ndarray) -> None:
        """Copy ``data`` to ``offset`` bytes into region ``name`` on its device.

        Raises:
            InvalidInputError: unknown region, a range outside it, or a failed copy.
        """
        if isinstance(data, bytes):
            payload = np.frombuffer(data, np.uint8)
        else:
            payload = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        self._range(name, offset, payload.size)[0 : payload.size] = payload.data

    def tensor(self, name: str, offset: int, byte_size: int) -> Any:
        """A torch uint8 [byte_size] tensor on the region's device aliasing the client's
        memory (no copy); valid while the region stays registered.

        Raises:
            InvalidInputError: unknown region, a range outside it, or no torch view.
        """
        leased = self._range(name, offset, byte_size)
        try:
            assert self.driver is not None  # a region exists, so a driver opened it
            return self.driver.tensor_view(leased._region.mapping, offset, byte_size)
        except (CudaIpcError, CudaIpcUnavailable) as err:
            raise InvalidInputError(
                f"CUDA shared-memory region {name!r}: no device tensor view ({err})"
            ) from None
        finally:
            leased._release()

    def _read(self, region: _Region, offset: int, byte_size: int) -> np.ndarray:
        out = np.empty(byte_size, dtype=np.uint8)
        assert self.driver is not None
        try:
            self.driver.copy_to_host(region.mapping, offset, out)
        except CudaIpcError as err:
            raise InvalidInputError(
                f"CUDA shared-memory region {region.status.name!r}: reading offset {offset} + "
                f"byte_size {byte_size} failed ({err})"
            ) from None
        return out

    def _write(self, region: _Region, offset: int, payload: np.ndarray) -> None:
        assert self.driver is not None
        try:
            self.driver.copy_to_device(region.mapping, offset, payload)
        except CudaIpcError as err:
            raise InvalidInputError(
                f"CUDA shared-memory region {region.status.name!r}: writing {payload.size} "
                f"bytes at offset {offset} failed ({err})"
            ) from None

    def close(self) -> None:
        """Unregister every region (server shutdown)."""
        self.unregister(None)
