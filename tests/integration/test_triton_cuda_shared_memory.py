"""Triton's CUDA shared-memory extension with Triton's own clients (tritonclient.http/grpc), on a
CPU: the server's CUDA registry is given a fake CUDA IPC driver over host memory
(tests/fixtures/fake_cuda_ipc.py), so registration, status, unregister, inputs read from and
outputs written to registered regions, and every refusal run through the real server, codecs
and registry; only the CUDA calls themselves are fake (tests/gpu/test_cuda_shm.py runs the real
ones). tritonclient.utils.cuda_shared_memory is not used: it needs cuda-python and a GPU; the
handles here are the fake driver's 64 bytes, sent as Triton's clients send a real one (base64
in HTTP JSON; the gRPC client base64-decodes it into the message's bytes).
"""

from __future__ import annotations

import base64
import gc
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.fixtures.fake_cuda_ipc import FakeAllocation, FakeCudaMemory
from tests.fixtures.triton_examples import write_triton_examples
from tests.helpers import InProcessServer, wait_queue

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
shm = pytest.importorskip("tritonclient.utils.shared_memory")
from tritonclient import utils  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

GATED_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]
parameters { key: "gate" value: { string_value: "%s" } }
"""
#: Waits until the gate file exists: the request is in flight until the test creates it.
GATED = """
import json
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.gate = json.loads(args["model_config"])["parameters"]["gate"]["string_value"]

    def execute(self, requests):
        while not os.path.exists(self.gate):
            time.sleep(0.005)
        return [
            pb_utils.InferenceResponse(
                output_tensors=[
                    pb_utils.Tensor(
                        "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() + 1
                    )
                ]
            )
            for r in requests
        ]
