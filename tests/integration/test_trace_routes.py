"""A client's W3C ``traceparent`` joins its trace on every route that runs a model, not only
V2's: OpenAI's embeddings, completions and chat completions, TEI's embed, sparse, predict,
rerank and similarity routes, Cohere's rerank. And a server whose collector is gone exits
promptly on SIGTERM.

The server runs with ``mode=opentelemetry`` and ``rate=0``: only requests carrying a client's
context are traced, so a span in the client's trace is one that joined it. Every span the
call made (one per chunk: a call of 6 inputs on a model batching 4 rows is 2 requests) must
be a child of the client's span.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra (opentelemetry-sdk)")

from tests.fixtures import gated_rows
from tests.fixtures.otlp_receiver import Receiver, of_trace
from tests.helpers import InProcessServer, SubprocessServer, free_port

ROWS = ["a", "bb", "ccc", "dddd", "eeeee", "ffffff"]  # 2 chunks of at most 4 rows

#: route -> (body, the model whose spans the call makes, requests it makes)
ROUTES: dict[str, tuple[dict[str, Any], str, int]] = {
    "/v1/embeddings": ({"model": "rows", "input": ROWS}, "rows", 2),
    "/embed": ({"model": "rows", "inputs": ROWS}, "rows", 2),
    "/embed_sparse": ({"model": "rows", "inputs": ROWS}, "rows", 2),
    "/predict": ({"model": "rows", "inputs": ROWS}, "rows", 2),
    "/rerank": ({"model": "rows", "query": "q", "texts": ROWS}, "rows", 2),
    "/v1/rerank": ({"model": "rows", "query": "q", "documents": ROWS}, "rows", 2),
    "/similarity": (
        {"model": "rows", "inputs": {"source_sentence": "q", "sentences": ROWS[:5]}},
        "rows",
        2,
    ),
    "/v1/completions": ({"model": "chat", "prompt": "The quick", "max_tokens": 2}, "chat", 1),
    "/v1/chat/completions": (
        {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        "chat",
        1,
    ),
}


@pytest.fixture(scope="module")
def receiver():
    running = Receiver()
    yield running
    running.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory, receiver):
    from tests.fixtures.chat_models import write_tiny_chat

    root = tmp_path_factory.mktemp("trace_routes")
    gated_rows.write(root, "rows", gated=False)
    write_tiny_chat(root / "chat" / "1")
    (root / "chat" / "config.yaml").write_text(
        "backend: huggingface\n"
        "instance_group: [{kind: cpu}]\n"
        "huggingface: {task: text-generation}\n"
        "generate: {block_size: 8, max_running: 4, max_tokens_per_step: 64,\n"
        "           sampling: {max_tokens: 4, temperature: 0.0}}\n"
    )
    running = InProcessServer(
        root,
        trace_config=[
            "mode=opentelemetry",
            f"opentelemetry,url={receiver.url}",
            "opentelemetry,bsp_schedule_delay=50",
            "rate=0",  # only requests that carry a client's context
            "level=TIMESTAMPS",
            "count=-1",
        ],
    )
    yield running
    running.stop()


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_clients_traceparent_joins_its_trace(server, receiver, route):
    body, model, requests = ROUTES[route]
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    answer = httpx.post(
        f"{server.url}{route}",
        json=body,
        headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text

    def joined(spans: list[dict[str, Any]]) -> bool:
        return len([s for s in of_trace(spans, trace_id) if s["name"] == model]) >= requests

    spans = receiver.wait_for(joined)
    roots = [s for s in of_trace(spans, trace_id) if s["name"] == model]
    assert len(roots) == requests
    assert all(s["parent"] == client_span for s in roots), roots
    assert all(s["kind"] == 2 for s in roots)  # SPAN_KIND_SERVER


def test_sigterm_exits_promptly_when_the_collector_is_gone(tmp_path):
    gated_rows.write(tmp_path, "rows", gated=False)
    dead = free_port()  # nothing listens there
    server = SubprocessServer(
        "--model-repository",
        str(tmp_path),
        "--trace-config",
        "mode=opentelemetry",
        "--trace-config",
        f"opentelemetry,url=http://127.0.0.1:{dead}/v1/traces",
        "--trace-config",
        "rate=1",
        "--trace-config",
        "level=TIMESTAMPS",
    )
    try:
        for _ in range(3):  # spans the exporter cannot deliver
            answer = httpx.post(
                f"{server.url}/v1/embeddings", json={"model": "rows", "input": "x"}, timeout=30
            )
            assert answer.status_code == 200, answer.text
    finally:
        started = time.monotonic()
        code = server.stop(timeout_s=60)
        took = time.monotonic() - started
    output = server.output()
    assert code == 0, output[-3000:]
    # the exporter would retry for 10 s; the last export is bounded by bsp_export_timeout
    # (3 s by default)
    assert took < 6.0, (took, output[-3000:])
