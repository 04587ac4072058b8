"""Triton's system shared-memory extension with Triton's own clients (tritonclient.http/grpc +
tritonclient.utils.shared_memory): register / status / unregister, inputs read from and outputs
written to registered regions, bounds refused with 400 naming region/offset/size, unregister
while a request uses the region, the switch off by default, and the CUDA API on a CPU server.
"""

from __future__ import annotations

import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.fixtures.triton_examples import write_triton_examples
from tests.helpers import InProcessServer, wait_queue

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
shm = pytest.importorskip("tritonclient.utils.shared_memory")
from tritonclient import utils  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

#: A model whose execute waits until a file exists: a request is in flight until the test
#: creates it (no sleeps as synchronisation).
GATED_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]
parameters { key: "gate" value: { string_value: "%s" } }
"""
GATED = """
import json
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.gate = config["parameters"]["gate"]["string_value"]

    def execute(self, requests):
        while not os.path.exists(self.gate):
            time.sleep(0.005)
        return [
            pb_utils.InferenceResponse(
                output_tensors=[
                    pb_utils.Tensor(
                        "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() * 2
                    )
                ]
            )
            for r in requests
        ]
"""


@pytest.fixture(scope="module")
def gate(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gate") / "open"


@pytest.fixture(scope="module")
def repository(tmp_path_factory, gate):
    root = write_triton_examples(tmp_path_factory.mktemp("shm") / "models", with_classifier=False)
    folder = root / "gated"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(GATED_CONFIG % gate)
    (folder / "1" / "model.py").write_text(GATED)
    return root


@pytest.fixture(scope="module")
def server(repository):
    running = InProcessServer(repository, allow_client_shm=True)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def plain_server(repository):
    running = InProcessServer(repository)  # the switch off: the default
    yield running
    running.stop()


def clients(server):
    return {
        "http": (httpclient, httpclient.InferenceServerClient(server.url.removeprefix("http://"))),
        "grpc": (grpcclient, grpcclient.InferenceServerClient(server.grpc_url)),
    }


class Regions:
    """System shared-memory regions the test creates, destroyed at the end."""

    def __init__(self) -> None:
        self.handles: list = []

    def create(self, size: int):
        key = f"/gpuserve_test_{uuid.uuid4().hex[:10]}"
        handle = shm.create_shared_memory_region(key.strip("/"), key, size)
        self.handles.append(handle)
        return key, handle

    def close(self) -> None:
        for handle in self.handles:
            shm.destroy_shared_memory_region(handle)


@pytest.fixture()
def regions(server):
    made = Regions()
    yield made
    for _, client in clients(server).values():
        client.unregister_system_shared_memory()
    made.close()


def _message(err: InferenceServerException) -> str:
    return err.message() or ""


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_inputs_and_outputs_through_registered_regions(server, regions, kind):
    module, client = clients(server)[kind]
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 3, dtype=np.int32)
    in_key, in_handle = regions.create(128)
    out_key, out_handle = regions.create(160)
    shm.set_shared_memory_region(in_handle, [a, b])
    client.register_system_shared_memory("in", in_key, 128)
    client.register_system_shared_memory("out", out_key, 128, offset=32)
    status = client.get_system_shared_memory_status()
    if kind == "grpc":
        status = [
            {"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
            for r in status.regions.values()
        ]
    assert sorted(status, key=lambda r: r["name"]) == [
        {"name": "in", "key": in_key, "offset": 0, "byte_size": 128},
        {"name": "out", "key": out_key, "offset": 32, "byte_size": 128},
    ]
    in0 = module.InferInput("INPUT0", [1, 16], "INT32")
    in0.set_shared_memory("in", 64)
    in1 = module.InferInput("INPUT1", [1, 16], "INT32")
    in1.set_shared_memory("in", 64, offset=64)
    out0 = module.InferRequestedOutput("OUTPUT0")
    out0.set_shared_memory("out", 64)
    out1 = module.InferRequestedOutput("OUTPUT1")
    out1.set_shared_memory("out", 64, offset=64)
    result = client.infer("simple", [in0, in1], outputs=[out0, out1])
    output = result.get_output("OUTPUT0")
    if kind == "grpc":
        assert output.datatype == "INT32" and list(output.shape) == [1, 16]
        assert result.get_response().raw_output_contents == [b"", b""]  # one empty per output
    else:  # as Triton: no data, no parameters (Triton's C++ client reads them as binary)
        assert output == {"name": "OUTPUT0", "datatype": "INT32", "shape": [1, 16]}
    # the region "out" starts 32 bytes into its shm object
    got0 = shm.get_contents_as_numpy(out_handle, np.int32, [1, 16], offset=32)
    got1 = shm.get_contents_as_numpy(out_handle, np.int32, [1, 16], offset=96)
    np.testing.assert_array_equal(got0, a + b)
    np.testing.assert_array_equal(got1, a - b)


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_mixed_shared_memory_and_inline_tensors(server, regions, kind):
    """One input in shared memory, the other in the request (binary / raw contents); one
    output in shared memory, the other in the answer."""
    module, client = clients(server)[kind]
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 5, dtype=np.int32)
    key, handle = regions.create(64)
    out_key, out_handle = regions.create(64)
    shm.set_shared_memory_region(handle, [b])
    client.register_system_shared_memory("b", key, 64)
    client.register_system_shared_memory("o1", out_key, 64)
    in0 = module.InferInput("INPUT0", [1, 16], "INT32")
    in0.set_data_from_numpy(a)
    in1 = module.InferInput("INPUT1", [1, 16], "INT32")
    in1.set_shared_memory("b", 64)
    out1 = module.InferRequestedOutput("OUTPUT1")
    out1.set_shared_memory("o1", 64)
    result = client.infer(
        "simple", [in1, in0], outputs=[module.InferRequestedOutput("OUTPUT0"), out1]
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.int32, [1, 16]), a - b)


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_bytes_tensors_through_shared_memory(server, regions, kind):
    module, client = clients(server)[kind]
    a = np.array([str(i).encode() for i in range(16)], dtype=np.object_).reshape(1, 16)
    b = np.array([b"1"] * 16, dtype=np.object_).reshape(1, 16)
    sa, sb = utils.serialize_byte_tensor(a), utils.serialize_byte_tensor(b)
    size_a, size_b = utils.serialized_byte_size(sa), utils.serialized_byte_size(sb)
    key, handle = regions.create(size_a + size_b)
    out_key, out_handle = regions.create(256)
    shm.set_shared_memory_region(handle, [sa, sb])
    client.register_system_shared_memory("strings", key, size_a + size_b)
    client.register_system_shared_memory("sums", out_key, 256)
    in0 = module.InferInput("INPUT0", [1, 16], "BYTES")
    in0.set_shared_memory("strings", size_a)
    in1 = module.InferInput("INPUT1", [1, 16], "BYTES")
    in1.set_shared_memory("strings", size_b, offset=size_a)
    out0 = module.InferRequestedOutput("OUTPUT0")
    out0.set_shared_memory("sums", 256)
    client.infer("simple_string", [in0, in1], outputs=[out0])
    got = shm.get_contents_as_numpy(out_handle, np.object_, [1, 16])
    assert [int(x) for x in got.ravel()] == [i + 1 for i in range(16)]


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_bounds_are_refused_with_400_naming_region_offset_and_size(server, regions, kind):
    module, client = clients(server)[kind]
    key, handle = regions.create(64)
    shm.set_shared_memory_region(handle, [np.arange(16, dtype=np.int32)])
    client.register_system_shared_memory("small", key, 64)
    cases = [
        ("small", 64, 16, r"'small'.*offset 16 \+ byte_size 64 .*byte_size 64"),
        ("nowhere", 64, 0, r"Unable to find system shared memory region: 'nowhere'"),
        ("small", 32, 0, r"binary|shared_memory_byte_size 32 does not match"),
    ]
    for region, size, offset, pattern in cases:
        in0 = module.InferInput("INPUT0", [1, 16], "INT32")
        in0.set_shared_memory(region, size, offset=offset)
        in1 = module.InferInput("INPUT1", [1, 16], "INT32")
        in1.set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
        with pytest.raises(InferenceServerException) as err:
            client.infer("simple", [in0, in1])
        assert err.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
        assert re.search(pattern, _message(err.value)), _message(err.value)
    # an output larger than the space the request gives it
    in0 = module.InferInput("INPUT0", [1, 16], "INT32")
    in0.set_shared_memory("small", 64)
    in1 = module.InferInput("INPUT1", [1, 16], "INT32")
    in1.set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
    out0 = module.InferRequestedOutput("OUTPUT0")
    out0.set_shared_memory("small", 16, offset=8)
    with pytest.raises(InferenceServerException) as err:
        client.infer("simple", [in0, in1], outputs=[out0])
    assert "output 'OUTPUT0': shared_memory_byte_size 16 of region 'small' (offset 8)" in (
        _message(err.value)
    )
    assert "needs 64 bytes" in _message(err.value)
    # registering past the end of the object, and a key that does not exist
    with pytest.raises(
        InferenceServerException,
        match="failed to register shared memory region 'past': invalid args .*exceeds the size 64",
    ):  # Triton's words first: its qa tests look for "failed to register ... invalid args"
        client.register_system_shared_memory("past", key, 32, offset=40)
    with pytest.raises(
        InferenceServerException, match="Unable to open shared memory region: .* cannot open key"
    ):
        client.register_system_shared_memory("none", "/gpuserve_missing_key", 8)
    with pytest.raises(InferenceServerException, match="already in manager"):
        client.register_system_shared_memory("small", key, 8)
    # the server is unharmed: the same request with good bounds answers
    out0 = module.InferRequestedOutput("OUTPUT0")
    out0.set_shared_memory("small", 64)
    client.infer("simple", [in0, in1], outputs=[out0])
    np.testing.assert_array_equal(
        shm.get_contents_as_numpy(handle, np.int32, [16]), np.arange(16, dtype=np.int32) + 1
    )


def _unregister_then_open(client, gate: Path) -> None:
    client.unregister_system_shared_memory("busy")  # while the request holds its views
    assert client.get_system_shared_memory_status() == []
    gate.touch()


def test_unregister_while_a_request_uses_the_region_is_safe(server, regions, gate):
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    key, handle = regions.create(128)
    shm.set_shared_memory_region(handle, [np.arange(16, dtype=np.int32)])
    client.register_system_shared_memory("busy", key, 128)
    in0 = httpclient.InferInput("INPUT0", [16], "INT32")
    in0.set_shared_memory("busy", 64)
    out0 = httpclient.InferRequestedOutput("OUTPUT0")
    out0.set_shared_memory("busy", 64, offset=64)
    caller = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(caller.infer, "gated", [in0], outputs=[out0])
        wait_queue(server.url, "gated", executing=1)
        _unregister_then_open(client, gate)
        result = pending.result(timeout=60)
    assert result.get_output("OUTPUT0")["shape"] == [16]
    np.testing.assert_array_equal(
        shm.get_contents_as_numpy(handle, np.int32, [16], offset=64),
        np.arange(16, dtype=np.int32) * 2,
    )
    # a new request naming the unregistered region is refused
    with pytest.raises(InferenceServerException, match=r"Unable to find .*'busy'"):
        client.infer("gated", [in0])


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_cuda_shared_memory_on_a_cpu_server(server, kind):
    _, client = clients(server)[kind]
    client.unregister_cuda_shared_memory()
    status = client.get_cuda_shared_memory_status()
    assert (status == []) if kind == "http" else (len(status.regions) == 0)
    if kind == "http":
        with pytest.raises(InferenceServerException) as err:
            client.register_cuda_shared_memory("gpu", b"\0" * 64, 0, 1024)
        assert err.value.status() == "400"
        assert "cannot register CUDA shared-memory region 'gpu'" in _message(err.value)
        assert "register system shared memory instead" in _message(err.value)
    else:  # tritonclient.grpc base64-decodes the handle first
        import base64

        with pytest.raises(InferenceServerException) as err:
            client.register_cuda_shared_memory("gpu", base64.b64encode(b"\0" * 64), 0, 1024)
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "register system shared memory instead" in _message(err.value)


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_off_by_default(plain_server, kind):
    module, client = clients(plain_server)[kind]
    metadata = client.get_server_metadata()
    extensions = metadata["extensions"] if kind == "http" else list(metadata.extensions)
    assert "system_shared_memory" not in extensions and "classification" in extensions
    with pytest.raises(InferenceServerException) as err:
        client.register_system_shared_memory("r", "/anything", 64)
    assert err.value.status() in ("403", "StatusCode.PERMISSION_DENIED")
    assert _message(err.value).startswith("Client shared memory is disabled. Start the server ")
    assert "--allow-client-shm" in _message(err.value)
    in0 = module.InferInput("INPUT0", [1, 16], "INT32")
    in0.set_shared_memory("r", 64)
    in1 = module.InferInput("INPUT1", [1, 16], "INT32")
    in1.set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
    with pytest.raises(InferenceServerException) as err:
        client.infer("simple", [in0, in1])
    assert err.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    assert "input 'INPUT0': parameter 'shared_memory_region'" in _message(err.value)
    assert "Client shared memory is disabled" in _message(err.value)
    assert "--allow-client-shm" in _message(err.value)


def test_enabled_server_lists_the_extension_and_http_paths(server):
    metadata = httpx.get(f"{server.url}/v2").json()
    assert "system_shared_memory" in metadata["extensions"]
    assert httpx.get(f"{server.url}/v2/systemsharedmemory/status").json() == []
    missing = httpx.get(f"{server.url}/v2/systemsharedmemory/region/nope/status")
    assert missing.status_code == 400 and "'nope'" in missing.json()["error"]
    assert httpx.post(f"{server.url}/v2/systemsharedmemory/status").status_code == 404
    bad = httpx.post(
        f"{server.url}/v2/systemsharedmemory/region/x/register",
        json={"key": "/k", "byte_size": -1},
    )
    assert (
        bad.status_code == 400
        and "'byte_size' must be a non-negative integer" in (bad.json()["error"])
    )
