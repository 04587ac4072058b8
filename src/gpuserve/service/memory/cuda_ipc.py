"""CUDA IPC: open another process's device allocation from its ``cudaIpcMemHandle_t`` and copy
bytes in and out of it (Triton's CUDA shared-memory extension).

A client allocates device memory, asks the CUDA runtime for the allocation's IPC handle (64
opaque bytes, ``cudaIpcGetMemHandle``) and registers the handle with the server; the server
opens it once (``cudaIpcOpenMemHandle``), which maps the same device memory into its own
address space, and reads inputs from it or writes outputs into it by offset.

:class:`CudaIpcDriver` is the small interface the registry
(:mod:`gpuserve.service.memory.cuda_shared_memory`) needs. :class:`CudaRuntimeDriver` implements it
with ``ctypes`` on the CUDA runtime library torch already ships (``libcudart.so.*``); it is
chosen only where ``torch.cuda.is_available()`` (:func:`load_cuda_driver`). Tests inject a fake
driver with host memory instead, so the same registry code runs on a CPU.

Copies run on a private non-blocking stream per device and wait for it, so they never queue
behind (or hold up) kernels on the legacy default stream that torch uses, and the bytes are on
the device (or the host) when a call returns: the client may read an output as soon as the
response arrives.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

logger = logging.getLogger(__name__)

#: Size of ``cudaIpcMemHandle_t`` (``CUDA_IPC_HANDLE_SIZE``), bytes.
IPC_HANDLE_BYTES = 64

_SUCCESS = 0
_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the pointers (unified addressing)
_STREAM_NON_BLOCKING = 1  # cudaStreamNonBlocking


class CudaIpcError(RuntimeError):
    """A CUDA call failed; the message names the call and the runtime's error string."""


class CudaIpcUnavailable(RuntimeError):
    """No CUDA IPC on this server (no torch, no device, or no CUDA runtime library); the
    message says which."""


@dataclass(frozen=True, slots=True)
class DeviceMapping:
    """A client allocation opened in this process.

    Attributes:
        device_id: The CUDA device of the allocation.
        pointer: Its device address in this process (the allocation's start).
        allocation_bytes: The size of the allocation the handle names, bytes; None when the
            driver cannot tell (the registered byte size is then trusted).
    """

    device_id: int
    pointer: int
    allocation_bytes: int | None


class CudaIpcDriver(Protocol):
    """What the CUDA shared-memory registry needs from CUDA. Calls may come from any thread
    (the event loop, mostly); each must be safe to call concurrently."""

    def device_count(self) -> int:
        """How many CUDA devices this process sees (valid ``device_id`` values are
        ``0 .. device_count() - 1``)."""
        ...

    def open_mem_handle(self, raw_handle: bytes, device_id: int) -> DeviceMapping:
        """Open a client's allocation.

        Args:
            raw_handle: The 64 bytes of the client's ``cudaIpcMemHandle_t``.
            device_id: The device the allocation is on.

        Raises:
            CudaIpcError: the handle cannot be opened (not a live allocation of another
                process on that device, or the device cannot be used).
        """
        ...

    def close_mem_handle(self, mapping: DeviceMapping) -> None:
        """Close what :meth:`open_mem_handle` opened (the client's memory stays allocated).

        Raises:
            CudaIpcError: the runtime refused.
        """
        ...

    def copy_to_host(self, mapping: DeviceMapping, offset: int, out: np.ndarray) -> None:
        """Copy ``out.nbytes`` bytes starting ``offset`` bytes into the allocation to ``out``
        (a C-contiguous, writable host array), and wait until they are there.

        Raises:
            CudaIpcError: the copy failed.
        """
        ...

    def copy_to_device(self, mapping: DeviceMapping, offset: int, data: np.ndarray) -> None:
        """Copy the bytes of ``data`` (a C-contiguous host array) to ``offset`` bytes into the
        allocation, and wait until they are on the device.

        Raises:
            CudaIpcError: the copy failed.
        """
        ...

    def tensor_view(self, mapping: DeviceMapping, offset: int, byte_size: int) -> Any:
        """A torch ``uint8`` tensor of ``byte_size`` bytes on the allocation's device that
        aliases the client's memory from ``offset`` (no copy): for a torch backend on the
        same device to read an input without a host round trip.

        Raises:
            CudaIpcUnavailable: torch is not there (fake drivers may raise it too).
        """
        ...


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class _DeviceBytes:
    """``byte_size`` bytes at a device address, as ``__cuda_array_interface__`` (version 3)
    describes them: what ``torch.as_tensor`` wraps without copying."""

    def __init__(self, pointer: int, byte_size: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (byte_size,),
            "typestr": "|u1",
            "data": (pointer, False),
            "version": 3,
            "strides": None,
            # no "stream": the registry's copies have finished by the time a view is made
        }


