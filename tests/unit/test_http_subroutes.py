"""Sub-API tables (routes.Router, mounted by routes.mount): first match wins, path
parameters, a method no row of the path takes is the sub-API's 405 and a path no row takes
its 404, the sub-API's auth and errors; and the mounted tables of the HTTP app (OpenAI's,
the Batch API's, the repository's, the extensions') answer as they did as if-chains."""

from __future__ import annotations

import asyncio
from typing import Any
from unittest.mock import MagicMock

import orjson
import pytest

from gpuserve.config import ServerConfig
from gpuserve.server.batches import batch_api
from gpuserve.server.batches.store import FileRecord
from gpuserve.server.http.app import HttpApp
from gpuserve.server.http.routes import (
    ANY,
    DELETE,
    GET,
    POST,
    Exact,
    HttpError,
    Mount,
    Route,
    Router,
    Template,
    methods_text,
    mount,
)
from tests.unit.test_http_routes import FakeRequest


@pytest.mark.parametrize(
    ("template", "path", "params"),
    [
        ("/v1/files/{id}", "/v1/files/f1", ("f1",)),
        ("/v1/files/{id}", "/v1/files/", None),  # a parameter is never empty
        ("/v1/files/{id}", "/v1/files/a/b", None),  # nor holds a "/"
        ("/v1/files/{id}/content", "/v1/files/f1/content", ("f1",)),
        ("/v1/files/{id}/content", "/v1/files/f1/contents", None),
        ("/m/{name}/{action}", "/m/a/load", ("a", "load")),
        ("/v1/models/{model:path}", "/v1/models/org/name", ("org/name",)),
        ("/v1/models/{model:path}", "/v1/models/", None),
        ("/x.y/{a}", "/xzy/1", None),  # the literal text is escaped
    ],
)
def test_a_template_gives_its_parameters_in_order(template, path, params):
    matcher = Template(template)
    assert matcher.quick(path) == path.startswith(template.split("{")[0])
    assert matcher.match is not None and matcher.match(path) == params
    assert repr(matcher) == f"Template({template!r})"


