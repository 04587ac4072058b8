"""The API token over gRPC: calls without ``authorization: Bearer <token>`` metadata end with
UNAUTHENTICATED before their handler runs.

Open without it, as over HTTP: ``ServerLive``, ``ServerReady`` and the standard
``grpc.health.v1.Health`` service (probes). ``RepositoryModelLoad``/``Unload`` check their own
token (the management token, else the API token) in the repository API, and
``RepositoryIndex`` takes either token (see :mod:`gpuserve.server.security`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from gpuserve.config import ServerConfig
from gpuserve.server.security import Tokens

_SERVICE = "/inference.GRPCInferenceService/"
_OPEN = frozenset({_SERVICE + "ServerLive", _SERVICE + "ServerReady"})
_OWN_CHECK = frozenset({_SERVICE + "RepositoryModelLoad", _SERVICE + "RepositoryModelUnload"})
_READ = frozenset({_SERVICE + "RepositoryIndex"})
_MESSAGE = "this call needs 'authorization: Bearer <API token>' metadata"


def _metadata(details: grpc.HandlerCallDetails) -> list[tuple[bytes, bytes]]:
    return [
        (key.encode(), value if isinstance(value, bytes) else value.encode())
        for key, value in details.invocation_metadata or ()
    ]


def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call with UNAUTHENTICATED."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _MESSAGE)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(
            unary,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(
            unary,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            unary,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    return grpc.unary_unary_rpc_method_handler(
        unary,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the API token (see the module docstring).

    Args:
        config: ``api_token`` (and ``management_token`` for ``RepositoryIndex``).
    """

    def __init__(self, config: ServerConfig) -> None:
        self.tokens = Tokens(config)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if (
            handler is None
            or method in _OPEN
            or method in _OWN_CHECK
            or not method.startswith(_SERVICE)
        ):
            return handler
        metadata = _metadata(handler_call_details)
        allowed = (
            self.tokens.allows_read(metadata)
            if method in _READ
            else self.tokens.allows_api(metadata)
        )
        return handler if allowed else _denied(handler)
