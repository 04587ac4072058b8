"""Where the load goes: a V2 server over HTTP/REST or gRPC.

A target pre-encodes every sample request once, then hands out *sessions*. A session carries
one request at a time (an HTTP keep-alive connection; for gRPC, a slot on a shared channel)
and answers ``await session.infer(i)`` with ``(status, queue_us, compute_us)``: status
``"200"``/``"OK"`` on success, else the HTTP status or the gRPC code name, and the server's
timing (``x-queue-time-us`` / ``x-compute-time-us`` headers or metadata), -1 when absent.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from gpuserve.bench.http_client import (
    HttpConnection,
    build_request,
    is_https,
    split_url,
    tls_context,
)
from gpuserve.bench.inputs import ModelInfo, encode_http_body, tensor_bytes
from gpuserve.bench.server_info import auth_headers

Outcome = tuple[str, int, int]
_STATUS_TEXT = {code: str(code) for code in range(100, 600)}


class Session(Protocol):
    async def infer(self, index: int) -> Outcome: ...

    def close(self) -> None: ...


class Target(Protocol):
    """The server under test. ``samples`` is the number of distinct pre-encoded requests."""

    samples: int
    description: str

    async def session(self) -> Session: ...

    def check_timeouts(self, now: float) -> None: ...

    async def close(self) -> None: ...


def _int_header(value: str | None) -> int:
    if value is None:
        return -1
    try:
        return int(value)
    except ValueError:
        return -1


class HttpEndpoint(Protocol):
    """What a session needs of its target: where to connect and the encoded requests."""

    host: str
    port: int
    ssl: Any
    requests: list[bytes]
    samples: int


class HttpSession:
    """One keep-alive connection; reconnects after the server closes it."""

    def __init__(self, target: HttpEndpoint) -> None:
        self.target = target
        self.conn: HttpConnection | None = None
        self.started_s = 0.0  # when the request in flight was sent; 0 = none

    async def infer(self, index: int) -> Outcome:
        target = self.target
        conn = self.conn
        if conn is None or conn.closed:
            conn = self.conn = await HttpConnection.open(target.host, target.port, target.ssl)
        self.started_s = time.perf_counter()
        try:
            response = await conn.request(target.requests[index % target.samples])
        finally:
            self.started_s = 0.0
        return self.outcome(response)

    def outcome(self, response: Any) -> Outcome:
        """Status and the server's queue / compute microseconds (-1 where not sent)."""
        headers = response.headers
        return (
            _STATUS_TEXT.get(response.status) or str(response.status),
            _int_header(headers.get("x-queue-time-us")),
            _int_header(headers.get("x-compute-time-us")),
        )

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class HttpTarget:
    """KServe V2 over HTTP/REST.

    ``sample_tokens`` (set after construction, one per sample) sizes each request in tokens
    for the tokens/s figures (:mod:`gpuserve.bench.tokens`); None: sizes unknown.

    Args:
        url: Server base URL, ``http://host:port``.
        info: The model under test.
        samples: Requests to cycle through (see :mod:`gpuserve.bench.inputs`).
        binary: Use the binary tensor extension for inputs and outputs (else JSON).
        timeout_s: A request unanswered this long is failed (``"timeout"``) and its
            connection dropped.
        token: API bearer token of the server, or None.
        ca_file: For an ``https://`` URL, the PEM file that signs the server's certificate;
            None: the system's CAs.
    """

    def __init__(
        self,
        url: str,
        info: ModelInfo,
        samples: list[dict[str, np.ndarray]],
        binary: bool = False,
        timeout_s: float = 30.0,
        token: str | None = None,
        ca_file: str | Path | None = None,
    ) -> None:
        self.sample_tokens: list[int] | None = None
        self.host, self.port, prefix = split_url(url)
        self.ssl = tls_context(ca_file) if is_https(url) else None
        path = f"{prefix}/v2/models/{info.name}"
        if info.version:
            path += f"/versions/{info.version}"
        path += "/infer"
        self.requests: list[bytes] = []
        for sample in samples:
            body, headers = encode_http_body(info, sample, binary)
            headers = {**headers, **auth_headers(token)}
            self.requests.append(build_request("POST", self.host, self.port, path, body, headers))
        self.samples = len(self.requests)
        self.timeout_s = timeout_s
        self.sessions: list[HttpSession] = []
        fmt = "binary" if binary else "json"
        scheme = "https" if self.ssl else "http"
        self.description = f"{scheme} {self.host}:{self.port} {fmt}"

    async def session(self) -> HttpSession:
        session = HttpSession(self)
        self.sessions.append(session)
        return session

    def check_timeouts(self, now: float) -> None:
        """Drop the connection of every request older than ``timeout_s`` (its waiter then
        fails with ``TimeoutError``)."""
        for session in self.sessions:
            started = session.started_s
            if started and now - started > self.timeout_s and session.conn is not None:
                session.conn.abort(TimeoutError("no answer in time"))

    async def close(self) -> None:
        for session in self.sessions:
            session.close()
        self.sessions.clear()


