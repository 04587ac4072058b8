"""The HTTP listener: the listening socket and its :class:`HttpConnection` s, with an orderly
close (idle connections at once, busy ones after their answer, the rest aborted at a timeout).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from gpuserve.server.http.connection import _READ_BUFFER, Handler, HttpConnection

logger = logging.getLogger(__name__)


class HttpListener:
    """The listening socket and its connections.

    Args:
        handler: Answers each request.
        max_header_bytes / max_body_bytes / keep_alive_timeout_s: See :class:`HttpConnection`.
    """

    def __init__(
        self,
        handler: Handler,
        max_header_bytes: int,
        max_body_bytes: int,
        keep_alive_timeout_s: float,
    ) -> None:
        self.connections: set[HttpConnection] = set()
        self.server: asyncio.base_events.Server | None = None
        self._all_closed: asyncio.Event | None = None
        # Every connection of this listener's loop shares one read buffer (see HttpConnection).
        self._connection = functools.partial(
            HttpConnection,
            handler,
            max_header_bytes,
            max_body_bytes,
            keep_alive_timeout_s,
            self._closed,
            self.connections.add,
            memoryview(bytearray(_READ_BUFFER)),
        )

    def _closed(self, connection: HttpConnection) -> None:
        self.connections.discard(connection)
        if not self.connections and self._all_closed is not None:
            self._all_closed.set()

    async def start(self, host: str, port: int, ssl: Any = None, backlog: int = 4096) -> None:
        """Listen on ``host:port`` (``port`` 0 picks a free one).

        Raises:
            OSError: the address cannot be bound (in use, no permission).
        """
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(
            self._connection, host, port, ssl=ssl, backlog=backlog, reuse_address=True
        )

    @property
    def port(self) -> int | None:
        """The bound port, or None before :meth:`start`."""
        if self.server is None:
            return None
        for sock in self.server.sockets:
            return int(sock.getsockname()[1])
        return None

    def stop_accepting(self) -> None:
        if self.server is not None:
            self.server.close()

    async def close(self, timeout_s: float) -> None:
        """Close idle connections now and the others once their current answer is sent;
        after ``timeout_s`` seconds abort those left."""
        self.stop_accepting()
        self._all_closed = asyncio.Event()
        for connection in list(self.connections):
            connection.shutdown()
        if self.connections:
            try:
                await asyncio.wait_for(self._all_closed.wait(), timeout_s)
            except TimeoutError:
                logger.warning(
                    "closing %d HTTP connections whose requests did not finish in %.1f s",
                    len(self.connections),
                    timeout_s,
                )
                for connection in list(self.connections):
                    connection.abort()
        if self.server is not None:
            self.server.close()
