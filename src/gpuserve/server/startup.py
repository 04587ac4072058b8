"""Start-up checks that fail fast with one line per problem, naming the setting to change.

``gpuserve serve`` runs :func:`preflight` before it imports the server (torch and the rest):
a model repository that is missing, unreadable or a file, and ports that other processes
hold, end the command at once with exit status 2 and one line per problem (every taken port
at once), such as::

    gpuserve: model repository /srv/modles (--model-repository / GPUSERVE_MODEL_REPOSITORY):
        no such folder
    gpuserve: cannot listen for gRPC on 0.0.0.0:8001 (--grpc-port / GPUSERVE_GRPC_PORT):
        address already in use; choose another port, 0 for a free one, or -1 for no gRPC

(one line, wrapped here). The runner maps a bind that fails later (another process took the
port in between) to the same message through :func:`port_error`. Standard library only, so
the checks cost nothing before the heavy imports.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class StartupError(Exception):
    """The server cannot start; each of :attr:`problems` is one line naming the setting to
    change (the message joins them, one per line)."""

    def __init__(self, *problems: str) -> None:
        super().__init__("\n".join(problems))
        self.problems: tuple[str, ...] = problems


@dataclass(frozen=True, slots=True)
class Listener:
    """One port the server binds.

    Attributes:
        what: What listens there, for the message (``HTTP``, ``gRPC``, ``Prometheus metrics``).
        flag: The ``gpuserve serve`` flag that sets the port.
        env: The environment variable that sets it.
        port: The port; 0 = a free one (never conflicts), negative = not bound.
        way_out: The values that avoid a conflict, for the message.
    """

    what: str
    flag: str
    env: str
    port: int
    way_out: str


class _Ports(Protocol):
    @property
    def http_port(self) -> int: ...
    @property
    def grpc_port(self) -> int: ...
    @property
    def metrics_port(self) -> int | None: ...


def listeners(config: _Ports) -> list[Listener]:
    """The listeners of a server config, in the order the runner binds them."""
    metrics = config.metrics_port if config.metrics_port is not None else -1
    return [
        Listener(
            "Prometheus metrics",
            "--metrics-port",
            "GPUSERVE_METRICS_PORT",
            metrics,
            "0 for a free one, or -1 for /metrics on the HTTP port only",
        ),
        Listener(
            "gRPC",
            "--grpc-port",
            "GPUSERVE_GRPC_PORT",
            config.grpc_port,
            "0 for a free one, or -1 for no gRPC",
        ),
        Listener("HTTP", "--http-port", "GPUSERVE_HTTP_PORT", config.http_port, "0 for a free one"),
    ]


def repository_problem(path: Path) -> str | None:
    """Why ``path`` cannot serve as the model repository, or None when it can.

    A repository is a folder the server can list. The answer names the path and what is
    wrong with it: missing (``no such folder``), a file, or not readable.
    """
    label = f"model repository {path} (--model-repository / GPUSERVE_MODEL_REPOSITORY)"
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return f"{label}: no such folder"
    except NotADirectoryError:
        return f"{label}: no such folder (a part of the path is a file)"
    except OSError as err:
        return f"{label}: cannot be read ({err.strerror or err})"
    if not stat.S_ISDIR(mode):
        return f"{label}: is a file, not a folder of models"
    try:
        with os.scandir(path) as entries:
            next(entries, None)
    except PermissionError:
        return f"{label}: cannot be read (permission denied)"
    except OSError as err:
        return f"{label}: cannot be read ({err.strerror or err})"
    return None


def bind_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound for TCP now (``address already in use``, ...), or
    None. The socket is closed again at once; the reuse setting is asyncio's (a port in
    TIME_WAIT is free)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        return f"--host {host} cannot be resolved ({err.strerror})"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as err:
            return _reason(err)
    return None


def _reason(err: OSError) -> str:
    if err.errno == errno.EADDRINUSE:
        return "address already in use"
    if err.errno == errno.EACCES:
        return "permission denied (ports below 1024 need privileges)"
    if err.errno == errno.EADDRNOTAVAIL:
        return "the --host address is not one of this machine's"
    return err.strerror or str(err)


def port_message(listener: Listener, host: str, reason: str) -> str:
    """The one line for a listener that cannot bind."""
    return (
        f"cannot listen for {listener.what} on {host}:{listener.port} ({listener.flag} / "
        f"{listener.env}): {reason}; choose another port, {listener.way_out}"
    )


def port_error(listener: Listener, host: str, err: BaseException) -> StartupError:
    """A :class:`StartupError` for a bind that failed in the server: the reason from the
    error where it has one (``OSError``), else from a fresh bind attempt (gRPC reports only
    "Failed to bind")."""
    reason = _reason(err) if isinstance(err, OSError) else bind_problem(host, listener.port)
    return StartupError(port_message(listener, host, reason or str(err)))


class _Settings(_Ports, Protocol):
    @property
    def host(self) -> str: ...
    @property
    def model_repository(self) -> Path: ...


def preflight(config: _Settings) -> None:
    """Check the model repository and every fixed port before the server is built, and
    report every problem at once (a second start with the next taken port is not needed).

    Raises:
        StartupError: every problem found, one line each, in bind order.
    """
    problems = []
    problem = repository_problem(config.model_repository)
    if problem is not None:
        problems.append(problem)
    fixed = [listener for listener in listeners(config) if listener.port > 0]
    for index, listener in enumerate(fixed):
        same = next((other for other in fixed[:index] if other.port == listener.port), None)
        if same is not None:
            problems.append(
                f"{same.flag} and {listener.flag} are both {listener.port}: "
                "give each listener its own port"
            )
            continue
        reason = bind_problem(config.host, listener.port)
        if reason is not None:
            problems.append(port_message(listener, config.host, reason))
    if problems:
        raise StartupError(*problems)
