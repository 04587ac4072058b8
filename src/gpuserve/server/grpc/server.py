"""The gRPC listener: a grpc.aio server on the server's event loop.

It serves :class:`~gpuserve.server.grpc.service.InferenceServicer` and the standard health
service next to the HTTP front end, on the same asyncio loop (uvloop), so requests of both
protocols meet in the same model queues and batches. Messages up to
``max_request_body_bytes`` are accepted (the HTTP body limit); larger ones are refused with
RESOURCE_EXHAUSTED by gRPC itself, as is metadata beyond ``max_header_bytes``. With
``tls_cert_file``/``tls_key_file`` the port speaks TLS only; with an API token, calls need it
in their ``authorization`` metadata (:mod:`gpuserve.server.grpc.auth`).
"""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health_pb2_grpc

from gpuserve.config import ServerConfig
from gpuserve.server.grpc.auth import TokenInterceptor
from gpuserve.server.grpc.health import HealthServicer
from gpuserve.server.grpc.service import SERVICE_NAME, InferenceServicer, handlers
from gpuserve.service.inference import InferenceService

logger = logging.getLogger(__name__)


def bind_address(host: str, port: int) -> str:
    """``host:port`` as gRPC wants it (IPv6 literals in brackets)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from ``tls_cert_file``/``tls_key_file`` (PEM), or None without them.

    Raises:
        RuntimeError: a file cannot be read.
    """
    if config.tls_cert_file is None or config.tls_key_file is None:
        return None
    try:
        key = config.tls_key_file.read_bytes()
        chain = config.tls_cert_file.read_bytes()
    except OSError as err:
        raise RuntimeError(f"cannot read the TLS certificate or key: {err}") from None
    return grpc.ssl_server_credentials([(key, chain)])


class GrpcServer:
    """Start and stop the gRPC front end.

    Args:
        service: The inference service the calls go to.
        config: Server settings (``host``, ``grpc_port``; 0 picks a free port).
    """

    def __init__(self, service: InferenceService, config: ServerConfig) -> None:
        self.service = service
        self.config = config
        self.port: int | None = None
        self.servicer = InferenceServicer(service, config)
        self._server: grpc.aio.Server | None = None

    async def start(self) -> int:
        """Bind and start serving; returns the bound port. Call on the serving event loop.

        Raises:
            RuntimeError: the port cannot be bound.
        """
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", self.config.max_request_body_bytes),
                ("grpc.max_send_message_length", -1),
                # Refuse to share a port with another process: a second server on the same
                # port must fail at start, not silently split the traffic.
                ("grpc.so_reuseport", 0),
                ("grpc.max_metadata_size", self.config.max_header_bytes),
            ],
            interceptors=[TokenInterceptor(self.config)] if self.config.api_token else None,
        )
        methods = handlers(self.servicer)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, methods),)
        )
        server.add_registered_method_handlers(SERVICE_NAME, methods)
        health_pb2_grpc.add_HealthServicer_to_server(
            HealthServicer(self.service, (SERVICE_NAME,)), server
        )
        address = bind_address(self.config.host, self.config.grpc_port)
        try:
            credentials = server_credentials(self.config)
            if credentials is None:
                port = server.add_insecure_port(address)
            else:
                port = server.add_secure_port(address, credentials)
        except RuntimeError as err:
            raise RuntimeError(f"cannot listen for gRPC on {address}: {err}") from None
        if port == 0:
            raise RuntimeError(f"cannot listen for gRPC on {address}")
        await server.start()
        self._server = server
        self.port = port
        logger.info(
            "gRPC listening on %s%s",
            bind_address(self.config.host, port),
            " (TLS)" if credentials is not None else "",
        )
        return port

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls at once, let running ones finish for up to ``grace_s`` seconds,
        then cancel what is left (their clients get CANCELLED)."""
        if self._server is None:
            return
        logger.info("gRPC: stopping (up to %.0f s for running calls)", grace_s)
        await self._server.stop(grace_s)
        self._server = None
