"""The system shared-memory registry: register, views, bounds errors, unregister, status."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from gpuserve.errors import InvalidInputError
from gpuserve.service.memory.shared_memory import RegionStatus, SharedMemoryRegistry


@pytest.fixture()
def root(tmp_path):
    (tmp_path / "input_data").write_bytes(bytes(range(64)))
    return tmp_path


def test_register_view_status_unregister(root):
    registry = SharedMemoryRegistry(root)
    registry.register("in", "/input_data", 16, 32)
    assert registry.status() == [RegionStatus("in", "/input_data", 16, 32)]
    assert bytes(registry.view("in", 0, 4)) == bytes([16, 17, 18, 19])
    assert bytes(registry.view("in", 28, 4)) == bytes([44, 45, 46, 47])
    view = registry.view("in", 0, 8)
    view[0] = 200  # outputs are written through the same view
    assert (root / "input_data").read_bytes()[16] == 200
    registry.unregister("in")  # a live view does not make this fail
    assert registry.status() == []
    del view


@pytest.mark.parametrize(
    ("offset", "size"), [(0, 33), (30, 4), (-1, 2), (33, 0)], ids=["size", "end", "neg", "past"]
)
def test_view_out_of_bounds_names_region_offset_and_sizes(root, offset, size):
    registry = SharedMemoryRegistry(root)
    registry.register("in", "input_data", 16, 32)
    with pytest.raises(InvalidInputError, match=rf"'in'.*offset {offset}.*{size}.*32"):
        registry.view("in", offset, size)


def test_register_refusals(root):
    registry = SharedMemoryRegistry(root)
    with pytest.raises(InvalidInputError, match=r"exceeds the size 64 of key"):
        registry.register("big", "input_data", 60, 8)
    with pytest.raises(InvalidInputError, match=r"^Unable to open shared memory region: 'missing'"):
        registry.register("x", "missing", 0, 1)
    with pytest.raises(InvalidInputError, match=r"not a valid POSIX shm name"):
        registry.register("x", "../etc/passwd", 0, 1)
    (root / "link").symlink_to(root / "input_data")
    with pytest.raises(InvalidInputError, match=r"cannot open key 'link'"):
        registry.register("x", "link", 0, 1)  # never through a symbolic link
    (root / "folder").mkdir()
    with pytest.raises(InvalidInputError, match=r"cannot open key 'folder'|not a shared-memory"):
        registry.register("x", "folder", 0, 1)
    registry.register("in", "input_data", 0, 8)
    with pytest.raises(InvalidInputError, match=r"already in manager"):
        registry.register("in", "input_data", 0, 8)
    with pytest.raises(InvalidInputError, match=r"Unable to find .* 'nope'"):
        registry.view("nope", 0, 1)
    with pytest.raises(InvalidInputError, match=r"Unable to find .* 'nope'"):
        registry.status("nope")
    registry.unregister("nope")  # ignored, as in Triton
    registry.close()
    assert registry.status() == []


def test_tritonclient_region_is_read_zero_copy():
    shm = pytest.importorskip("tritonclient.utils.shared_memory")
    key = f"/gpuserve_test_{uuid.uuid4().hex[:8]}"
    handle = shm.create_shared_memory_region("input0", key, 64)
    try:
        data = np.arange(16, dtype=np.float32)
        shm.set_shared_memory_region(handle, [data])
        registry = SharedMemoryRegistry()
        registry.register("input0", key, 0, 64)
        array = np.frombuffer(registry.view("input0", 0, 64), dtype=np.float32)
        np.testing.assert_array_equal(array, data)  # no copy: a view of the mapping
        del array
        registry.unregister()
    finally:
        shm.destroy_shared_memory_region(handle)