class Recorder:
    """A sub-API whose rows, miss and fail record what they were given."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def row(self, name: str) -> Any:
        def handler(request: Any, method: str, params: Any) -> Any:
            self.calls.append((name, params))
            return 200, name.encode()

        return handler

    def miss(self, request: Any, method: str, path: str, allowed: Any) -> Any:
        self.calls.append(("miss", (method, path, allowed)))
        if allowed is None:
            raise HttpError(404, f"none at {path}")
        raise HttpError(405, f"{method} {path}: use {methods_text(allowed)}")

    def fail(self, request: Any, err: BaseException) -> None:
        self.calls.append(("fail", str(err)))


def _router(api: Recorder, **options: Any) -> Router:
    def routes() -> list[Route]:
        return [
            Route(GET, Exact("/a/list"), api.row("list")),
            Route(GET, Template("/a/{id}"), api.row("first")),
            Route(GET, Template("/a/{id}"), api.row("second")),  # never: the first wins
            Route(DELETE, Template("/a/{id}"), api.row("delete")),
            Route(POST, Template("/a/{id}/run"), api.row("run")),
            Route(ANY, Exact("/a/any"), api.row("any")),
        ]

    return Router(routes, api.miss, **options)


@pytest.mark.parametrize(
    ("method", "path", "call"),
    [
        ("GET", "/a/list", ("list", None)),  # the exact row before the template
        ("GET", "/a/7", ("first", ("7",))),
        ("DELETE", "/a/7", ("delete", ("7",))),
        ("POST", "/a/7/run", ("run", ("7",))),
        ("PATCH", "/a/any", ("any", None)),
        ("PUT", "/a/7", ("miss", ("PUT", "/a/7", frozenset({"GET", "DELETE"})))),
        ("GET", "/a/7/run", ("miss", ("GET", "/a/7/run", frozenset({"POST"})))),
        ("GET", "/a/7/other", ("miss", ("GET", "/a/7/other", None))),
        ("GET", "/a/7/", ("miss", ("GET", "/a/7/", None))),  # strip off: "/" counts
    ],
)
def test_the_first_row_taking_path_and_method_answers_else_the_miss(method, path, call):
    api = Recorder()
    router = _router(api)
    request = FakeRequest(method, path)
    if call[0] == "miss":
        with pytest.raises(HttpError):  # no fail: the error goes to the table above
            router(request, method, None)  # type: ignore[arg-type]
    else:
        assert router(request, method, None) == (200, call[0].encode())  # type: ignore[arg-type]
    assert api.calls == [call]


def test_the_sub_apis_405_names_the_methods_of_every_row_of_the_path():
    api = Recorder()
    router = _router(api, fail=api.fail)
    assert router(FakeRequest("PUT", "/a/7"), "PUT", None) is None  # type: ignore[arg-type]
    assert api.calls[-1] == ("fail", "PUT /a/7: use GET or DELETE")
    router(FakeRequest("POST", "/a/nothing/here"), "POST", None)  # type: ignore[arg-type]
    assert api.calls[-1] == ("fail", "none at /a/nothing/here")


def test_strip_guard_and_fail():
    api = Recorder()
    refused: list[str] = []

    def guard(request: Any, path: str) -> None:
        refused.append(path)
        if request.header(b"authorization") is None:
            raise HttpError(401, "token")

    router = _router(api, fail=api.fail, guard=guard, strip=True)
    router(FakeRequest("GET", "/a/7//"), "GET", None)  # type: ignore[arg-type]
    assert refused == ["/a/7"] and api.calls == [("fail", "token")]  # nothing routed
    api.calls.clear()
    signed = FakeRequest("GET", "/a/7//", headers=[(b"authorization", b"Bearer x")])
    assert router(signed, "GET", None) == (200, b"first")  # type: ignore[arg-type]
    assert api.calls == [("first", ("7",))]


def test_reload_reads_the_rows_again():
    api = Recorder()
    rows = [Route(GET, Exact("/a"), api.row("a"))]
    router = Router(lambda: list(rows), api.miss, fail=api.fail)
    rows.append(Route(GET, Exact("/b"), api.row("b")))
    router(FakeRequest("GET", "/b"), "GET", None)  # type: ignore[arg-type]
    assert api.calls[-1] == ("fail", "none at /b")  # compiled before the change
    router.reload()
    router(FakeRequest("GET", "/b"), "GET", None)  # type: ignore[arg-type]
    assert api.calls[-1] == ("b", None)


def test_mount_is_one_row_for_every_method_below_a_prefix_and_nests():
    api = Recorder()
    inner = _router(api, fail=api.fail)
    outer = Router(lambda: [mount("/a", inner)], api.miss, fail=api.fail)
    row = mount("/a", inner, own_auth=True)
    assert row.methods is ANY and repr(row.path) == "Mount('/a')" and row.own_auth
    assert row.handler is inner
    assert outer(FakeRequest("DELETE", "/a/3"), "DELETE", None) == (200, b"delete")  # type: ignore[arg-type]
    outer(FakeRequest("GET", "/ab"), "GET", None)  # type: ignore[arg-type]
    assert api.calls[-1] == ("fail", "none at /ab")  # not below the prefix: the outer miss
    custom = mount(Mount("/b"), inner, when=False)
    assert repr(custom.path) == "Mount('/b')" and not custom.when


# -- the HTTP app's mounted tables ---------------------------------------------------------


def _app(tmp_path: Any, **config: Any) -> HttpApp:
    return HttpApp(MagicMock(), ServerConfig(model_repository=str(tmp_path), **config))


def _answer(app: HttpApp, method: str, path: str, headers: Any = ()) -> tuple[int, Any]:
    request = FakeRequest(method, path, headers=headers)
    app.handle(request)  # type: ignore[arg-type]
    [(status, body)] = request.answers
    return status, orjson.loads(body) if body else body


def test_openai_table_405_404_and_auth(tmp_path):
    app = _app(tmp_path)
    status, body = _answer(app, "GET", "/v1/embeddings/")
    assert status == 405
    assert body["error"]["message"] == "GET /v1/embeddings: use POST"
    assert body["error"]["code"] == "method_not_allowed"
    assert _answer(app, "PUT", "/v1/models/m")[1]["error"]["message"] == (
        "PUT /v1/models/m: use GET"
    )
    status, body = _answer(app, "HEAD", "/v1/audio/speech")
    assert status == 404 and body["error"]["message"] == "Invalid URL (HEAD /v1/audio/speech)"
    assert _answer(app, "GET", "/v1/files")[0] == 404  # no Batch API: not OpenAI's rows

    secured = _app(tmp_path, api_token="s3cret")
    status, body = _answer(secured, "GET", "/v1/nothing")  # 401 before the 404
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    _answer(secured, "POST", "/v1/chat/completions")
    secured.service.record_unrouted.assert_called_once_with("", None, "unauthorized")  # type: ignore[attr-defined]


def test_repository_table_answers_v2s_404_and_405_and_skips_the_api_token(tmp_path):
    app = _app(tmp_path, api_token="s3cret")
    assert _answer(app, "POST", "/v2/repository/models/m/nothing") == (
        404,
        {"error": "no endpoint POST /v2/repository/models/m/nothing"},
    )
    assert _answer(app, "GET", "/v2/repository/index") == (
        404,
        {"error": "no endpoint GET /v2/repository/index"},
    )
    assert _answer(app, "PUT", "/v2/repository/models/m/load")[0] == 405
    assert _answer(app, "POST", "/v2/repository/elsewhere")[0] == 401  # not the commands'
    commands = app.service.repository  # type: ignore[attr-defined]
    commands.status.return_value = {"name": "m"}
    assert _answer(app, "POST", "/v2/repository/models/m/status") == (200, {"name": "m"})
    commands.authorize_read.assert_called_once_with(None)  # its own token rule


def test_extensions_table_answers_404_whatever_the_method(tmp_path):
    app = _app(tmp_path)
    app.service.extensions.logs.get.return_value = {"log_info": True}  # type: ignore[attr-defined]
    assert _answer(app, "GET", "/v2/logging") == (200, {"log_info": True})
    assert _answer(app, "PUT", "/v2/logging") == (404, {"error": "no endpoint PUT /v2/logging"})
    assert _answer(app, "GET", "/v2/systemsharedmemory/unregister")[0] == 404
    assert _answer(app, "DELETE", "/v2/cudasharedmemory/unregister")[0] == 404  # POST, as Triton
    status, _ = _answer(app, "POST", "/v2/systemsharedmemory/region/r/unregister/")
    assert status == 200  # "/" after the path ignored
    registry = app.service.extensions.system_registry.return_value  # type: ignore[attr-defined]
    registry.unregister.assert_called_once_with("r")


def test_batch_table_unknown_id_is_404_before_the_405(tmp_path):
    app = _app(tmp_path, state_dir=str(tmp_path / "state"))

    async def main() -> None:
        jobs = batch_api(app.config, app, None)
        known = "file-" + "a" * 24
        jobs.store().add_file(FileRecord(known, "batch", "in.jsonl", 3, 1, 1, None))
        status, body = _answer(app, "PUT", f"/v1/files/{known}")
        assert status == 405 and body["error"]["message"] == (
            f"PUT /v1/files/{known}: use GET or DELETE"
        )
        status, body = _answer(app, "PUT", "/v1/files/file-" + "b" * 24)
        assert status == 404 and body["error"]["code"] == "file_not_found"
        status, body = _answer(app, "GET", f"/v1/files/{known}/other")
        assert (status, body["error"]["code"]) == (404, "file_not_found")
        status, body = _answer(app, "GET", "/v1/batches/nope/cancel")
        assert (status, body["error"]["code"]) == (404, "batch_not_found")
        assert _answer(app, "GET", f"/v1/files/{known}/")[1]["id"] == known
        await jobs.close(0.1)

    asyncio.run(main())