def runtime_library_candidates() -> list[str]:
    """Where ``libcudart`` may be: already loaded by torch, beside torch, in the
    nvidia-cuda-runtime package, or on the loader's path."""
    found: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if "libcudart.so" in Path(path).name and path not in found:
                    found.append(path)
    except OSError:
        pass
    try:
        import torch

        folders = [Path(torch.__file__).parent / "lib"]
        try:
            import nvidia.cuda_runtime  # type: ignore[import-not-found]

            folders.extend(Path(p) / "lib" for p in nvidia.cuda_runtime.__path__)
        except ImportError:
            pass
        for folder in folders:
            found.extend(str(p) for p in sorted(folder.glob("libcudart.so*")))
    except ImportError:
        pass
    name = ctypes.util.find_library("cudart")
    if name:
        found.append(name)
    return found


class CudaRuntimeDriver:
    """:class:`CudaIpcDriver` over the CUDA runtime (``ctypes``).

    Args:
        library: Path or name of ``libcudart``; None: the first of
            :func:`runtime_library_candidates` that loads.

    Raises:
        CudaIpcUnavailable: no CUDA runtime library loads.
    """

    def __init__(self, library: str | None = None) -> None:
        candidates = [library] if library else runtime_library_candidates()
        errors: list[str] = []
        self._rt: Any = None
        for candidate in candidates:
            try:
                self._rt = ctypes.CDLL(candidate)
                break
            except OSError as err:
                errors.append(f"{candidate}: {err}")
        if self._rt is None:
            raise CudaIpcUnavailable(
                "no CUDA runtime library (libcudart.so) could be loaded"
                + (f" ({'; '.join(errors)})" if errors else "")
            )
        rt = self._rt
        rt.cudaGetErrorString.restype = ctypes.c_char_p
        rt.cudaGetErrorString.argtypes = [ctypes.c_int]
        rt.cudaGetDeviceCount.argtypes = [ctypes.POINTER(ctypes.c_int)]
        rt.cudaSetDevice.argtypes = [ctypes.c_int]
        rt.cudaIpcOpenMemHandle.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            _IpcHandle,
            ctypes.c_uint,
        ]
        rt.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        rt.cudaMemcpyAsync.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        rt.cudaStreamCreateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        rt.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
        self._streams: dict[int, ctypes.c_void_p] = {}
        self._lock = threading.Lock()
        self._address_range: Any = None
        try:  # the driver API tells an allocation's size; optional (Triton checks it too)
            cuda = ctypes.CDLL("libcuda.so.1")
            self._address_range = cuda.cuMemGetAddressRange_v2
            self._address_range.argtypes = [
                ctypes.POINTER(ctypes.c_uint64),
                ctypes.POINTER(ctypes.c_size_t),
                ctypes.c_uint64,
            ]
        except (OSError, AttributeError) as err:
            logger.info("CUDA IPC: allocation sizes are not checked (%s)", err)

    def _check(self, status: int, call: str) -> None:
        if status != _SUCCESS:
            text = self._rt.cudaGetErrorString(status)
            message = text.decode(errors="replace") if text else "unknown error"
            raise CudaIpcError(f"{call} failed: {message} (cudaError {status})")

    def _stream(self, device_id: int) -> ctypes.c_void_p:
        """Set ``device_id`` current on this thread; its copy stream (created once)."""
        self._check(self._rt.cudaSetDevice(device_id), f"cudaSetDevice({device_id})")
        stream = self._streams.get(device_id)
        if stream is None:
            with self._lock:
                stream = self._streams.get(device_id)
                if stream is None:
                    stream = ctypes.c_void_p()
                    self._check(
                        self._rt.cudaStreamCreateWithFlags(
                            ctypes.byref(stream), _STREAM_NON_BLOCKING
                        ),
                        "cudaStreamCreateWithFlags",
                    )
                    self._streams[device_id] = stream
        return stream

    def device_count(self) -> int:
        """See :meth:`CudaIpcDriver.device_count` (0 when the runtime finds no device)."""
        count = ctypes.c_int(0)
        if self._rt.cudaGetDeviceCount(ctypes.byref(count)) != _SUCCESS:
            return 0
        return count.value

    def open_mem_handle(self, raw_handle: bytes, device_id: int) -> DeviceMapping:
        """See :meth:`CudaIpcDriver.open_mem_handle`."""
        if len(raw_handle) != IPC_HANDLE_BYTES:
            raise CudaIpcError(f"a cudaIpcMemHandle_t has {IPC_HANDLE_BYTES} bytes")
        self._check(self._rt.cudaSetDevice(device_id), f"cudaSetDevice({device_id})")
        # from_buffer_copy: reading ``handle.reserved`` would give a copy cut at the first NUL
        handle = _IpcHandle.from_buffer_copy(bytes(raw_handle))
        pointer = ctypes.c_void_p()
        self._check(
            self._rt.cudaIpcOpenMemHandle(ctypes.byref(pointer), handle, _LAZY_ENABLE_PEER_ACCESS),
            "cudaIpcOpenMemHandle",
        )
        address = int(pointer.value or 0)
        return DeviceMapping(device_id, address, self._allocation_bytes(address))

    def _allocation_bytes(self, address: int) -> int | None:
        if self._address_range is None:
            return None
        base = ctypes.c_uint64(0)
        size = ctypes.c_size_t(0)
        status = self._address_range(ctypes.byref(base), ctypes.byref(size), address)
        if status != _SUCCESS:
            logger.info("CUDA IPC: cuMemGetAddressRange failed (CUresult %d)", status)
            return None
        return int(size.value) - (address - int(base.value))

    def close_mem_handle(self, mapping: DeviceMapping) -> None:
        """See :meth:`CudaIpcDriver.close_mem_handle`."""
        self._check(self._rt.cudaSetDevice(mapping.device_id), "cudaSetDevice")
        self._check(
            self._rt.cudaIpcCloseMemHandle(ctypes.c_void_p(mapping.pointer)),
            "cudaIpcCloseMemHandle",
        )

    def _copy(self, device_id: int, destination: int, source: int, byte_size: int) -> None:
        if not byte_size:
            return
        stream = self._stream(device_id)
        self._check(
            self._rt.cudaMemcpyAsync(
                ctypes.c_void_p(destination),
                ctypes.c_void_p(source),
                byte_size,
                _MEMCPY_DEFAULT,
                stream,
            ),
            "cudaMemcpyAsync",
        )
        self._check(self._rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")

    def copy_to_host(self, mapping: DeviceMapping, offset: int, out: np.ndarray) -> None:
        """See :meth:`CudaIpcDriver.copy_to_host`."""
        self._copy(mapping.device_id, out.ctypes.data, mapping.pointer + offset, out.nbytes)

    def copy_to_device(self, mapping: DeviceMapping, offset: int, data: np.ndarray) -> None:
        """See :meth:`CudaIpcDriver.copy_to_device`."""
        self._copy(mapping.device_id, mapping.pointer + offset, data.ctypes.data, data.nbytes)

    def tensor_view(self, mapping: DeviceMapping, offset: int, byte_size: int) -> Any:
        """See :meth:`CudaIpcDriver.tensor_view`."""
        import torch

        return torch.as_tensor(
            _DeviceBytes(mapping.pointer + offset, byte_size),
            device=torch.device("cuda", mapping.device_id),
        )


def load_cuda_driver() -> CudaRuntimeDriver:
    """The CUDA runtime driver, where torch sees a CUDA device.

    Raises:
        CudaIpcUnavailable: torch is missing or sees no CUDA device, or the runtime library
            does not load (the message says which).
    """
    try:
        import torch
    except ImportError:
        raise CudaIpcUnavailable("torch is not installed") from None
    try:
        available = bool(torch.cuda.is_available())
    except Exception as err:  # a broken CUDA install: no device to talk about
        raise CudaIpcUnavailable(f"torch.cuda.is_available() failed: {err}") from None
    if not available:
        raise CudaIpcUnavailable("this server has no CUDA device")
    # loads torch's libcudart, which the driver then finds in this process
    torch.cuda.init()  # type: ignore[no-untyped-call]
    return CudaRuntimeDriver()
