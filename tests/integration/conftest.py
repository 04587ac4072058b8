from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import FIXTURE_REPOSITORY
from tests.helpers import InProcessServer
from tests.integration.frontends import FRONTENDS, Frontend, open_frontend


@pytest.fixture(scope="package")
def server():
    running = InProcessServer(FIXTURE_REPOSITORY)
    yield running
    running.stop()


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, timeout=30.0) as http:
        yield http


@pytest.fixture(params=FRONTENDS)
def frontend_kind(request: pytest.FixtureRequest) -> str:
    """Each test that takes it runs once over HTTP (``http``), once over gRPC (``grpc``)."""
    return str(request.param)


@pytest.fixture()
def frontend(frontend_kind: str, server: InProcessServer) -> Iterator[Frontend]:
    """A client of the shared fixture-repository server over HTTP, then over gRPC."""
    client = open_frontend(frontend_kind, server)
    yield client
    client.close()
