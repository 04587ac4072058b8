"""Serving the registry: ``GET /metrics`` on the HTTP port, and a separate metrics port.

The separate port (``--metrics-port``, default 8002) is prometheus_client's threaded WSGI
server on a daemon thread, bound to the server's host: scrapes never wait behind inference
traffic on the event loop, and a busy event loop never delays a scrape.
"""

from __future__ import annotations

import logging
import threading

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.exposition import choose_encoder

logger = logging.getLogger(__name__)


def render(registry: CollectorRegistry, accept: str = "") -> tuple[bytes, str]:
    """The exposition of ``registry`` in the format the ``Accept`` header asks for
    (OpenMetrics if asked, else the Prometheus text format).

    Returns:
        (body, content type)
    """
    encoder, content_type = choose_encoder(accept)
    return encoder(registry), content_type


class MetricsHttpServer:
    """``/metrics`` on its own port and thread.

    Args:
        registry: What to serve.
        host: Bind address.
        port: Port; 0 picks a free one (see :attr:`port` once started).
    """

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self.registry = registry
        self.host = host
        self.requested_port = port
        self._server: object | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind and start serving.

        Raises:
            OSError: the port cannot be bound (in use, no permission).
        """
        server, thread = start_http_server(self.requested_port, self.host, self.registry)
        self._server, self._thread = server, thread
        logger.info("metrics on http://%s:%d/metrics", self.host, self.port)

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        if self._server is None:
            return self.requested_port
        return int(self._server.server_port)  # type: ignore[attr-defined]

    def stop(self) -> None:
        """Stop serving and release the port."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()  # type: ignore[attr-defined]
        server.server_close()  # type: ignore[attr-defined]
        if self._thread is not None:
            self._thread.join(5.0)
