"""The pieces of the REST front end's routing tables (the top table is
:meth:`gpuserve.server.http.app.HttpApp.routes`): a :class:`Route` row is (methods, path
matcher, handler), and the rows are tried in order, the first match winning (Starlette's
``Router`` habit, without the framework).

A sub-API (OpenAI's ``/v1``, its Files and Batch API, the model repository, Triton's
extensions) has a table of its own, a :class:`Router`: its rows, its answer to a path none
of them takes (its 404, or its 405 when a row takes the path with another method), its
errors' shape and its auth rule. The table above mounts it with one row,
:func:`mount` (Starlette's ``Mount(path, routes=[...])``). Rows of a sub-table name whole
paths (``Exact("/v1/embeddings")``), not the part below the mount.

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
    Template("/v1/files/{id}")   path parameters: ``{name}`` one segment, not empty; a last
                                 ``{name:path}`` the rest, "/"s included
    Suffix("/infer")             any path ending so (the handler parses the rest)
    Where(predicate)             what ``predicate(path)`` accepts
    ModelAction("generate", ...) ``.../{model}[/versions/{version}]/<action>``, the raw path
    ModelView("ready")           ``/v2/models/{model}[/versions/{version}][/<action>]``,
                                 "/"s after it ignored (the GET views)
"""

from __future__ import annotations

import re
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

#: Methods of a row: GET (HEAD is routed as GET, its body dropped), POST, DELETE, or any
#: (None).
GET: frozenset[str] | None = frozenset({"GET"})
POST: frozenset[str] | None = frozenset({"POST"})
DELETE: frozenset[str] | None = frozenset({"DELETE"})
ANY: frozenset[str] | None = None
#: The order :func:`methods_text` names methods in.
METHOD_ORDER = ("GET", "POST", "PUT", "PATCH", "DELETE")


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


class Template(PathMatcher):
    """A path with parameters (Starlette's path syntax): ``{name}`` is one segment (no "/",
    not empty), a last ``{name:path}`` the rest of the path ("/"s included, not empty). The
    parameters are the values, in order, as a tuple of strings."""

    def __init__(self, template: str) -> None:
        self.template = template
        pieces = re.split(r"\{\w+(:path)?\}", template)
        # re.split interleaves the text between parameters with each one's ":path" group
        pattern = re.escape(pieces[0])
        for kind, text in zip(pieces[1::2], pieces[2::2], strict=True):
            pattern += ("(.+)" if kind else "([^/]+)") + re.escape(text)
        self._fullmatch = re.compile(pattern).fullmatch
        self.quick = methodcaller("startswith", pieces[0])
        self.match = self._params

    def _params(self, path: str) -> Params:
        found = self._fullmatch(path)
        return None if found is None else found.groups()

    def __repr__(self) -> str:
        return f"Template({self.template!r})"


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


#: A sub-table's answer to a path none of its rows takes: ``miss(request, method, path,
#: allowed)``; ``allowed`` is None (no row takes the path: its 404) or the methods of the
#: rows that take it with another method (its 405). It answers, or raises the error its
#: sub-API's ``fail`` (or the table above) answers.
Miss = Callable[[HttpRequest, str, str, frozenset[str] | None], Answer]
#: A sub-API's error answer: ``fail(request, error)`` answers the request.
Fail = Callable[[HttpRequest, BaseException], None]
#: A sub-API's auth rule, run before its rows: ``guard(request, path)`` raises to refuse.
Guard = Callable[[HttpRequest, str], None]


class Router:
    """A sub-API's routing table: its rows (tried in order, first match wins), its own "no
    route" answer, error shape and auth rule. A :data:`Handler` itself, so the table above
    mounts it as a row's handler (see :func:`mount`).

    Unlike the top table's, a sub-table's row is chosen by its path first: a path some row
    takes with another method is the sub-API's 405 (``miss`` gets those rows' methods). A
    sub-table is off the inference hot path, so it may spend the extra tests.

    Args:
        routes: Builds the rows (the sub-API's ``routes`` method); read again by
            :meth:`reload`, for a sub-API whose rows change once (a late mount).
        miss: The answer when no row takes the path (see :data:`Miss`).
        fail: Answers an error a row, ``guard`` or ``miss`` raised (the sub-API's error
            shape); None: the error goes up to the table above.
        guard: Run first, with the path the rows see (see :data:`Guard`); None: none.
        strip: Match the path without its trailing "/"s (``/`` stays).
    """

    def __init__(
        self,
        routes: Callable[[], list[Route]],
        miss: Miss,
        *,
        fail: Fail | None = None,
        guard: Guard | None = None,
        strip: bool = False,
    ) -> None:
        self.routes = routes
        self.miss = miss
        self.fail = fail
        self.guard = guard
        self.strip = strip
        self._table = compile_routes(routes())

    def reload(self) -> None:
        """Build the rows again (after a change of what ``routes`` returns)."""
        self._table = compile_routes(self.routes())

    def __call__(self, request: HttpRequest, method: str, _params: Params) -> Answer:
        """Dispatch ``request`` (``method``: HEAD as GET) to the first row that takes its
        path and method; the row's answer, or ``miss``'s."""
        path = request.path
        if self.strip:
            path = path.rstrip("/") or "/"
        try:
            if self.guard is not None:
                self.guard(request, path)
            allowed: frozenset[str] | None = None
            for methods, quick, match, handler, _own_auth in self._table:
                if not quick(path):
                    continue
                params = None
                if match is not None:
                    params = match(path)
                    if params is None:
                        continue
                if methods is not None and method not in methods:
                    allowed = methods if allowed is None else allowed | methods
                    continue
                return handler(request, method, params)
            return self.miss(request, method, path, allowed)
        except Exception as err:
            if self.fail is None:
                raise
            self.fail(request, err)
            return None

    def __repr__(self) -> str:
        return f"Router({getattr(self.routes, '__qualname__', self.routes)})"


def mount(
    path: str | PathMatcher, router: Router, *, own_auth: bool = False, when: bool = True
) -> Route:
    """The row that hands every method of the paths ``path`` takes (a string: the prefix
    and everything below it, :class:`Mount`) to ``router``.

    Args:
        path: The prefix, or a path matcher.
        router: The sub-table.
        own_auth: The sub-API checks the bearer token itself (its ``guard`` or its rows).
        when: Whether the row is in the table at all.
    """
    matcher = Mount(path) if isinstance(path, str) else path
    return Route(ANY, matcher, router, own_auth, when)


def methods_text(methods: frozenset[str]) -> str:
    """``methods`` for a 405's message: ``"GET or POST"``."""
    return " or ".join(method for method in METHOD_ORDER if method in methods)


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
