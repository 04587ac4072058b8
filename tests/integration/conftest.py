from __future__ import annotations

import httpx
import pytest

from tests.conftest import FIXTURE_REPOSITORY
from tests.helpers import InProcessServer


@pytest.fixture(scope="package")
def server():
    running = InProcessServer(FIXTURE_REPOSITORY)
    yield running
    running.stop()


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, timeout=30.0) as http:
        yield http
