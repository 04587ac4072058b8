"""The REST front end's routing table (HttpApp.routes): every row is reachable, first match
wins, HEAD routes as GET, and a path no row takes is 404 (GET/POST, or outside /v2) or 405."""

from __future__ import annotations

import asyncio
from typing import Any
from unittest.mock import MagicMock

import orjson
import pytest

from gpuserve.config import ServerConfig
from gpuserve.server.http.app import HttpApp
from gpuserve.server.http.routes import compile_routes


class FakeRequest:
    """What HttpApp reads of a request, and the answer it gives."""

    def __init__(self, method: str, path: str, query: bytes = b"", headers: Any = ()) -> None:
        self.method, self.path, self.query = method, path, query
        self.headers = list(headers)
        self.body = b""
        self.started_s = 0.0
        self.access = None
        self.client = None
        self.answers: list[tuple[int, bytes]] = []

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k == name), None)

    def is_disconnected(self) -> bool:
        return False

    def respond(self, status: int, body: bytes, content_type: bytes, headers: Any) -> None:
        self.answers.append((status, body))


def _app(tmp_path: Any, **config: Any) -> HttpApp:
    service = MagicMock()  # metrics on: the /metrics row is in the table
    return HttpApp(service, ServerConfig(model_repository=str(tmp_path), **config))


#: One request per row, keyed by the row's matcher: (method, path, query, the row's params).
SAMPLES: dict[str, tuple[str, str, bytes, Any]] = {
    "Mount('/v1')": ("POST", "/v1/embeddings", b"", ()),
    "Suffix('/infer')": ("POST", "/v2/models/m/versions/2/infer", b"", None),
    "ModelAction('generate', 'generate_stream')": (
        "POST",
        "/v2/models/m/generate_stream",
        b"",
        ("m", None, "generate_stream"),
    ),
    "Exact('/metrics')": ("GET", "/metrics", b"", None),
    "Mount('/v2/repository')": ("POST", "/v2/repository/models/m/load", b"", ()),
    "Where(handles)": ("PUT", "/v2/logging", b"", None),  # any method: the table answers
    "Exact('/v2/health/live')": ("HEAD", "/v2/health/live/", b"", ()),
    "Exact('/v2/health/ready')": ("GET", "/v2/health/ready", b"", ()),
    "Exact('/v2')": ("GET", "/v2/", b"", ()),
    "Exact('/v2/openapi.json')": ("GET", "/v2/openapi.json", b"", ()),
    "Exact('/v2/models/stats')": ("GET", "/v2/models/stats", b"", ()),
    "Exact('/v2/models')": ("GET", "/v2/models/", b"", ()),
    "ModelView('')": ("GET", "/v2/models/m/versions/3", b"", ("m", "3", "")),
    "ModelView('ready')": ("HEAD", "/v2/models/m/ready", b"", ("m", None, "ready")),
    "ModelView('config')": (
        "GET",
        "/v2/models/m/config",
        b"format=gpuserve",
        ("m", None, "config"),
    ),
    "ModelView('config/gpuserve')": (
        "GET",
        "/v2/models/m/config/gpuserve/",
        b"",
        ("m", None, "config/gpuserve"),
    ),
    "ModelView('stats')": ("GET", "/v2/models/m/versions/1/stats", b"", ("m", "1", "stats")),
    "Exact('/v2/rerank')": ("POST", "/v2/rerank", b"", None),
    "Exact('/rerank')": ("POST", "/rerank", b"", None),
    "Exact('/predict')": ("POST", "/predict", b"", None),
    "Exact('/embed')": ("POST", "/embed", b"", None),
    "Exact('/embed_sparse')": ("POST", "/embed_sparse", b"", None),
    "Exact('/tokenize')": ("POST", "/tokenize", b"", None),
    "Exact('/similarity')": ("POST", "/similarity", b"", None),
    "Exact('/')": ("POST", "/", b"", None),
    "Mount('/models')": ("POST", "/models/m", b"", ()),
    "Exact('/health')": ("GET", "/health", b"", None),
    "Exact('/info')": ("HEAD", "/info", b"", None),
    "Where(model_view_path)": ("GET", "/models/m/info", b"", None),
}


def _recording(app: HttpApp) -> list[tuple[int, Any]]:
    """Swap every row's handler (and the inlined hot path's) for one that records
    (row index, params)."""
    hits: list[tuple[int, Any]] = []

    def recorder(index: int) -> Any:
        def handler(request: Any, method: str, params: Any) -> None:
            hits.append((index, params))

        return handler

    rows = app.routes()
    infer = next(i for i, row in enumerate(rows) if row.handler == app._infer)
    app._infer = recorder(infer)  # type: ignore[method-assign]
    app._table = tuple(
        (methods, quick, match, recorder(i), own)
        for i, (methods, quick, match, _, own) in enumerate(compile_routes(rows))
    )
    return hits