"""


@pytest.fixture(scope="module")
def gate(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cuda_gate") / "open"


@pytest.fixture(scope="module")
def fake() -> FakeCudaMemory:
    return FakeCudaMemory(devices=2)


@pytest.fixture(scope="module")
def server(tmp_path_factory, gate, fake):
    root = write_triton_examples(tmp_path_factory.mktemp("cudashm") / "m", with_classifier=False)
    (root / "gated" / "1").mkdir(parents=True)
    (root / "gated" / "config.pbtxt").write_text(GATED_CONFIG % gate)
    (root / "gated" / "1" / "model.py").write_text(GATED)
    running = InProcessServer(root, allow_client_shm=True)
    registry = running.server.service.extensions.cuda_shared_memory
    assert registry is not None
    registry.driver = fake  # the injection point: set before the first registration
    yield running
    running.stop()


def clients(server):
    return {
        "http": (httpclient, httpclient.InferenceServerClient(server.url.removeprefix("http://"))),
        "grpc": (grpcclient, grpcclient.InferenceServerClient(server.grpc_url)),
    }


def register(client, name: str, allocation: FakeAllocation, byte_size: int, device_id=None):
    """As a Triton client does: the handle base64-encoded (tritonclient.utils.cuda_shared_memory
    .get_raw_handle's form); the HTTP client puts it in JSON, the gRPC client decodes it."""
    raw = base64.b64encode(allocation.handle)
    if isinstance(client, httpclient.InferenceServerClient):
        raw = raw.decode()
    device = allocation.device_id if device_id is None else device_id
    client.register_cuda_shared_memory(name, raw, device, byte_size)


def status(client, kind: str) -> list[dict]:
    regions = client.get_cuda_shared_memory_status()
    if kind == "grpc":
        regions = [
            {"name": r.name, "device_id": r.device_id, "byte_size": r.byte_size}
            for r in regions.regions.values()
        ]
    return sorted(regions, key=lambda r: r["name"])


@pytest.fixture()
def clean(server, fake):
    yield
    for _, client in clients(server).values():
        client.unregister_cuda_shared_memory()
        client.unregister_system_shared_memory()
    # every handle opened is closed by unregister, or (for a range a failed request left
    # unused, caught in a traceback's reference cycle) when that range is collected
    gc.collect()
    assert fake.opened == fake.closed


def _message(err: InferenceServerException) -> str:
    return err.message() or ""


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_register_status_unregister(server, fake, clean, kind):
    _, client = clients(server)[kind]
    a = fake.allocate(128)
    b = fake.allocate(4096, device_id=1)
    opened, closed = fake.opened, fake.closed
    register(client, "a", a, 128)
    register(client, "b", b, 1024)
    assert fake.opened == opened + 2
    assert status(client, kind) == [
        {"name": "a", "device_id": 0, "byte_size": 128},
        {"name": "b", "device_id": 1, "byte_size": 1024},
    ]
    one = client.get_cuda_shared_memory_status("b")
    assert (one if kind == "http" else list(one.regions)) == (
        [{"name": "b", "device_id": 1, "byte_size": 1024}] if kind == "http" else ["b"]
    )
    client.unregister_cuda_shared_memory("a")
    assert fake.closed == closed + 1
    assert [r["name"] for r in status(client, kind)] == ["b"]
    client.unregister_cuda_shared_memory()
    assert status(client, kind) == [] and fake.closed == closed + 2
    # the other front end sees the same registry
    other = clients(server)["grpc" if kind == "http" else "http"][1]
    register(other, "c", a, 64)
    assert [r["name"] for r in status(client, kind)] == ["c"]


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_inputs_and_outputs_in_cuda_regions(server, fake, clean, kind):
    module, client = clients(server)[kind]
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 3, dtype=np.int32)
    inputs, outputs = fake.allocate(128), fake.allocate(256, device_id=1)
    inputs.set(0, a)
    inputs.set(64, b)
    register(client, "in", inputs, 128)
    register(client, "out", outputs, 256)
    in0 = module.InferInput("INPUT0", [1, 16], "INT32")
    in0.set_shared_memory("in", 64)
    in1 = module.InferInput("INPUT1", [1, 16], "INT32")
    in1.set_shared_memory("in", 64, offset=64)
    out0 = module.InferRequestedOutput("OUTPUT0")
    out0.set_shared_memory("out", 64, offset=16)
    out1 = module.InferRequestedOutput("OUTPUT1")
    out1.set_shared_memory("out", 64, offset=128)
    result = client.infer("simple", [in0, in1], outputs=[out0, out1])
    output = result.get_output("OUTPUT0")
    if kind == "grpc":
        assert output.datatype == "INT32" and list(output.shape) == [1, 16]
        assert result.get_response().raw_output_contents == [b"", b""]
    else:
        assert output == {"name": "OUTPUT0", "datatype": "INT32", "shape": [1, 16]}
    np.testing.assert_array_equal(outputs.get(16, np.int32, 16), (a + b).ravel())
    np.testing.assert_array_equal(outputs.get(128, np.int32, 16), (a - b).ravel())
    assert bytes(outputs.memory[:16]) == bytes(16)  # nothing written outside the ranges


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_cuda_system_and_inline_tensors_mix(server, fake, clean, kind):
    """INPUT0 in a CUDA region, INPUT1 in system shared memory; OUTPUT0 to a CUDA region,
    OUTPUT1 in the answer."""
    module, client = clients(server)[kind]
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 7, dtype=np.int32)
    device = fake.allocate(128)
    device.set(0, a)
    key = f"/gpuserve_cuda_test_{uuid.uuid4().hex[:8]}"
    host = shm.create_shared_memory_region(key.strip("/"), key, 64)
    try:
        shm.set_shared_memory_region(host, [b])
        register(client, "dev", device, 128)
        client.register_system_shared_memory("host", key, 64)
        in0 = module.InferInput("INPUT0", [1, 16], "INT32")
        in0.set_shared_memory("dev", 64)
        in1 = module.InferInput("INPUT1", [1, 16], "INT32")
        in1.set_shared_memory("host", 64)
        out0 = module.InferRequestedOutput("OUTPUT0")
        out0.set_shared_memory("dev", 64, offset=64)
        result = client.infer(
            "simple", [in0, in1], outputs=[out0, module.InferRequestedOutput("OUTPUT1")]
        )
        np.testing.assert_array_equal(device.get(64, np.int32, 16), (a + b).ravel())
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(host)


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_bytes_tensors_through_cuda_regions(server, fake, clean, kind):
    module, client = clients(server)[kind]
    a = np.array([str(i).encode() for i in range(16)], dtype=np.object_).reshape(1, 16)
    b = np.array([b"2"] * 16, dtype=np.object_).reshape(1, 16)
    sa, sb = utils.serialize_byte_tensor(a), utils.serialize_byte_tensor(b)
    size_a, size_b = utils.serialized_byte_size(sa), utils.serialized_byte_size(sb)
    device = fake.allocate(size_a + size_b + 256)
    device.set(0, sa.item())
    device.set(size_a, sb.item())
    register(client, "strings", device, size_a + size_b + 256)
    in0 = module.InferInput("INPUT0", [1, 16], "BYTES")
    in0.set_shared_memory("strings", size_a)
    in1 = module.InferInput("INPUT1", [1, 16], "BYTES")
    in1.set_shared_memory("strings", size_b, offset=size_a)
    out0 = module.InferRequestedOutput("OUTPUT0")
    out0.set_shared_memory("strings", 256, offset=size_a + size_b)
    client.infer("simple_string", [in0, in1], outputs=[out0])
    raw = bytes(device.memory[size_a + size_b :])
    got, at = [], 0
    for _ in range(16):  # Triton's BYTES layout: 4-byte little-endian length, then the bytes
        length = int.from_bytes(raw[at : at + 4], "little")
        got.append(int(raw[at + 4 : at + 4 + length]))
        at += 4 + length
    assert got == [i + 2 for i in range(16)]


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_infer_bounds_are_refused_and_the_server_keeps_serving(server, fake, clean, kind):
    module, client = clients(server)[kind]
    device = fake.allocate(128)
    device.set(0, np.arange(16, dtype=np.int32))
    register(client, "small", device, 64)  # the region is the first 64 of 128 bytes
    ones = np.ones((1, 16), dtype=np.int32)
    cases = [
        ("small", 64, 16, r"'small': offset 16 \+ byte_size 64 is outside .*byte_size 64"),
        ("small", 128, 0, r"offset 0 \+ byte_size 128 is outside"),
        ("nowhere", 64, 0, r"Unable to find system shared memory region: 'nowhere'"),
        ("small", 32, 0, r"shared_memory_byte_size 32 does not match"),
    ]
    for region, size, offset, pattern in cases:
        in0 = module.InferInput("INPUT0", [1, 16], "INT32")
        in0.set_shared_memory(region, size, offset=offset)
        in1 = module.InferInput("INPUT1", [1, 16], "INT32")
        in1.set_data_from_numpy(ones)
        with pytest.raises(InferenceServerException) as err:
            client.infer("simple", [in0, in1])
        assert err.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
        assert re.search(pattern, _message(err.value)), _message(err.value)
    in0 = module.InferInput("INPUT0", [1, 16], "INT32")
    in0.set_shared_memory("small", 64)
    in1 = module.InferInput("INPUT1", [1, 16], "INT32")
    in1.set_data_from_numpy(ones)
    too_small = module.InferRequestedOutput("OUTPUT0")
    too_small.set_shared_memory("small", 16, offset=8)
    with pytest.raises(InferenceServerException) as err:
        client.infer("simple", [in0, in1], outputs=[too_small])
    assert "output 'OUTPUT0': shared_memory_byte_size 16 of region 'small' (offset 8)" in (
        _message(err.value)
    )
    past = module.InferRequestedOutput("OUTPUT0")
    past.set_shared_memory("small", 64, offset=32)
    with pytest.raises(InferenceServerException, match=r"offset 32 \+ byte_size 64 is outside"):
        client.infer("simple", [in0, in1], outputs=[past])
    assert bytes(device.memory[64:]) == bytes(64)  # nothing written past the region
    good = module.InferRequestedOutput("OUTPUT0")
    good.set_shared_memory("small", 64)
    client.infer("simple", [in0, in1], outputs=[good])  # unharmed: the same with good bounds
    np.testing.assert_array_equal(device.get(0, np.int32, 16), np.arange(16) + 1)


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_register_refusals_name_the_value(server, fake, clean, kind):
    _, client = clients(server)[kind]
    device = fake.allocate(256)
    short = FakeAllocation(0, b"\1" * 10, bytearray(8))
    unknown = FakeAllocation(0, b"\2" * 64, bytearray(8))
    cases = [
        (("zero", device, 0), "'zero': byte_size must be > 0, got 0"),
        (("short", short, 64), "raw_handle must be the 64 bytes of a cudaIpcMemHandle_t, got 10"),
        (("dev", device, 64, 5), "device_id 5 does not exist (this server sees 2 CUDA devices"),
        (("wrongdev", device, 64, 1), "cannot open the CUDA IPC handle on device 1"),
        (("unknown", unknown, 64), "cannot open the CUDA IPC handle on device 0"),
        (("big", device, 257), "byte_size 257 exceeds the 256 bytes of the allocation"),
    ]
    for args, message in cases:
        with pytest.raises(InferenceServerException) as err:
            register(client, *args)
        assert err.value.status() in ("400", "StatusCode.INVALID_ARGUMENT"), message
        assert message in _message(err.value)
    register(client, "taken", device, 64)
    with pytest.raises(InferenceServerException, match="'taken' already in manager"):
        register(client, "taken", device, 64)
    key = f"/gpuserve_cuda_test_{uuid.uuid4().hex[:8]}"
    host = shm.create_shared_memory_region(key.strip("/"), key, 64)
    try:
        client.register_system_shared_memory("sys", key, 64)
        with pytest.raises(InferenceServerException, match="'sys' already in manager"):
            register(client, "sys", device, 64)
        with pytest.raises(InferenceServerException, match="'taken' already in manager"):
            client.register_system_shared_memory("taken", key, 64)
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(host)
    with pytest.raises(InferenceServerException, match="Unable to find cuda shared memory"):
        client.get_cuda_shared_memory_status("nope")
    assert [r["name"] for r in status(client, kind)] == ["taken"]


