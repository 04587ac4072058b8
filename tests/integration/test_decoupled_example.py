"""``examples/tokens`` (a token-by-token generator, a decoupled model) served by the real
server and streamed by its own client, over HTTP (server-sent events) and gRPC."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import InProcessServer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tokens"
REPLY = "streaming responses arrive one token at a time, as the model produces them"


@pytest.fixture(scope="module")
def server():
    running = InProcessServer(EXAMPLE / "model_repository")
    yield running
    running.stop()


def run_client(*args: str) -> str:
    command = [sys.executable, str(EXAMPLE / "client.py"), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_client_streams_every_token_over_http(server):
    out = run_client("--url", f"127.0.0.1:{server.port}", "hi")
    assert out.split() == ["hi:", *REPLY.split()]


def test_the_client_streams_every_token_over_grpc(server):
    pytest.importorskip("tritonclient.grpc")
    out = run_client("--grpc", "--url", server.grpc_url, "--max-tokens", "4", "yo")
    assert out.split() == ["yo:", *REPLY.split()[:3]]
