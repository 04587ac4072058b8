"""The model repository extension over HTTP, and gpuserve's lifecycle endpoints beside it.

    POST /v2/repository/index                         every model version and its state
    POST /v2/repository/models/{m}/load               load or reload (explicit mode)
    POST /v2/repository/models/{m}/unload             drain and unload (explicit mode)
    POST /v2/repository/models/{m}/rollback           serve the previous version again
    POST /v2/repository/models/{m}/canary             {"version": N, "weight": 0.1}
    POST /v2/repository/models/{m}/canary/promote     the canary becomes the default
    POST /v2/repository/models/{m}/canary/abort       the canary ends
    POST /v2/repository/models/{m}/status             the model's routing and versions
    POST /v2/repository/models/{m}/trace              {"batches": N}: profile N batches

An adapter: it parses the path and the JSON body and calls the service's typed
:class:`~gpuserve.service.commands.RepositoryCommands`, which own the checks (management
disabled -> 403, missing token -> 401 with ``WWW-Authenticate: Bearer``; names; configuration
paths). A load may carry a configuration, as Triton's does:
``{"parameters": {"config": "<the model configuration as a JSON string>"}}``, and the model's
files, base64-encoded, as ``"file:<relative path>": "<base64>"`` parameters (``config`` then
required; see :mod:`gpuserve.service.model_files`).

Success bodies are the model's status view. The endpoints are the rows of
:meth:`RepositoryApi.routes`, a table the HTTP app mounts at ``/v2/repository``; a path no row
takes is V2's 404 (405 for a method other than GET or POST). Its calls check the repository's
tokens, not the API token (:func:`own_tokens`).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from gpuserve.errors import InvalidInputError
from gpuserve.server.http.request import HttpRequest
from gpuserve.server.http.routes import (
    POST,
    Answer,
    Exact,
    Handler,
    HttpError,
    Params,
    Route,
    Router,
    Template,
    no_route,
)
from gpuserve.server.security import Redactor, bearer_token, check_model_name
from gpuserve.service.commands import CanaryRequest
from gpuserve.service.inference import InferenceService
from gpuserve.service.model_files import FILE_PREFIX

INDEX = "/v2/repository/index"
MODELS = "/v2/repository/models/"
MODEL = MODELS + "{name}/"  # a row's path: MODEL + its action

#: Answers a request later: ``later(request, result)`` awaits ``result`` (the JSON body of
#: a 200 answer, redacted) and answers with it, or with the error it raises.
Later = Callable[[HttpRequest, Awaitable[bytes]], None]


def own_tokens(path: str) -> bool:
    """Whether ``path`` is one whose calls check the repository's tokens themselves (the
    API token is not asked first): the index and everything below ``/v2/repository/models/``."""
    return path == INDEX or path.startswith(MODELS)


class RepositoryApi:
    """The table of ``/v2/repository``: :attr:`router`, the rows of :meth:`routes`.

    Args:
        service: The inference service whose repository commands the calls run.
        redactor: Takes file paths out of the answers.
        later: Answers a call whose command is awaited (see :data:`Later`).
    """

    def __init__(self, service: InferenceService, redactor: Redactor, later: Later) -> None:
        self.commands = service.repository
        self.redactor = redactor
        self.later = later
        #: The table the HTTP app mounts at ``/v2/repository`` (V2's errors).
        self.router = Router(self.routes, _miss)

    def routes(self) -> list[Route]:
        """The endpoints, one row each."""
        commands = self.commands
        return [
            Route(POST, Exact(INDEX), self._index),
            Route(POST, Template(MODEL + "load"), self._load),
            Route(POST, Template(MODEL + "unload"), self._change(lambda m: commands.unload(m))),
            Route(POST, Template(MODEL + "rollback"), self._change(lambda m: commands.rollback(m))),
            Route(POST, Template(MODEL + "canary"), self._canary),
            Route(
                POST,
                Template(MODEL + "canary/promote"),
                self._change(lambda m: commands.promote_canary(m)),
            ),
            Route(
                POST,
                Template(MODEL + "canary/abort"),
                self._change(lambda m: commands.abort_canary(m)),
            ),
            Route(POST, Template(MODEL + "status"), self._status),
            Route(POST, Template(MODEL + "trace"), self._trace),
        ]

    # -- the rows' handlers: (request, method, (model name,)) ------------------------------

    def _index(self, request: HttpRequest, _method: str, _: Params) -> Answer:
        self.commands.authorize_read(bearer_token(request.headers))
        ready_only = bool(_json_body(request.body).get("ready", False))
        return self._ok(self.commands.index(ready_only))

    def _status(self, request: HttpRequest, _method: str, params: Params) -> Answer:
        name = self._model(request, params, read=True)
        return self._ok(self.commands.status(name))

    def _load(self, request: HttpRequest, _method: str, params: Params) -> Answer:
        name = self._model(request, params)
        body = _json_body(request.body)
        self._answer(request, self.commands.load(name, _config_override(body), _files(body)))
        return None

    def _canary(self, request: HttpRequest, _method: str, params: Params) -> Answer:
        name = self._model(request, params)
        canary = _canary_body(_json_body(request.body))
        self._answer(request, self.commands.set_canary(name, canary))
        return None

    def _trace(self, request: HttpRequest, _method: str, params: Params) -> Answer:
        name = self._model(request, params)
        return self._ok(self.commands.trace(name, _batches(_json_body(request.body))))

    def _change(self, command: Callable[[str], Awaitable[object]]) -> Handler:
        """The handler of a changing command that takes the model name alone."""

        def handler(request: HttpRequest, _method: str, params: Params) -> Answer:
            self._answer(request, command(self._model(request, params)))
            return None

        return handler

    def _model(self, request: HttpRequest, params: Params, read: bool = False) -> str:
        """The call's model name, once its token is allowed (read or change) and the name
        checked."""
        token = bearer_token(request.headers)
        if read:
            self.commands.authorize_read(token)
        else:
            self.commands.authorize_change(token)
        (name,) = params
        check_model_name(name)
        return str(name)

    def _ok(self, view: object) -> Answer:
        return 200, self.redactor.json(orjson.dumps(view))

    def _answer(self, request: HttpRequest, view: Awaitable[object]) -> None:
        async def body() -> bytes:
            return self.redactor.json(orjson.dumps(await view))

        self.later(request, body())


def _miss(request: HttpRequest, method: str, path: str, _: frozenset[str] | None) -> Answer:
    """V2's 404/405 (:func:`~gpuserve.server.http.routes.no_route`); a POST to a path of the
    commands names it as sent, trailing "/" included."""
    if method == "POST" and own_tokens(path):
        raise HttpError(404, f"no endpoint POST {path}")
    raise no_route(method, path)


def _json_body(body: bytes | bytearray) -> dict[str, Any]:
    if not body.strip():
        return {}
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as err:
        raise InvalidInputError(f"request body is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise InvalidInputError(f"request body must be a JSON object, got {type(value).__name__}")
    return value


def _config_override(request: dict[str, Any]) -> object:
    """The ``parameters.config`` of a load request (a JSON string, or an object; the load
    command parses it), or None."""
    parameters = request.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidInputError("field 'parameters' must be an object")
    return parameters.get("config")


def _files(request: dict[str, Any]) -> dict[str, bytes]:
    """The ``file:<path>`` parameters of a load request, base64-decoded, by relative path.

    Raises:
        InvalidInputError: a value that is not a base64 string (names the parameter).
    """
    parameters = request.get("parameters") or {}
    files = {}
    for key, value in parameters.items():
        if not key.startswith(FILE_PREFIX):
            continue
        if not isinstance(value, str):
            raise InvalidInputError(
                f"parameter {key!r}: expected the file's content as a base64 string, got "
                f"{type(value).__name__}"
            )
        try:
            files[key[len(FILE_PREFIX) :]] = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as err:
            raise InvalidInputError(
                f"parameter {key!r}: not valid base64 ({err}); expected the file's content "
                "as a base64 string"
            ) from None
    return files


def _canary_body(request: dict[str, Any]) -> CanaryRequest:
    version, weight = request.get("version"), request.get("weight")
    if isinstance(version, str) and version.isascii() and version.isdigit():
        version = int(version)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise InvalidInputError(f"field 'version': expected a positive integer, got {version!r}")
    if not isinstance(weight, (int, float)) or isinstance(weight, bool):
        raise InvalidInputError(f"field 'weight': expected a number 0..1, got {weight!r}")
    return CanaryRequest(version, float(weight))


def _batches(request: dict[str, Any]) -> int:
    batches = request.get("batches", 1)
    if not isinstance(batches, int) or isinstance(batches, bool) or not 1 <= batches <= 1000:
        raise InvalidInputError(f"field 'batches': expected an integer 1..1000, got {batches!r}")
    return batches
