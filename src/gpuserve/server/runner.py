"""Running the server: model loading, the HTTP listener, and an orderly shutdown.

Start-up is logged step by step; models load in the background so ``/v2/health/live`` answers
at once while ``/v2/health/ready`` stays 503 until loading is done. On SIGTERM/SIGINT (or
:meth:`GpuServer.stop`) readiness turns 503 and new inference requests get 503 "shutting down"
at once, while the listeners stay open (liveness stays 200) until the requests already admitted
have finished, up to ``shutdown_timeout_s`` (BC-25); then uvicorn stops accepting
connections, every model version drains what is left of its queue and unloads. A second
signal skips the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from gpuserve.config import ServerConfig
from gpuserve.metrics import MetricsHttpServer, ServerMetrics
from gpuserve.repository.manager import ModelManager
from gpuserve.server import logs
from gpuserve.server.grpc.server import GrpcServer
from gpuserve.server.http.app import HttpApp
from gpuserve.server.http.headers import head_limited_protocol

logger = logging.getLogger(__name__)


def configure_logging(level: str, log_format: str = "text", access_log: bool = False) -> None:
    """Timestamped text or JSON-lines logs on stderr (see :mod:`gpuserve.server.logs`)."""
    logs.configure_logging(level, log_format, access_log)


_ACCEPT_RACE_GRACE_S = 0.3


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, except that SIGTERM/SIGINT end the process with exit code 0 after the
    graceful shutdown (uvicorn re-raises the signal, which would end it with -15).

    With ``on_stop`` set, the first signal calls it (the server drains, then sets
    ``should_exit``) instead of stopping at once."""

    on_stop: Callable[[], None] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        # Stop accepting, then give connections accepted a moment ago the time to deliver
        # their request (and get a 503) before idle connections are closed: without the pause
        # a request that raced the close is dropped without an answer.
        for server in self.servers:
            server.close()
        await asyncio.sleep(_ACCEPT_RACE_GRACE_S)
        await super().shutdown(sockets)

    def _on_signal(self, sig: int, frame: object) -> None:
        logger.info("received %s: stopping", signal.Signals(sig).name)
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        if self.on_stop is not None:
            self.on_stop()
        else:
            self.should_exit = True


class GpuServer:
    """The whole server process: manager + HTTP front end.

    Args:
        config: Server settings.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        # Expandable segments let the caching allocator grow blocks instead of leaving holes
        # between fixed-size ones, so batches of changing shapes fragment device memory less.
        # Set before any CUDA allocation; a value the operator set wins.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        self.manager = ModelManager.from_config(config)
        self.metrics = ServerMetrics(self.manager)
        self.manager.version_listeners.append(self.metrics.watch_version)
        self.metrics_server: MetricsHttpServer | None = None
        self.app = HttpApp(
            self.manager, config, self._startup, self._shutdown, metrics=self.metrics
        )
        self._load_task: asyncio.Task[None] | None = None
        self.grpc: GrpcServer | None = None
        self.uvicorn = _Uvicorn(
            uvicorn.Config(
                self.app,
                host=config.host,
                port=config.http_port,
                loop="uvloop",
                # httptools, with a cap on the request head (431 beyond max_header_bytes)
                http=head_limited_protocol(config.max_header_bytes),
                lifespan="on",
                ssl_certfile=config.tls_cert_file,
                ssl_keyfile=config.tls_key_file,
                access_log=False,
                # JSON logs: uvicorn's own lines go through the root handler as JSON too.
                log_config=None if config.log_format == "json" else uvicorn.config.LOGGING_CONFIG,
                log_level=config.log_level,
                timeout_graceful_shutdown=int(config.shutdown_timeout_s) or None,
                backlog=4096,
            )
        )
        self.loaded = threading.Event()
        self.uvicorn.on_stop = self.stop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._stop_task: asyncio.Task[None] | None = None

    async def _startup(self) -> None:
        port = self.config.metrics_port
        if port is not None and port >= 0:  # OSError (port in use) fails the startup
            self.metrics_server = MetricsHttpServer(self.metrics.registry, self.config.host, port)
            self.metrics_server.start()
        if self.config.grpc_port >= 0:  # on this (uvicorn's) loop; a bind failure fails startup
            self.grpc = GrpcServer(self.manager, self.config, self.metrics)
            await self.grpc.start()
        logger.info("loading models from %s", self.config.model_repository)
        self._loop = asyncio.get_running_loop()
        self._load_task = self._loop.create_task(self._load())

    async def _load(self) -> None:
        try:
            await self.manager.load_all()
        except Exception:
            logger.exception("model repository could not be loaded")
            self.manager.initial_load_done = True
        finally:
            self.loaded.set()

    async def _shutdown(self) -> None:
        logger.info(
            "shutting down: draining model queues (up to %.0f s)", self.config.shutdown_timeout_s
        )
        if self._load_task is not None and not self._load_task.done():
            await self._load_task
        closing = [self.manager.close(self.config.shutdown_timeout_s)]
        if self.grpc is not None:  # new gRPC calls are refused at once; running ones finish
            closing.append(self.grpc.stop(self.config.shutdown_timeout_s))
        await asyncio.gather(*closing)
        if self.metrics_server is not None:
            self.metrics_server.stop()
        self.metrics.close()
        logger.info("shutdown complete")

    @property
    def port(self) -> int:
        """The bound HTTP port (useful with ``http_port=0``); valid once started."""
        for server in self.uvicorn.servers:
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        return self.config.http_port

    @property
    def grpc_port(self) -> int | None:
        """The bound gRPC port (useful with ``grpc_port=0``), None without a gRPC listener;
        valid once started."""
        return self.grpc.port if self.grpc is not None else None

    def run(self) -> None:
        """Serve until a signal (or :meth:`stop`) ends it. Blocks."""
        self.uvicorn.run()

    def stop(self) -> None:
        """Ask the server to shut down gracefully (thread-safe; see the module docstring).
        A second call stops without waiting for in-flight requests."""
        loop = self._loop
        if self._stopping or loop is None or loop.is_closed():
            self.uvicorn.should_exit = True
            return
        self._stopping = True
        loop.call_soon_threadsafe(self._begin_stop)

    def _begin_stop(self) -> None:
        self.manager.shutting_down = True  # ready -> 503, new requests -> 503 at once
        self._stop_task = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        timeout_s = self.config.shutdown_timeout_s
        logger.info(
            "stopping: refusing new requests, finishing admitted ones (up to %.0f s)", timeout_s
        )
        if not await self.manager.wait_idle(timeout_s):
            # Queued requests get 503 now, before the process exits; running batches finish.
            logger.warning("stopping: requests left after %.1f s: refusing them", timeout_s)
            await self.manager.close(0.0)
        self.uvicorn.should_exit = True
