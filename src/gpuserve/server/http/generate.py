"""Triton's generate extension: ``POST /v2/models/{m}[/versions/{v}]/generate`` and
``.../generate_stream``.

The request is one JSON object. Its keys that name an input of the model are that input's
data (a string, number or boolean, or a list of them; a single value is a ``[1]`` tensor, and
a batching model gets a batch dimension of 1 in front); ``parameters`` (an object) and every
other key go to the request's parameters, and ``id`` is the request id. The tensors are then
validated exactly as an ``/infer`` request's (same 400 messages).

A response is one JSON object: ``model_name``, ``model_version``, ``id`` when the request had
one, and each output by name (BYTES as text; one element as a scalar, more as a flat list).

* ``/generate`` answers one ``application/json`` response. A decoupled model must send
  exactly one response for it (400 naming the policy otherwise, as unary ``/infer``).
* ``/generate_stream`` answers ``text/event-stream; charset=utf-8``: one server-sent event
  ``data: {...}`` per response as the model produces it (a model that is not decoupled sends
  one), in chunked transfer coding (so a client can tell a stream cut short from one that
  ended), then the connection closes. A failure before the first
  event is an ordinary JSON error with its status; one after it is a last event
  ``data: {"error": "..."}`` (the status already went out as 200). When the client reads
  slowly the events wait in the socket's buffer up to
  :data:`~gpuserve.server.http.events.WRITE_BUFFER_BYTES`, then the stream stops pulling from the model (whose own bounded buffer then blocks it); when the
  client goes away the model's stream is cancelled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import orjson

from gpuserve.config import ModelConfig
from gpuserve.engine.request import InferenceResponse
from gpuserve.errors import GpuserveError, InvalidInputError
from gpuserve.protocol.binary import bytes_as_text
from gpuserve.protocol.http_codec import HttpInferBody
from gpuserve.protocol.limits import RequestLimits
from gpuserve.server.http.events import END, EVENT_HEAD, drained, write_event
from gpuserve.server.http.request import HttpRequest, traceparent
from gpuserve.server.security import Redactor
from gpuserve.service.inference import Admission, InferenceService
from gpuserve.service.streaming import ResponseStream

#: The two endpoints, as the last part of a model path.
ENDPOINTS = ("generate", "generate_stream")

_NAMED = {"id", "parameters"}


def infer_document(body: bytes | bytearray, config: ModelConfig) -> dict[str, Any]:
    """The V2 ``/infer`` JSON document of a generate request body (see the module docstring).

    Raises:
        InvalidInputError: not a JSON object, ``parameters`` not an object, ``id`` not a
            string.
    """
    try:
        document = orjson.loads(body or b"{}")
    except orjson.JSONDecodeError as err:
        raise InvalidInputError(f"the generate request is not valid JSON: {err}") from None
    if not isinstance(document, dict):
        raise InvalidInputError(
            f"the generate request must be a JSON object, got {type(document).__name__}"
        )
    parameters = document.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidInputError(f"'parameters' must be an object, got {type(parameters).__name__}")
    declared = {spec.name: spec for spec in config.inputs}
    inputs = []
    extra = dict(parameters)
    for key, value in document.items():
        if key in _NAMED:
            continue
        spec = declared.get(key)
        if spec is None:
            extra[key] = value
            continue
        shape = list(np.shape(value)) or ([] if spec.shape == [] else [1])
        if config.max_batch_size:
            shape = [1, *shape]
        data = value if isinstance(value, list) else [value]
        inputs.append({"name": key, "datatype": spec.datatype, "shape": shape, "data": data})
    if not inputs and config.inputs:
        raise InvalidInputError(
            f"the generate request has no key naming an input of model '{config.name}' "
            f"(inputs: {', '.join(repr(name) for name in declared)})"
        )
    out: dict[str, Any] = {"inputs": inputs}
    if extra:
        out["parameters"] = extra
    if "id" in document:
        out["id"] = document["id"]
    return out


def generate_response(response: InferenceResponse, config: ModelConfig) -> dict[str, Any]:
    """One response as the generate extension's JSON object."""
    document: dict[str, Any] = {
        "model_name": response.model_name,
        "model_version": response.model_version,
    }
    if response.id is not None:
        document["id"] = response.id
    datatypes = {spec.name: spec.datatype for spec in config.outputs}
    for name, array in response.outputs.items():
        if datatypes.get(name) == "BYTES" or array.dtype.kind in ("O", "S", "U"):
            values: list[Any] = bytes_as_text(array, name)
        else:
            values = np.asarray(array).ravel().tolist()
        document[name] = values[0] if len(values) == 1 else values
    return document