def test_http_register_bodies_are_checked(server, fake, clean):
    url = f"{server.url}/v2/cudasharedmemory/region/r/register"
    handle = base64.b64encode(fake.allocate(64).handle).decode()
    cases = [
        ({"device_id": 0, "byte_size": 64}, "'raw_handle' must be {'b64': <base64"),
        ({"raw_handle": handle, "byte_size": 64}, "'raw_handle' must be {'b64'"),
        ({"raw_handle": {"b64": "not base64!"}, "byte_size": 64}, "'raw_handle.b64' is not valid"),
        ({"raw_handle": {"b64": handle}, "byte_size": -1}, "'byte_size' must be a non-negative"),
        ({"raw_handle": {"b64": handle}, "device_id": "0", "byte_size": 8}, "'device_id' must"),
    ]
    for body, message in cases:
        answer = httpx.post(url, json=body)
        assert answer.status_code == 400 and message in answer.json()["error"], answer.text
    assert httpx.get(f"{server.url}/v2/cudasharedmemory/status").json() == []


def test_unregister_while_a_request_writes_the_region_is_safe(server, fake, clean, gate):
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    device = fake.allocate(128)
    device.set(0, np.arange(16, dtype=np.int32))
    register(client, "busy", device, 128)
    in0 = httpclient.InferInput("INPUT0", [16], "INT32")
    in0.set_shared_memory("busy", 64)
    out0 = httpclient.InferRequestedOutput("OUTPUT0")
    out0.set_shared_memory("busy", 64, offset=64)
    caller = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    closed = fake.closed
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(caller.infer, "gated", [in0], outputs=[out0])
        wait_queue(server.url, "gated", executing=1)
        client.unregister_cuda_shared_memory("busy")  # the request holds its output range
        assert client.get_cuda_shared_memory_status() == []
        assert fake.closed == closed  # not closed under the request
        gate.touch()
        assert pending.result(timeout=60).get_output("OUTPUT0")["shape"] == [16]
    np.testing.assert_array_equal(device.get(64, np.int32, 16), np.arange(16) + 1)
    assert fake.closed == closed + 1  # closed once the request let go
    with pytest.raises(InferenceServerException, match=r"Unable to find .*'busy'"):
        client.infer("gated", [in0])
