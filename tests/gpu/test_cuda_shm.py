"""CUDA shared memory for real (skipped without CUDA): this test process plays the client. It
allocates device memory with torch, gets the allocation's ``cudaIpcMemHandle_t`` with
``cudaIpcGetMemHandle`` through ctypes, and registers it with a gpuserve server running as a
child process (a handle cannot be opened in the process that made it), over HTTP and gRPC;
then an infer reads INPUT0/INPUT1 from the device and writes OUTPUT0/OUTPUT1 back there, and
the test reads them with torch. It also checks the runtime driver's copies and tensor view on
this process's own memory.

Stdlib clients only (urllib, and grpcio with gpuserve's stubs), so it runs where
scripts/gpu_check.sh runs: no tritonclient or httpx needed.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("CUDA shared memory needs a CUDA device", allow_module_level=True)

from gpuserve.service.memory.cuda_ipc import (  # noqa: E402
    IPC_HANDLE_BYTES,
    CudaRuntimeDriver,
    DeviceMapping,
    runtime_library_candidates,
)
from tests.fixtures.triton_examples import write_triton_examples  # noqa: E402


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


def _runtime() -> ctypes.CDLL:
    torch.cuda.init()
    for candidate in runtime_library_candidates():
        try:
            return ctypes.CDLL(candidate)
        except OSError:
            continue
    pytest.fail("no libcudart could be loaded in the test process")


def ipc_handle(tensor) -> tuple[bytes, int, int]:
    """The IPC handle of the allocation holding ``tensor``, the tensor's offset in that
    allocation, and the allocation's size (torch's caching allocator may place a tensor
    inside a larger ``cudaMalloc`` segment; the handle names the whole segment)."""
    runtime = _runtime()
    runtime.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), ctypes.c_void_p]
    handle = _Handle()
    pointer = tensor.data_ptr()
    assert runtime.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(pointer)) == 0
    raw = ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_BYTES)
    segment = next(
        s
        for s in torch.cuda.memory_snapshot()
        if s["address"] <= pointer < s["address"] + s["total_size"]
    )
    return raw, pointer - segment["address"], segment["total_size"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _call(url: str, body: dict | None = None) -> tuple[int, dict | list | None]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            text = answer.read()
            return answer.status, json.loads(text) if text else None
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


class Server:
    """``python -m gpuserve serve --allow-client-shm`` as a child process."""

    def __init__(self, repository: Path) -> None:
        self.port, self.grpc_port = _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the server
        command = [sys.executable, "-m", "gpuserve", "serve", "--model-repository"]
        command += [str(repository), "--host", "127.0.0.1", "--http-port", str(self.port)]
        command += ["--grpc-port", str(self.grpc_port), "--metrics-port", "0"]
        command += ["--allow-client-shm"]
        self.proc = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ)
        )
        end = time.monotonic() + 180
        while True:
            try:
                if _call(f"{self.url}/v2/health/ready")[0] == 200:
                    return
            except (urllib.error.URLError, ConnectionError):
                pass
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                pytest.fail(f"the server did not get ready:\n{self.output()}")
            time.sleep(0.1)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    root = write_triton_examples(tmp_path_factory.mktemp("cudashm") / "m", with_classifier=False)
    running = Server(root)
    yield running
    running.stop()


def _tensor_params(region: str, offset: int, size: int) -> dict:
    return {
        "shared_memory_region": region,
        "shared_memory_offset": offset,
        "shared_memory_byte_size": size,
    }


def test_runtime_driver_copies_and_views_on_this_process_memory():
    driver = CudaRuntimeDriver()
    assert driver.device_count() == torch.cuda.device_count()
    memory = torch.zeros(64, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    mapping = DeviceMapping(0, memory.data_ptr(), 64)  # no IPC: the copies alone
    driver.copy_to_device(mapping, 8, np.arange(16, dtype=np.uint8))
    assert memory[8:24].cpu().tolist() == list(range(16))
    out = np.empty(8, dtype=np.uint8)
    driver.copy_to_host(mapping, 12, out)
    assert out.tolist() == list(range(4, 12))
    view = driver.tensor_view(mapping, 8, 16)
    assert view.device == torch.device("cuda", 0) and view.data_ptr() == memory.data_ptr() + 8
    memory[8] = 200
    torch.cuda.synchronize()
    assert int(view[0]) == 200  # aliases, no copy


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_infer_reads_and_writes_device_memory(server, kind):
    # 16 MiB each: large enough for segments of their own in torch's allocator
    inputs = torch.zeros(4 << 20, dtype=torch.int32, device="cuda:0")
    outputs = torch.zeros(4 << 20, dtype=torch.int32, device="cuda:0")
    a = torch.arange(16, dtype=torch.int32, device="cuda:0")
    inputs[:16] = a
    inputs[16:32] = 3
    torch.cuda.synchronize()
    in_handle, in_at, in_size = ipc_handle(inputs)
    out_handle, out_at, out_size = ipc_handle(outputs)
    names = (f"{kind}_in", f"{kind}_out")
    regions = [(names[0], in_handle, in_size), (names[1], out_handle, out_size)]
    if kind == "http":
        for name, handle, size in regions:
            body = {"raw_handle": {"b64": base64.b64encode(handle).decode()}, "device_id": 0}
            body["byte_size"] = size
            code, answer = _call(f"{server.url}/v2/cudasharedmemory/region/{name}/register", body)
            assert code == 200, (answer, server.output())
        code, status = _call(f"{server.url}/v2/cudasharedmemory/status")
        assert code == 200
        assert {r["name"]: r["byte_size"] for r in status} == {n: z for n, _, z in regions}
        request = {
            "inputs": [
                {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16]}
                | {"parameters": _tensor_params(names[0], in_at, 64)},
                {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16]}
                | {"parameters": _tensor_params(names[0], in_at + 64, 64)},
            ],
            "outputs": [
                {"name": "OUTPUT0", "parameters": _tensor_params(names[1], out_at, 64)},
                {"name": "OUTPUT1", "parameters": _tensor_params(names[1], out_at + 64, 64)},
            ],
        }
        code, answer = _call(f"{server.url}/v2/models/simple/infer", request)
        assert code == 200, (answer, server.output())
        assert answer["outputs"][0] == {"name": "OUTPUT0", "datatype": "INT32", "shape": [1, 16]}
        code, _ = _call(f"{server.url}/v2/cudasharedmemory/unregister", {})
        assert code == 200
    else:
        grpc = pytest.importorskip("grpc")
        from gpuserve.protocol.protos import grpc_service_pb2 as pb
        from gpuserve.protocol.protos import grpc_service_pb2_grpc as pb_grpc

        def params(region: str, offset: int) -> dict:
            return {
                "shared_memory_region": pb.InferParameter(string_param=region),
                "shared_memory_offset": pb.InferParameter(int64_param=offset),
                "shared_memory_byte_size": pb.InferParameter(int64_param=64),
            }

        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            for name, handle, size in regions:
                stub.CudaSharedMemoryRegister(
                    pb.CudaSharedMemoryRegisterRequest(
                        name=name, raw_handle=handle, device_id=0, byte_size=size
                    )
                )
            regions = stub.CudaSharedMemoryStatus(pb.CudaSharedMemoryStatusRequest()).regions
            assert sorted(regions) == sorted(names)
            Tensor = pb.ModelInferRequest.InferInputTensor
            Output = pb.ModelInferRequest.InferRequestedOutputTensor
            answer = stub.ModelInfer(
                pb.ModelInferRequest(
                    model_name="simple",
                    inputs=[
                        Tensor(
                            name="INPUT0",
                            datatype="INT32",
                            shape=[1, 16],
                            parameters=params(names[0], in_at),
                        ),
                        Tensor(
                            name="INPUT1",
                            datatype="INT32",
                            shape=[1, 16],
                            parameters=params(names[0], in_at + 64),
                        ),
                    ],
                    outputs=[
                        Output(name="OUTPUT0", parameters=params(names[1], out_at)),
                        Output(name="OUTPUT1", parameters=params(names[1], out_at + 64)),
                    ],
                )
            )
            assert list(answer.raw_output_contents) == [b"", b""]
            stub.CudaSharedMemoryUnregister(pb.CudaSharedMemoryUnregisterRequest())
    torch.cuda.synchronize()
    assert outputs[:16].cpu().tolist() == (a + 3).cpu().tolist()
    assert outputs[16:32].cpu().tolist() == (a - 3).cpu().tolist()
    assert int(outputs[32:].abs().sum()) == 0  # nothing written past the outputs
