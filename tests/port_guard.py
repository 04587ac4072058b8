"""The default ports are the user's: the test suite holds them while it runs.

gpuserve's defaults (8000 HTTP, 8001 gRPC, 8002 metrics) are where a developer's own server
runs, the README's ``gpuserve serve`` among them. Every test server takes a free port
(:class:`tests.helpers.InProcessServer`, :class:`tests.helpers.SubprocessServer`), and every
client a test runs is pointed at it. :class:`DefaultPortGuard` keeps it so: while the suite
runs it listens on the default ports itself, so

* a server that a test starts on a default port fails to start (the address is in use),
  however it was started (in-process, ``gpuserve serve`` as a child, a docs block);
* a client that a test runs against a default port (a command left with its default
  ``--url``, a docs block whose address was not rewritten) connects to the guard, which
  records the connection against the running test and closes it; ``tests/conftest.py`` fails
  that test naming the port.

When a port is in use already (a developer's server is running), it cannot be held: the
guard checks nothing on that port, and the tests still pass beside that server because none
of them reaches it.
"""

from __future__ import annotations

import selectors
import socket
import threading

#: gpuserve's default HTTP, gRPC and metrics ports.
DEFAULT_PORTS = (8000, 8001, 8002)


class DefaultPortGuard:
    """Listens on ``ports`` (those it can bind) and records who connects (module docstring).

    Args:
        ports: The ports to hold.

    Attributes:
        held: The ports held (listening).
        taken: The ports that were in use already (not checked).
        current: The test running now (its node id), named in the records.
    """

    def __init__(self, ports: tuple[int, ...] = DEFAULT_PORTS) -> None:
        self.held: dict[int, socket.socket] = {}
        self.taken: list[int] = []
        self.current = ""
        self._connections: list[tuple[int, str]] = []
        self._lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        for port in ports:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind(("0.0.0.0", port))
                sock.listen(64)
            except OSError:
                sock.close()
                self.taken.append(port)
                continue
            sock.setblocking(False)
            self.held[port] = sock
            self._selector.register(sock, selectors.EVENT_READ, port)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="default-port-guard", daemon=True)
        if self.held:
            self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.1):
                sock: socket.socket = key.fileobj  # type: ignore[assignment]
                try:
                    conn, _address = sock.accept()
                except OSError:
                    continue
                with self._lock:  # recorded before the client sees the close
                    self._connections.append((key.data, self.current))
                conn.close()

    def take(self) -> list[tuple[int, str]]:
        """The connections made since the last call: (port, test node id)."""
        with self._lock:
            made, self._connections = self._connections, []
        return made

    def close(self) -> None:
        """Stop listening."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        for sock in self.held.values():
            self._selector.unregister(sock)
            sock.close()
        self._selector.close()
        self.held.clear()