def test_every_row_of_the_table_is_reachable(tmp_path):
    app = _app(tmp_path)
    rows = app.routes()
    assert sorted(repr(row.path) for row in rows) == sorted(SAMPLES)  # a sample per row
    assert len(compile_routes(rows)) == len(rows)  # every row in effect (metrics on)
    hits = _recording(app)
    for index, row in enumerate(rows):
        method, path, query, params = SAMPLES[repr(row.path)]
        hits.clear()
        app.handle(FakeRequest(method, path, query))  # type: ignore[arg-type]
        assert hits == [(index, params)], (method, path, row)


def test_the_inference_row_is_the_first_v2_row_and_the_mount_keeps_v1(tmp_path):
    app = _app(tmp_path)
    rows = app.routes()
    assert repr(rows[0].path) == "Mount('/v1')" and rows[0].own_auth
    assert rows[1].handler == app._infer and repr(rows[1].path) == "Suffix('/infer')"
    hits = _recording(app)
    for path in ("/v1/models/m/infer", "/v1"):
        hits.clear()
        app.handle(FakeRequest("POST", path))  # type: ignore[arg-type]
        assert hits == [(0, ())]  # OpenAI's, not inference
    hits.clear()
    app.handle(FakeRequest("POST", "/v1x/infer"))  # type: ignore[arg-type]
    assert hits == [(1, None)]


def test_metrics_off_drops_its_row(tmp_path):
    service = MagicMock()
    service.metrics = None
    app = HttpApp(service, ServerConfig(model_repository=str(tmp_path)))
    request = FakeRequest("GET", "/metrics")
    app.handle(request)  # type: ignore[arg-type]
    assert request.answers == [(404, b'{"error":"no endpoint GET /metrics"}')]


@pytest.mark.parametrize(
    ("method", "status"),
    [("GET", 404), ("HEAD", 404), ("POST", 404), ("PUT", 405), ("DELETE", 405), ("PATCH", 405)],
)
@pytest.mark.parametrize("path", ["/v2/nothing/here", "/v2/models/m/unknown", "/v2/health"])
def test_an_unknown_path_under_v2_is_404_for_get_and_post_else_405(tmp_path, method, path, status):
    app = _app(tmp_path)
    request = FakeRequest(method, path)
    app.handle(request)  # type: ignore[arg-type]
    [(got, body)] = request.answers
    assert got == status
    routed = "GET" if method == "HEAD" else method
    assert orjson.loads(body) == {"error": f"no endpoint {routed} {path}"}


@pytest.mark.parametrize("method", ["GET", "POST", "PUT", "DELETE"])
def test_an_unknown_path_outside_v2_is_404(tmp_path, method):
    app = _app(tmp_path)
    request = FakeRequest(method, "/nothing")
    app.handle(request)  # type: ignore[arg-type]
    assert [status for status, _ in request.answers] == [404]


def test_the_api_token_is_checked_before_the_404_but_not_on_open_paths(tmp_path):
    app = _app(tmp_path, api_token="s3cret")
    unknown = FakeRequest("GET", "/v2/nothing")
    app.handle(unknown)  # type: ignore[arg-type]
    assert [status for status, _ in unknown.answers] == [401]
    open_path = FakeRequest("POST", "/v2/health/live")  # open path, no such row: 404
    app.handle(open_path)  # type: ignore[arg-type]
    assert [status for status, _ in open_path.answers] == [404]
    live = FakeRequest("GET", "/v2/health/live")
    app.handle(live)  # type: ignore[arg-type]
    assert live.answers == [(200, b'{"live":true}')]
    infer = FakeRequest("POST", "/v2/models/m/infer")
    app.handle(infer)  # type: ignore[arg-type]
    assert [status for status, _ in infer.answers] == [401]
    app.service.record_unrouted.assert_called_once_with("m", None, "unauthorized")  # type: ignore[attr-defined]


@pytest.mark.parametrize("cold", [False, True])
def test_inference_makes_a_task_only_for_a_cold_model(tmp_path, cold):
    app = _app(tmp_path)
    app.service.cold.return_value = cold  # type: ignore[attr-defined]

    async def main() -> int:
        app.handle(FakeRequest("POST", "/v2/models/m/versions/1/infer"))  # type: ignore[arg-type]
        tasks = len(app._tasks)
        await asyncio.sleep(0)
        return tasks

    assert asyncio.run(main()) == (1 if cold else 0)
    app.service.cold.assert_called_once_with("m")  # type: ignore[attr-defined]
    if not cold:
        assert app.service.admit.call_args.args[:2] == ("m", "1")  # type: ignore[attr-defined]