class GenerateApi:
    """The two generate endpoints over the inference service.

    Args:
        service: The inference service.
        limits: Server-wide tensor limits.
        redactor: Strips file paths from error messages.
        fail: Answers a request with the JSON error of an exception (the app's).
        send: Answers a request with a status and JSON body (the app's; it logs access).
        log: Writes the access line of a streamed answer: (request, status, bytes).
    """

    def __init__(
        self,
        service: InferenceService,
        limits: RequestLimits,
        redactor: Redactor,
        fail: Callable[[HttpRequest, BaseException], None],
        send: Callable[[HttpRequest, int, bytes], None],
        log: Callable[[HttpRequest, int, int], None],
    ) -> None:
        self.service = service
        self.limits = limits
        self.redactor = redactor
        self.fail = fail
        self.send = send
        self.log = log

    async def handle(
        self, request: HttpRequest, name: str, version: str | None, endpoint: str
    ) -> None:
        """Answer one generate request (``endpoint``: ``generate`` or ``generate_stream``)."""
        try:
            admission = await self.service.admit_loaded(
                name,
                version,
                _GenerateBody(request.body, self.limits),
                request.is_disconnected,
                traceparent(request) if self.service.tracing else None,
            )
            request.access = admission
            if endpoint == "generate":
                response = await self.service.run(admission)
                body = orjson.dumps(generate_response(response, admission.config))
                self.send(request, 200, body)
                return
            stream = self.service.stream(admission)
        except Exception as err:
            self.fail(request, err)
            return
        await self._stream(request, admission, stream)

    async def _stream(
        self, request: HttpRequest, admission: Admission, stream: ResponseStream
    ) -> None:
        transport = request.connection.transport
        if transport is None or transport.is_closing():
            stream.cancel()  # the connection is gone already
            return
        sent = 0
        started = False
        try:
            async for item in stream:
                if item.error is not None:
                    payload: dict[str, Any] = {"error": self.redactor.text(item.error.message)}
                elif item.response is not None:
                    payload = generate_response(item.response, admission.config)
                else:
                    continue  # an empty final: the end of the body says it
                if not started:
                    if item.error is not None and item.final:
                        self.fail(request, item.error)  # failed before any event: its status
                        return
                    if request.is_disconnected():
                        break
                    request.answered = True  # the event stream replaces respond()
                    transport.write(EVENT_HEAD)
                    started = True
                sent += write_event(request, orjson.dumps(payload))
                if not await drained(request):
                    break  # the client went away
        except GpuserveError as err:  # e.g. an output that cannot be encoded
            if not started:
                self.fail(request, err)
                return
            if not transport.is_closing():
                write_event(request, orjson.dumps({"error": self.redactor.text(err.message)}))
        finally:
            stream.cancel()  # a no-op after the final response
        if not started:
            if request.is_disconnected():
                return
            request.answered = True
            transport.write(EVENT_HEAD)
        if not transport.is_closing():
            transport.write(END)
            transport.close()  # flushes what is buffered, then closes
        self.log(request, 200, sent)


class _GenerateBody:
    """A generate request body as the inference service's ``WireRequest``."""

    __slots__ = ("_body", "_limits")

    def __init__(self, body: bytes | bytearray, limits: RequestLimits) -> None:
        self._body = body
        self._limits = limits

    def request_id(self) -> str | None:
        try:
            document = orjson.loads(self._body or b"{}")
        except orjson.JSONDecodeError as err:
            raise InvalidInputError(f"the generate request is not valid JSON: {err}") from None
        request_id = document.get("id") if isinstance(document, dict) else None
        if request_id is not None and not isinstance(request_id, str):
            raise InvalidInputError(f"request 'id' must be a string, got {request_id!r}")
        return request_id

    def decode(self, config: ModelConfig, model_name: str, model_version: str | None) -> Any:
        document = infer_document(self._body, config)
        wire = HttpInferBody(orjson.dumps(document), None, self._limits)
        return wire.decode(config, model_name, model_version)
