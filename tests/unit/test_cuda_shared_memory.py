"""The CUDA shared-memory registry with a fake CUDA IPC driver over host memory (no GPU):
registration checks, status, unregister closing handles, bounds of reads and writes, the shared
namespace with system regions, leases while a request uses a region, and the refusal on a
server without CUDA. The real driver runs in tests/gpu/test_cuda_shm.py."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from gpuserve.errors import InvalidInputError
from gpuserve.service.memory.cuda_ipc import CudaIpcUnavailable, CudaRuntimeDriver
from gpuserve.service.memory.cuda_shared_memory import CudaRegionStatus, CudaSharedMemoryRegistry
from gpuserve.service.memory.shared_memory import SharedMemoryRegistry
from tests.fixtures.fake_cuda_ipc import FakeCudaMemory


@pytest.fixture()
def fake() -> FakeCudaMemory:
    return FakeCudaMemory(devices=2)


@pytest.fixture()
def cuda(fake) -> CudaSharedMemoryRegistry:
    return CudaSharedMemoryRegistry(fake)


def test_register_status_unregister_closes_the_handle(cuda, fake):
    a = fake.allocate(256)
    b = fake.allocate(64, device_id=1)
    cuda.register("a", a.handle, 0, 256)
    cuda.register("b", b.handle, 1, 32)  # a region may be shorter than its allocation
    assert cuda.status() == [CudaRegionStatus("a", 0, 256), CudaRegionStatus("b", 1, 32)]
    assert cuda.status("b") == [CudaRegionStatus("b", 1, 32)]
    assert fake.opened == 2 and fake.closed == 0
    cuda.unregister("a")
    assert fake.closed == 1 and [r.name for r in cuda.status()] == ["b"]
    cuda.unregister("missing")  # ignored, as in Triton
    cuda.unregister()
    assert cuda.status() == [] and fake.closed == 2 and not fake.mapped
    with pytest.raises(InvalidInputError, match="Unable to find cuda shared memory region: 'a'"):
        cuda.status("a")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("r", "short", 0, 64), "raw_handle must be the 64 bytes of a cudaIpcMemHandle_t, got 5"),
        (("r", "good", 0, 0), "byte_size must be > 0, got 0"),
        (("r", "good", 2, 64), r"device_id 2 does not exist \(this server sees 2 CUDA devices"),
        (("r", "good", 1, 64), "cannot open the CUDA IPC handle on device 1 .*invalid resource"),
        (("r", "unknown", 0, 64), "cannot open the CUDA IPC handle on device 0"),
        (("r", "good", 0, 257), "byte_size 257 exceeds the 256 bytes of the allocation"),
        (("", "good", 0, 64), "name must not be empty"),
    ],
)
def test_register_refusals_name_the_value(cuda, fake, args, message):
    allocation = fake.allocate(256)
    handles = {"short": b"12345", "good": allocation.handle, "unknown": b"\1" * 64}
    name, handle, device_id, byte_size = args
    with pytest.raises(InvalidInputError, match=message) as err:
        cuda.register(name, handles[handle], device_id, byte_size)
    assert name == "" or f"'{name}'" in str(err.value)
    assert cuda.status() == []
    assert fake.opened == fake.closed  # a refused registration leaves nothing open


def test_names_are_unique_across_system_and_cuda_regions(tmp_path, fake):
    cuda = CudaSharedMemoryRegistry(fake)
    system = SharedMemoryRegistry(root=tmp_path, cuda=cuda)
    (tmp_path / "key").write_bytes(bytes(64))
    system.register("sys", "/key", 0, 64)
    allocation = fake.allocate(64)
    with pytest.raises(InvalidInputError, match="shared memory region 'sys' already in manager"):
        cuda.register("sys", allocation.handle, 0, 64)
    cuda.register("gpu", allocation.handle, 0, 64)
    with pytest.raises(InvalidInputError, match="region 'gpu' already in manager"):
        cuda.register("gpu", allocation.handle, 0, 64)
    with pytest.raises(InvalidInputError, match="'gpu' already in manager"):
        system.register("gpu", "/key", 0, 64)
    # the system registry's views reach CUDA regions too (what the codecs call)
    allocation.set(0, np.arange(16, dtype=np.int32))
    data = system.view("gpu", 16, 16).toreadonly()
    assert data.readonly and np.frombuffer(data, np.int32).tolist() == [4, 5, 6, 7]
    target = system.view("gpu", 32, 16)
    payload = np.array([9, 8, 7, 6], dtype=np.int32)
    target[:16] = payload.data.cast("B")
    assert allocation.get(32, np.int32, 4).tolist() == [9, 8, 7, 6]
    system.close()  # shutdown closes CUDA regions too
    assert cuda.status() == [] and fake.closed == fake.opened == 1


def test_reads_and_writes_are_bounded_by_the_registered_size(cuda, fake):
    allocation = fake.allocate(128)
    allocation.set(0, bytes(range(128)))
    cuda.register("r", allocation.handle, 0, 64)  # only the first 64 bytes are the region
    assert cuda.read("r", 60, 4).tolist() == [60, 61, 62, 63]
    cuda.write("r", 0, b"\xff\xfe")
    assert bytes(allocation.memory[:3]) == b"\xff\xfe\x02"
    cuda.write("r", 4, np.arange(8, dtype=np.uint8)[::2])  # not contiguous: copied first
    assert bytes(allocation.memory[4:8]) == b"\x00\x02\x04\x06"
    cases = [(60, 8), (64, 1), (-1, 4), (0, 65)]
    for offset, size in cases:
        with pytest.raises(InvalidInputError, match="outside the region's registered byte_size 64"):
            cuda.read("r", offset, size)
    with pytest.raises(InvalidInputError, match=r"offset 62 \+ byte_size 4 is outside"):
        cuda.write("r", 62, b"1234")
    with pytest.raises(InvalidInputError, match="Unable to find cuda shared memory region"):
        cuda.read("nope", 0, 4)
    # a range cannot be written past its own length either
    target = cuda.device_range("r", 0, 8)
    assert target is not None and len(target) == 8
    with pytest.raises(InvalidInputError, match="cannot write 9 bytes to"):
        target[:9] = b"123456789"
    assert bytes(allocation.memory[:2]) == b"\xff\xfe"


def test_a_failed_copy_is_refused_not_raised(cuda, fake):
    allocation = fake.allocate(64)
    cuda.register("r", allocation.handle, 0, 64)
    fake.mapped.clear()  # the runtime lost the mapping: every copy fails
    with pytest.raises(InvalidInputError, match=r"'r': reading offset 0 \+ byte_size 4 failed"):
        cuda.read("r", 0, 4)
    with pytest.raises(InvalidInputError, match="'r': writing 4 bytes at offset 8 failed"):
        cuda.write("r", 8, b"abcd")
    cuda.unregister("r")  # closing fails too: logged, not raised
    assert cuda.status() == []


def test_unregister_waits_for_ranges_in_use(cuda, fake):
    allocation = fake.allocate(64)
    cuda.register("r", allocation.handle, 0, 64)
    output = cuda.device_range("r", 0, 4)  # a request in flight holds it
    unused = cuda.device_range("r", 4, 4)  # a request that fails before writing
    assert output is not None and unused is not None
    cuda.unregister("r")
    assert cuda.status() == [] and fake.closed == 0  # still open
    output[:4] = b"done"
    assert bytes(allocation.memory[:4]) == b"done" and fake.closed == 0
    with pytest.raises(InvalidInputError, match="this range was already used"):
        output[:4] = b"more"  # its lease went with the first use
    del unused  # its lease goes with it
    gc.collect()
    assert fake.closed == 1 and cuda.device_range("r", 0, 4) is None


def test_tensor_view_aliases_the_memory(cuda, fake):
    torch = pytest.importorskip("torch")
    allocation = fake.allocate(64)
    cuda.register("r", allocation.handle, 0, 64)
    view = cuda.tensor("r", 8, 4)
    assert view.dtype == torch.uint8 and view.shape == (4,)
    allocation.set(8, b"\1\2\3\4")
    assert view.tolist() == [1, 2, 3, 4]


def test_a_cpu_server_refuses_registration_and_answers_the_rest():
    cpu = CudaSharedMemoryRegistry(cuda_available=False)
    assert cpu.status() == [] and not cpu.cuda_available
    cpu.unregister()
    with pytest.raises(InvalidInputError) as err:
        cpu.register("g", b"\0" * 64, 0, 1024)
    assert "cannot register CUDA shared-memory region 'g' (device 0, 1024 bytes)" in str(err.value)
    assert "this server has no CUDA device" in str(err.value)
    assert "register system shared memory instead" in str(err.value)
    with pytest.raises(InvalidInputError, match="Unable to find cuda shared memory region"):
        cpu.status("g")


def test_the_runtime_driver_explains_a_missing_library():
    with pytest.raises(CudaIpcUnavailable, match="no CUDA runtime library"):
        CudaRuntimeDriver("/nonexistent/libcudart.so.12")
