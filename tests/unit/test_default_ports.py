"""The suite never binds nor reaches gpuserve's default ports (8000, 8001, 8002): they belong
to the user's own server. tests/port_guard.py holds them while the suite runs (the session
fixture of tests/conftest.py); these tests check that a guard catches a server started on its
port and a client pointed at it, on a free port (so they run whoever holds the defaults), and
that the suite's guard holds the defaults when they are free."""

from __future__ import annotations

import socket

import pytest

from gpuserve.config import ServerConfig
from tests.helpers import free_port
from tests.port_guard import DEFAULT_PORTS, DefaultPortGuard


@pytest.fixture()
def guard():
    held = DefaultPortGuard((free_port(),))
    yield held
    held.close()


def test_the_guarded_ports_are_the_defaults():
    defaults = ServerConfig()
    assert (defaults.http_port, defaults.grpc_port, defaults.metrics_port) == DEFAULT_PORTS


def test_a_server_on_a_guarded_port_cannot_start(guard):
    (port,) = guard.held
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gpuserve binds
    try:
        with pytest.raises(OSError):
            sock.bind(("127.0.0.1", port))
    finally:
        sock.close()


def test_a_client_on_a_guarded_port_is_recorded_against_the_test(guard):
    (port,) = guard.held
    guard.current = "tests/x.py::test_y"
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.settimeout(5)
        assert conn.recv(1) == b""  # accepted, recorded, closed
    assert guard.take() == [(port, "tests/x.py::test_y")]
    assert guard.take() == []


def test_the_suite_holds_every_free_default_port(default_ports_held):
    assert sorted([*default_ports_held.held, *default_ports_held.taken]) == list(DEFAULT_PORTS)
    for port in default_ports_held.taken:  # in use by another process: tests must not reach it
        with socket.socket() as sock, pytest.raises(OSError):
            sock.bind(("0.0.0.0", port))
