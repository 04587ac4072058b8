"""Running the server: model loading, the HTTP and gRPC listeners, and an orderly shutdown.

Start-up is logged step by step; models load in the background so ``/v2/health/live`` answers
at once while ``/v2/health/ready`` stays 503 until loading is done. On SIGTERM/SIGINT (or
:meth:`GpuServer.stop`) readiness turns 503 and new inference requests get 503 "shutting down"
at once, while the listeners stay open (liveness stays 200) until the requests already admitted
have finished, up to ``shutdown_timeout_s`` (BC-25); then the HTTP listener stops accepting,
connections close once their answer is sent, every model version drains what is left of its
queue and unloads, and the process exits with status 0. A second signal skips the wait.

The event loop is uvloop's where it is installed (Linux, macOS), asyncio's otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import ssl
import threading
from collections.abc import Callable
from typing import Any

from gpuserve.config import ServerConfig
from gpuserve.errors import ConfigError
from gpuserve.metrics import MetricsHttpServer, ServerMetrics
from gpuserve.repository.lifecycle.devices import freeze_loaded_objects
from gpuserve.server import logs
from gpuserve.server.batches import batch_api
from gpuserve.server.grpc.server import GrpcServer
from gpuserve.server.http.app import HttpApp
from gpuserve.server.http.listener import HttpListener
from gpuserve.server.security import open_management_warning
from gpuserve.server.startup import StartupError, listeners, port_error, repository_problem
from gpuserve.service.inference import InferenceService

logger = logging.getLogger(__name__)


def configure_logging(level: str, log_format: str = "text", access_log: bool = False) -> None:
    """Timestamped text or JSON-lines logs on stderr (see :mod:`gpuserve.server.logs`)."""
    logs.configure_logging(level, log_format, access_log)


# After the listener stops accepting, connections accepted a moment before get this long to
# deliver their request (and get a 503) before idle connections are closed: without the pause
# a request that raced the close would be dropped without an answer.
_ACCEPT_RACE_GRACE_S = 0.3


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _ssl_context(config: ServerConfig) -> ssl.SSLContext | None:
    """The TLS context of ``--tls-cert-file``/``--tls-key-file``, or None without them.

    Raises:
        StartupError: the files cannot be read or do not hold a matching PEM pair.
    """
    if config.tls_cert_file is None or config.tls_key_file is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
    except (OSError, ssl.SSLError) as err:
        raise StartupError(
            f"--tls-cert-file {config.tls_cert_file} / --tls-key-file {config.tls_key_file}: "
            f"cannot load the certificate and key ({getattr(err, 'strerror', None) or err})"
        ) from None
    return context


class GpuServer:
    """The whole server process: the inference service, HTTP and gRPC front ends on it, and
    the metrics endpoint.

    Args:
        config: Server settings.

    Attributes:
        started: Set once the HTTP listener accepts connections (models may still load).
        loaded: Set once the initial model load has finished (successfully or not).
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        # Expandable segments let the caching allocator grow blocks instead of leaving holes
        # between fixed-size ones, so batches of changing shapes fragment device memory less.
        # Set before any CUDA allocation; a value the operator set wins.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        self.service = InferenceService.from_config(config)
        assert self.service.metrics is not None
        self.metrics: ServerMetrics = self.service.metrics
        self.metrics_server: MetricsHttpServer | None = None
        self.app = HttpApp(self.service, config)
        self.http = HttpListener(
            self.app,
            max_header_bytes=config.max_header_bytes,
            max_body_bytes=config.max_request_body_bytes,
            keep_alive_timeout_s=config.http_keep_alive_timeout_s,
        )
        #: The Batch API's runner (``/v1/files``, ``/v1/batches``); starts after the load.
        self.batches = batch_api(config, self.app, self.metrics)
        self._load_task: asyncio.Task[None] | None = None
        self.grpc: GrpcServer | None = None
        self.started = threading.Event()
        self.loaded = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._exit: asyncio.Event | None = None
        self._stopping = False
        self._forced = False
        self._stop_task: asyncio.Task[None] | None = None
        #: Why the server stopped on its own (the repository could not be read at start),
        #: or None; :meth:`run` then exits with status 1.
        self.fatal: str | None = None

    # -- running ---------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until a signal (or :meth:`stop`) ends it. Blocks.

        Raises:
            SystemExit: (status 1) the model repository is not a readable folder, a listener
                could not be bound, or the TLS files cannot be loaded; one line naming the
                setting is logged (no traceback).
        """
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(self._serve())
        if self.fatal is not None:
            raise SystemExit(1)

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._exit = asyncio.Event()
        signals = threading.current_thread() is threading.main_thread()
        if signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            try:
                await self._startup()
            except StartupError as err:
                logger.error("could not start: %s", err)
                await self._shutdown()
                raise SystemExit(1) from None
            scheme = "https" if self.config.tls_cert_file else "http"
            logger.info(
                "KServe V2 HTTP on %s://%s:%d", scheme, self.config.host, self.http.port or 0
            )
            self.started.set()
            await self._exit.wait()
            await self._close_listener()
            await self._shutdown()
        finally:
            if signals:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

    async def _startup(self) -> None:
        """The repository check, metrics port, gRPC, HTTP listener, then the model load in
        the background.

        Raises:
            StartupError: the repository is not a readable folder, a port cannot be bound,
                or the TLS files cannot be loaded (one line naming the setting).
        """
        config = self.config
        problem = repository_problem(config.model_repository)
        if problem is not None:
            raise StartupError(problem)
        tls = _ssl_context(config)
        warning = open_management_warning(config)
        if warning is not None:
            logger.warning("%s", warning)
        metrics, grpc, http = listeners(config)
        host = config.host
        if metrics.port >= 0:
            self.metrics_server = MetricsHttpServer(self.metrics.registry, host, metrics.port)
            try:
                self.metrics_server.start()
            except OSError as err:
                self.metrics_server = None
                raise port_error(metrics, host, err) from None
        if grpc.port >= 0:  # on this loop; a bind failure fails startup
            self.grpc = GrpcServer(self.service, config)
            try:
                await self.grpc.start()
            except (OSError, RuntimeError) as err:  # grpc.aio reports "Failed to bind"
                self.grpc = None
                raise port_error(grpc, host, err) from None
        try:
            await self.http.start(host, http.port, tls)
        except OSError as err:
            raise port_error(http, host, err) from None
        logger.info("loading models from %s", config.model_repository)
        self._load_task = asyncio.get_running_loop().create_task(self._load())

    async def _load(self) -> None:
        try:
            await self.service.load_all()
        except ConfigError as err:  # the repository folder went away or cannot be read
            self.fatal = str(err)
            logger.error("could not start: %s: stopping", err)
            self.service.initial_load_failed()
            self._exit_now()  # nothing was admitted yet: no drain
        except Exception:
            logger.exception("model repository could not be loaded")
            self.service.initial_load_failed()
        finally:
            freeze_loaded_objects()
            self.loaded.set()
            self.batches.start()  # batch jobs run (and resume) once the models are loaded

    async def _close_listener(self) -> None:
        self.http.stop_accepting()
        if not self._forced:
            await asyncio.sleep(_ACCEPT_RACE_GRACE_S)
        await self.http.close(0.0 if self._forced else self.config.shutdown_timeout_s)

    async def _shutdown(self) -> None:
        logger.info(
            "shutting down: draining model queues (up to %.0f s)", self.config.shutdown_timeout_s
        )
        if self._load_task is not None and not self._load_task.done():
            await self._load_task
        # batch lines in flight finish (their requests drained above); the rest resume later
        await self.batches.close(0.0 if self._forced else self.config.shutdown_timeout_s)
        closing = [self.service.close(self.config.shutdown_timeout_s)]
        if self.grpc is not None:  # new gRPC calls are refused at once; running ones finish
            closing.append(self.grpc.stop(self.config.shutdown_timeout_s))
        await asyncio.gather(*closing)
        if self.metrics_server is not None:
            self.metrics_server.stop()
        self.service.release()
        logger.info("shutdown complete")

    @property
    def manager(self) -> Any:
        """The service's model manager (tests and tools inspect it; front ends go through
        the service)."""
        return self.service.manager

    @property
    def port(self) -> int:
        """The bound HTTP port (useful with ``http_port=0``); valid once started."""
        return self.http.port or self.config.http_port

    @property
    def grpc_port(self) -> int | None:
        """The bound gRPC port (useful with ``grpc_port=0``), None without a gRPC listener;
        valid once started."""
        return self.grpc.port if self.grpc is not None else None

    # -- stopping --------------------------------------------------------------------------

    def _on_signal(self, sig: int) -> None:
        logger.info("received %s: stopping", signal.Signals(sig).name)
        self.stop()

    def stop(self) -> None:
        """Ask the server to shut down gracefully (thread-safe; see the module docstring).
        A second call stops without waiting for in-flight requests."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(self._stop_on_loop)

    def _stop_on_loop(self) -> None:
        if self._stopping:
            self._forced = True
            self._exit_now()
            return
        self._stopping = True
        self.batches.begin_stop()  # no batch line starts: running jobs resume after restart
        self.service.begin_shutdown()  # ready -> 503, new requests -> 503 at once
        self._stop_task = asyncio.get_running_loop().create_task(self._drain_then_exit())

    def _exit_now(self) -> None:
        if self._exit is not None:
            self._exit.set()

    async def _drain_then_exit(self) -> None:
        timeout_s = self.config.shutdown_timeout_s
        logger.info(
            "stopping: refusing new requests, finishing admitted ones (up to %.0f s)", timeout_s
        )
        if not await self.service.wait_idle(timeout_s):
            # Queued requests get 503 now, before the process exits; running batches finish.
            logger.warning("stopping: requests left after %.1f s: refusing them", timeout_s)
            await self.service.close(0.0)
        self._exit_now()
