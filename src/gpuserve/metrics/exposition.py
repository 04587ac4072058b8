"""Serving the registry: ``GET /metrics`` on the HTTP port, and a separate metrics port.

Formats: the Prometheus text format (0.0.4, Triton's only format) whenever the client accepts
it, which includes every Prometheus scrape (its ``Accept`` lists ``text/plain``); OpenMetrics
only for a client that accepts nothing else. In the text format Triton's ``nv_*`` families
(:class:`~gpuserve.metrics.triton.TritonFamily`) are written as Triton writes them: counters
with no ``_total`` (prometheus_client's encoders always add one), integral values as
integers. OpenMetrics requires ``_total`` on
every counter sample, so there the ``nv_*`` counters are typed ``unknown``: the series names
stay Triton's in both formats.

The separate port (``--metrics-port``, default 8002) is a threaded WSGI server on a daemon
thread, bound to the server's host: scrapes never wait behind inference traffic on the event
loop, and a busy event loop never delays a scrape.
"""

from __future__ import annotations

import gzip
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, ThreadingWSGIServer
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from gpuserve.metrics.triton import TritonFamily

logger = logging.getLogger(__name__)


class _Families(Collector):
    """Already collected families, as the collector the encoders want."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def _openmetrics_only(accept: str) -> bool:
    types = {part.split(";")[0].strip() for part in accept.split(",")}
    return "application/openmetrics-text" in types and not types & {"text/plain", "*/*", "text/*"}


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _number(value: float) -> str:
    """Triton's form: integers without a fraction or an exponent."""
    if value.is_integer() and abs(value) < 2**63:
        return str(int(value))
    return floatToGoString(value)


def _triton_text(family: TritonFamily) -> str:
    """One ``nv_*`` family in the text format, as Triton writes it."""
    doc = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
    lines = [f"# HELP {family.name} {doc}\n", f"# TYPE {family.name} {family.type}\n"]
    for s in family.samples:
        labels = ",".join(f'{k}="{_escape_label(v)}"' for k, v in sorted(s.labels.items()))
        braces = f"{{{labels}}}" if labels else ""
        lines.append(f"{s.name}{braces} {_number(float(s.value))}\n")
    return "".join(lines)


def _for_openmetrics(family: Metric) -> Metric:
    """A counter without ``_total`` is not OpenMetrics: typed ``unknown`` there."""
    if family.type != "counter":
        return family
    out = Metric(family.name, family.documentation, "unknown")
    out.samples = list(family.samples)
    return out


def render(registry: Collector, accept: str = "") -> tuple[bytes, str]:
    """The exposition of ``registry`` in the format the ``Accept`` header allows (see the
    module docstring).

    Returns:
        (body, content type)
    """
    families = list(registry.collect())
    if _openmetrics_only(accept):
        converted = [_for_openmetrics(f) if isinstance(f, TritonFamily) else f for f in families]
        return openmetrics.generate_latest(_Families(converted)), openmetrics.CONTENT_TYPE_LATEST
    triton = [f for f in families if isinstance(f, TritonFamily)]
    rest = _Families(f for f in families if not isinstance(f, TritonFamily))
    body = generate_latest(rest) + "".join(_triton_text(f) for f in triton).encode()
    return body, CONTENT_TYPE_PLAIN_0_0_4


def metrics_app(registry: Collector) -> Callable[..., Iterable[bytes]]:
    """A WSGI application answering every GET with :func:`render` (gzip when accepted)."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [b"use GET\n"]
        body, content_type = render(registry, environ.get("HTTP_ACCEPT", ""))
        headers = [("Content-Type", content_type)]
        if "gzip" in environ.get("HTTP_ACCEPT_ENCODING", ""):
            body = gzip.compress(body, compresslevel=1)
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers)
        return [body]

    return app


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged (one line per scrape every few seconds is noise)."""


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
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind and start serving.

        Raises:
            OSError: the port cannot be bound (in use, no permission).
        """
        infos = socket.getaddrinfo(
            self.host, self.requested_port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, address = infos[0][0], str(infos[0][4][0])

        class _Server(ThreadingWSGIServer):
            address_family = family

        server = make_server(
            address,
            self.requested_port,
            metrics_app(self.registry),
            _Server,
            handler_class=_QuietHandler,
        )
        thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
        thread.start()
        self._server, self._thread = server, thread
        logger.info("metrics on http://%s:%d/metrics", self.host, self.port)

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        if self._server is None:
            return self.requested_port
        return int(self._server.server_port)

    def stop(self) -> None:
        """Stop serving and release the port."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(5.0)
