"""The ctypes CUDA runtime driver against a stub ``libcudart`` compiled here (skipped without a C
compiler): the runtime's entry points with their real C signatures over host memory, so the
argument types, the 64-byte handle passed by value (with NUL bytes in it), the copy direction,
the private stream and the error strings are checked on a CPU. Real CUDA runs in
tests/gpu/test_cuda_shm.py."""

from __future__ import annotations

import ctypes
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from gpuserve.errors import InvalidInputError
from gpuserve.service.memory.cuda_ipc import CudaIpcError, CudaRuntimeDriver
from gpuserve.service.memory.cuda_shared_memory import CudaSharedMemoryRegistry

STUB = r"""
#include <stdint.h>
#include <string.h>

typedef struct { char reserved[64]; } cudaIpcMemHandle_t;
static int device = -1, opened = 0, closed = 0, streams = 0;
static unsigned last_flags = 99;
static const char MAGIC[] = "gpuserve-stub-handle";

int cudaGetDeviceCount(int *count) { *count = 2; return 0; }
int cudaSetDevice(int d) { if (d < 0 || d >= 2) return 101; device = d; return 0; }
int cudaIpcOpenMemHandle(void **pointer, cudaIpcMemHandle_t handle, unsigned flags) {
    uint64_t address;
    if (memcmp(handle.reserved + 8, MAGIC, sizeof MAGIC - 1) != 0) return 400;
    memcpy(&address, handle.reserved, 8);
    *pointer = (void *)(uintptr_t)address;
    last_flags = flags;
    opened++;
    return 0;
}
int cudaIpcCloseMemHandle(void *pointer) { (void)pointer; closed++; return 0; }
int cudaStreamCreateWithFlags(void **stream, unsigned flags) {
    static int token;
    *stream = &token;
    streams++;
    return flags == 1 ? 0 : 1;
}
int cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, void *stream) {
    if (kind != 4) return 21;
    if (stream == 0) return 400;
    memcpy(dst, src, n);
    return 0;
}
int cudaStreamSynchronize(void *stream) { return stream == 0 ? 400 : 0; }
const char *cudaGetErrorString(int error) {
    return error == 400 ? "invalid resource handle" : "invalid device ordinal";
}
int stub_opened(void) { return opened; }
int stub_closed(void) { return closed; }
int stub_device(void) { return device; }
int stub_streams(void) { return streams; }
unsigned stub_flags(void) { return last_flags; }
"""


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the stub libcudart")
    folder = tmp_path_factory.mktemp("cudart")
    (folder / "stub.c").write_text(STUB)
    target = folder / "libcudart.so.99"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O1", "-o", str(target), str(folder / "stub.c")],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return target


def handle_for(buffer: np.ndarray) -> bytes:
    """A stub handle naming ``buffer``: its address (with NUL high bytes), then the magic."""
    return struct.pack("<Q", buffer.ctypes.data) + b"gpuserve-stub-handle".ljust(56, b"\0")


def test_driver_calls_the_runtime_with_its_signatures(library):
    stub = ctypes.CDLL(str(library))  # the same copy the driver loads: shared counters
    driver = CudaRuntimeDriver(str(library))
    streams, closed = stub.stub_streams(), stub.stub_closed()
    assert driver.device_count() == 2
    memory = np.arange(64, dtype=np.uint8)
    mapping = driver.open_mem_handle(handle_for(memory), 1)
    assert mapping.pointer == memory.ctypes.data and mapping.device_id == 1
    assert stub.stub_flags() == 1  # cudaIpcMemLazyEnablePeerAccess
    assert stub.stub_device() == 1
    out = np.empty(8, dtype=np.uint8)
    driver.copy_to_host(mapping, 4, out)
    assert out.tolist() == list(range(4, 12))
    driver.copy_to_device(mapping, 60, np.array([7, 7, 7, 7], dtype=np.uint8))
    assert memory[58:].tolist() == [58, 59, 7, 7, 7, 7]
    assert stub.stub_streams() == streams + 1  # one private stream per device, made once
    driver.copy_to_host(mapping, 0, out)
    assert stub.stub_streams() == streams + 1
    driver.close_mem_handle(mapping)
    assert stub.stub_closed() == closed + 1


def test_driver_errors_carry_the_runtime_error_string(library):
    driver = CudaRuntimeDriver(str(library))
    with pytest.raises(CudaIpcError, match=r"cudaIpcOpenMemHandle failed: invalid resource"):
        driver.open_mem_handle(b"\1" * 64, 0)
    with pytest.raises(CudaIpcError, match=r"cudaSetDevice\(5\) failed: invalid device ordinal"):
        driver.open_mem_handle(handle_for(np.zeros(8, np.uint8)), 5)
    with pytest.raises(CudaIpcError, match="has 64 bytes"):
        driver.open_mem_handle(b"short", 0)


def test_registry_over_the_runtime_driver(library):
    stub = ctypes.CDLL(str(library))
    registry = CudaSharedMemoryRegistry(CudaRuntimeDriver(str(library)))
    memory = np.zeros(128, dtype=np.uint8)
    closed = stub.stub_closed()
    registry.register("r", handle_for(memory), 0, 128)
    registry.write("r", 16, np.array([1, 2, 3], dtype=np.int32))
    assert memory[16:28].view(np.int32).tolist() == [1, 2, 3]
    assert registry.read("r", 16, 4).tolist() == [1, 0, 0, 0]
    with pytest.raises(InvalidInputError, match="cannot open the CUDA IPC handle"):
        registry.register("bad", b"\3" * 64, 0, 8)
    registry.unregister()
    assert stub.stub_closed() == closed + 1