_TYPED_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def _grpc_modules() -> tuple[Any, Any]:
    """The V2 gRPC message and stub modules: gpuserve's own, else tritonclient's."""
    try:
        from gpuserve.protocol.protos import grpc_service_pb2, grpc_service_pb2_grpc

        return grpc_service_pb2, grpc_service_pb2_grpc
    except ImportError:
        pass
    try:
        from tritonclient.grpc import service_pb2, service_pb2_grpc
    except ImportError as err:
        raise RuntimeError(
            "gRPC mode needs the V2 gRPC stubs: gpuserve's gRPC front end or tritonclient[grpc]"
        ) from err
    return service_pb2, service_pb2_grpc


class GrpcSession:
    """One request at a time on the shared channel behind ``stub``."""

    def __init__(self, target: GrpcTarget, stub: object) -> None:
        self.target = target
        self.stub = stub

    async def infer(self, index: int) -> Outcome:
        import grpc

        target = self.target
        call = self.stub.ModelInfer(  # type: ignore[attr-defined]
            target.requests[index % target.samples],
            timeout=target.timeout_s,
            metadata=target.metadata,
        )
        try:
            await call
        except grpc.aio.AioRpcError as err:
            code = err.code()
            return ("timeout" if code == grpc.StatusCode.DEADLINE_EXCEEDED else code.name), -1, -1
        queue_us = compute_us = -1
        for metadata in (await call.initial_metadata(), await call.trailing_metadata()):
            for key, value in metadata or ():
                if key == "x-queue-time-us":
                    queue_us = _int_header(str(value))
                elif key == "x-compute-time-us":
                    compute_us = _int_header(str(value))
        return "OK", queue_us, compute_us

    def close(self) -> None:
        pass


class GrpcTarget:
    """KServe V2 ``inference.GRPCInferenceService`` on grpc.aio.

    Binary mode sends ``raw_input_contents``; JSON mode sends typed ``contents`` (FP16 has no
    typed field and always goes raw). Sessions share ``channels`` HTTP/2 channels round-robin.
    ``token`` (the server's API token) goes with every call as ``authorization`` metadata;
    a ``grpcs://`` address is TLS, checked against ``ca_file`` (PEM) or the system's CAs.
    """

    def __init__(
        self,
        address: str,
        info: ModelInfo,
        samples: list[dict[str, np.ndarray]],
        binary: bool = True,
        timeout_s: float = 30.0,
        channels: int = 2,
        token: str | None = None,
        ca_file: str | Path | None = None,
    ) -> None:
        self.sample_tokens: list[int] | None = None  # as HttpTarget's
        service_pb2, _ = _grpc_modules()
        self.metadata = tuple(auth_headers(token).items()) or None
        self.tls = address.startswith("grpcs://")
        self.root_certificates = Path(ca_file).read_bytes() if self.tls and ca_file else None
        address = address.removeprefix("grpcs://")
        self.address = address.removeprefix("grpc://")
        self.timeout_s = timeout_s
        self._channel_count = max(1, channels)
        self._channels: list = []
        self._stubs: list = []
        self._next = 0
        tensors = {t.name: t for t in info.inputs}
        self.requests = []
        for sample in samples:
            request = service_pb2.ModelInferRequest(
                model_name=info.name, model_version=info.version or ""
            )
            for name, array in sample.items():
                datatype = tensors[name].datatype
                tensor = request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
                if binary or datatype not in _TYPED_FIELD:
                    request.raw_input_contents.append(tensor_bytes(datatype, array))
                else:
                    values = array.ravel().tolist()
                    getattr(tensor.contents, _TYPED_FIELD[datatype]).extend(values)
            for output in info.outputs:
                request.outputs.add(name=output.name)
            self.requests.append(request)
        self.samples = len(self.requests)
        self.description = f"grpc {self.address} {'binary' if binary else 'typed'}"

    async def session(self) -> GrpcSession:
        import grpc

        _, service_pb2_grpc = _grpc_modules()
        if not self._channels:
            options = [
                ("grpc.max_receive_message_length", -1),
                ("grpc.max_send_message_length", -1),
            ]
            for _ in range(self._channel_count):
                if self.tls:
                    credentials = grpc.ssl_channel_credentials(self.root_certificates)
                    channel = grpc.aio.secure_channel(self.address, credentials, options=options)
                else:
                    channel = grpc.aio.insecure_channel(self.address, options=options)
                self._channels.append(channel)
                self._stubs.append(service_pb2_grpc.GRPCInferenceServiceStub(channel))
        # sessions take the channels in turn, spreading their streams over them
        stub = self._stubs[self._next % len(self._stubs)]
        self._next += 1
        return GrpcSession(self, stub)

    def check_timeouts(self, now: float) -> None:
        """gRPC deadlines are set per call; nothing to do."""

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
        self._channels.clear()
        self._stubs.clear()


async def wait_grpc_ready(address: str, timeout_s: float = 10.0) -> None:
    """Wait until the gRPC channel to ``address`` connects.

    Raises:
        TimeoutError: it did not connect in time.
    """
    import grpc

    channel = grpc.aio.insecure_channel(address.removeprefix("grpc://"))
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout_s)
    finally:
        await channel.close()
