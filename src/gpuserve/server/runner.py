"""Running the server: model loading, the HTTP listener, and an orderly shutdown.

Start-up is logged step by step; models load in the background so ``/v2/health/live`` answers
at once while ``/v2/health/ready`` stays 503 until loading is done. On SIGTERM/SIGINT uvicorn
stops accepting connections and lets in-flight requests finish (up to
``shutdown_timeout_s``); then every model version drains its queue and unloads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

import uvicorn

from gpuserve.config import ServerConfig
from gpuserve.repository.manager import ModelManager
from gpuserve.server.http.app import HttpApp

logger = logging.getLogger(__name__)


def configure_logging(level: str) -> None:
    """Plain timestamped logs on stderr; the access logger only shows at debug."""
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
    )


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, except that SIGTERM/SIGINT end the process with exit code 0 after the
    graceful shutdown (uvicorn re-raises the signal, which would end it with -15)."""

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

    def _on_signal(self, sig: int, frame: object) -> None:
        logger.info("received %s: stopping", signal.Signals(sig).name)
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True


class GpuServer:
    """The whole server process: manager + HTTP front end.

    Args:
        config: Server settings.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.manager = ModelManager(config.model_repository)
        self.app = HttpApp(self.manager, config, self._startup, self._shutdown)
        self._load_task: asyncio.Task[None] | None = None
        self.uvicorn = _Uvicorn(
            uvicorn.Config(
                self.app,
                host=config.host,
                port=config.http_port,
                loop="uvloop",
                http="httptools",
                lifespan="on",
                access_log=False,
                log_level=config.log_level,
                timeout_graceful_shutdown=int(config.shutdown_timeout_s) or None,
                backlog=4096,
            )
        )
        self.loaded = threading.Event()

    async def _startup(self) -> None:
        logger.info("loading models from %s", self.config.model_repository)
        self._load_task = asyncio.get_running_loop().create_task(self._load())

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
        await self.manager.close(self.config.shutdown_timeout_s)
        logger.info("shutdown complete")

    @property
    def port(self) -> int:
        """The bound HTTP port (useful with ``http_port=0``); valid once started."""
        for server in self.uvicorn.servers:
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        return self.config.http_port

    def run(self) -> None:
        """Serve until a signal (or :meth:`stop`) ends it. Blocks."""
        self.uvicorn.run()

    def stop(self) -> None:
        """Ask the server to shut down gracefully (thread-safe)."""
        self.uvicorn.should_exit = True
