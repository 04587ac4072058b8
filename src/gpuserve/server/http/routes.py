"""The pieces of the REST front end's routing table (the table itself is
:meth:`gpuserve.server.http.app.HttpApp.routes`): a :class:`Route` row is (methods, path
matcher, handler), and the rows are tried in order, the first match winning (Starlette's
``Router`` habit, without the framework).

A path matcher has two parts, so that a request is turned away from a row cheaply:

* ``quick(path)``: a necessary condition, a C-level string test (``str.startswith``,
  ``str.endswith``, ``str.__eq__``) and no Python frame;
* ``match(path)``: None when ``quick`` decides alone, else the full test: the row's
  parameters (e.g. ``(model, version, action)``), or None when the path is not the row's
  after all (the next rows are tried). It may raise the 404 of a malformed model path.

The matchers:

    Exact("/v2")                 the path itself (``trailing_slash=True``: also with "/"s
                                 after it)
    Mount("/v1")                 the path and everything below it (a sub-API)
    Suffix("/infer")             any path ending so (the handler parses the rest)
    Where(predicate)             what a sub-API's own ``handles(path)`` accepts
    ModelAction("generate", ...) ``.../{model}[/versions/{version}]/<action>``, the raw path
    ModelView("ready")           ``/v2/models/{model}[/versions/{version}][/<action>]``,
                                 "/"s after it ignored (the GET views)
"""

from __future__ import annotations

from collections.abc import Callable
from operator import methodcaller
from typing import Any, NamedTuple

from gpuserve.server.http.request import HttpRequest

#: A row's parameters (whatever its matcher returns), or None for a matcher without any.
Params = Any
#: What a handler answers at once: (status, JSON body), or None when it answers the request
#: itself (later, from a task or a callback).
Answer = tuple[int, bytes] | None
Handler = Callable[[HttpRequest, str, Params], Answer]

#: Methods of a row: GET (HEAD is routed as GET, its body dropped), POST, or any (None).
GET: frozenset[str] | None = frozenset({"GET"})
POST: frozenset[str] | None = frozenset({"POST"})
ANY: frozenset[str] | None = None


class HttpError(Exception):
    """A protocol-level failure that is not a GpuserveError (bad route, body too large)."""

    def __init__(
        self, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or []


class PathMatcher:
    """``quick`` and ``match`` (see the module docstring); ``sample`` a path it matches."""

    quick: Callable[[str], bool]
    match: Callable[[str], Params] | None = None


class Exact(PathMatcher):
    def __init__(self, path: str, trailing_slash: bool = False) -> None:
        self.path = path
        if trailing_slash:
            self.quick = methodcaller("startswith", path)
            self.match = self._stripped
        else:
            self.quick = path.__eq__

    def _stripped(self, path: str) -> Params:
        return () if (path.rstrip("/") or "/") == self.path else None

    def __repr__(self) -> str:
        return f"Exact({self.path!r})"


class Mount(PathMatcher):
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.quick = methodcaller("startswith", prefix)
        self.match = self._below

    def _below(self, path: str) -> Params:
        n = len(self.prefix)
        return () if len(path) == n or path[n] == "/" else None

    def __repr__(self) -> str:
        return f"Mount({self.prefix!r})"


class Suffix(PathMatcher):
    def __init__(self, suffix: str) -> None:
        self.suffix = suffix
        self.quick = methodcaller("endswith", suffix)

    def __repr__(self) -> str:
        return f"Suffix({self.suffix!r})"


class Where(PathMatcher):
    def __init__(self, predicate: Callable[[str], bool]) -> None:
        self.quick = predicate

    def __repr__(self) -> str:
        return f"Where({getattr(self.quick, '__qualname__', self.quick)})"


class ModelAction(PathMatcher):
    """``.../{model}[/versions/{version}]/<action>`` on the raw path; the parameters are
    ``(model, version or None, action)``. As the inference row's parse, the model is the
    fourth segment whatever the third."""

    def __init__(self, *actions: str) -> None:
        self.actions = actions
        self.quick = methodcaller("endswith", tuple("/" + action for action in actions))
        self.match = self._model

    def _model(self, path: str) -> Params:
        name, version, rest = split_model_path(path)  # 404 when malformed
        return (name, version, rest) if rest in self.actions else None

    def __repr__(self) -> str:
        return f"ModelAction{self.actions!r}"


class ModelView(PathMatcher):
    """``/v2/models/{model}[/versions/{version}][/<action>]``, "/"s after it ignored; the
    parameters are ``(model, version or None, action)``."""

    def __init__(self, action: str = "") -> None:
        self.action = action
        self.quick = methodcaller("startswith", "/v2/models/")
        self.match = self._model

    def _model(self, path: str) -> Params:
        path = path.rstrip("/")
        if not path.startswith("/v2/models/"):
            return None
        name, version, rest = split_model_path(path)  # 404 when malformed
        return (name, version, rest) if rest == self.action else None

    def __repr__(self) -> str:
        return f"ModelView({self.action!r})"


class Route(NamedTuple):
    """One row of the table.

    Attributes:
        methods: The methods it answers (:data:`GET`, :data:`POST` or :data:`ANY`).
        path: Its path matcher.
        handler: ``handler(request, method, params)`` -> :data:`Answer`; ``method`` is the
            request's with HEAD as GET, ``params`` what the matcher returned.
        own_auth: Whether the handler checks the bearer token itself (else the API token is
            checked before the row's full match and handler).
        when: Whether the row is in the table at all (e.g. ``/metrics`` with metrics on).
    """

    methods: frozenset[str] | None
    path: PathMatcher
    handler: Handler
    own_auth: bool = False
    when: bool = True


#: A row as the dispatcher reads it: (methods, quick, match, handler, own_auth).
CompiledRoute = tuple[
    frozenset[str] | None, Callable[[str], bool], Callable[[str], Params] | None, Handler, bool
]


def compile_routes(routes: list[Route]) -> tuple[CompiledRoute, ...]:
    """The rows in effect, flattened into tuples (the dispatcher's loop unpacks them)."""
    return tuple(
        (route.methods, route.path.quick, route.path.match, route.handler, route.own_auth)
        for route in routes
        if route.when
    )


def no_route(method: str, path: str) -> HttpError:
    """The answer to a request no row takes: under ``/v2`` 404 for GET/POST, 405 for any
    other method; elsewhere 404."""
    path = path.rstrip("/") or "/"
    status = 404 if method in ("GET", "POST") or not path.startswith("/v2") else 405
    return HttpError(status, f"no endpoint {method} {path}")


def split_model_path(path: str) -> tuple[str, str | None, str]:
    """``/v2/models/m[/versions/v][/rest]`` -> (m, v or None, rest).

    Raises:
        HttpError: 404, no model name (fewer than four segments, or an empty fourth).
    """
    parts = path.split("/")
    # ['', 'v2', 'models', name, ...]
    if len(parts) < 4 or not parts[3]:
        raise HttpError(404, f"no endpoint {path}")
    name = parts[3]
    tail = parts[4:]
    version = None
    if len(tail) >= 2 and tail[0] == "versions":
        version = tail[1]
        tail = tail[2:]
    return name, version, "/".join(tail)
