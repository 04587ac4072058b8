"""Triton's shared-memory, trace-setting and log-setting RPCs of ``GRPCInferenceService``.

The same calls as the HTTP endpoints of :mod:`gpuserve.server.http.extensions_api`, on the
same state (the inference service's ``extensions``):
a region registered over HTTP serves gRPC requests and the reverse. The shared-memory calls
answer PERMISSION_DENIED unless the server allows client shared memory; bad values answer
INVALID_ARGUMENT naming the region, the key or the setting.

:class:`ExtensionRpcs` is mixed into
:class:`~gpuserve.server.grpc.service.InferenceServicer`; each method goes through that
module's ``unary`` wrapper (error mapping, access log), imported at the first call because
that module imports this one.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from gpuserve.errors import InvalidInputError
from gpuserve.protocol.protos import grpc_service_pb2 as pb

if TYPE_CHECKING:
    from gpuserve.service.extensions import Extensions

Request = TypeVar("Request")
Response = TypeVar("Response")
Method = Callable[[Any, Request, Any], Awaitable[Response]]


def rpc(method: Method[Request, Response]) -> Method[Request, Response]:
    """``service.unary(method)``, resolved at the first call (import cycle)."""
    wrapped: Method[Request, Response] | None = None

    @functools.wraps(method)
    async def handler(self: Any, request: Request, context: Any) -> Response:
        nonlocal wrapped
        if wrapped is None:
            from gpuserve.server.grpc.service import unary

            wrapped = unary(method)
        return await wrapped(self, request, context)

    return handler


def _log_value(value: pb.LogSettingsRequest.SettingValue) -> bool | int | str | None:
    choice = value.WhichOneof("parameter_choice")
    return None if choice is None else getattr(value, choice)


def _log_response(settings: dict[str, bool | int | str]) -> pb.LogSettingsResponse:
    response = pb.LogSettingsResponse()
    for key, value in settings.items():
        entry = response.settings[key]
        if isinstance(value, bool):
            entry.bool_param = value
        elif isinstance(value, int):
            entry.uint32_param = value
        else:
            entry.string_param = value
    return response


def _trace_response(settings: dict[str, list[str] | str]) -> pb.TraceSettingResponse:
    response = pb.TraceSettingResponse()
    for key, value in settings.items():
        response.settings[key].value.extend([value] if isinstance(value, str) else value)
    return response


class ExtensionRpcs:
    """The extension RPCs; needs ``self.service`` (the inference service)."""

    service: Any

    @property
    def _extensions(self) -> Extensions:
        extensions: Extensions = self.service.extensions
        return extensions

    @rpc
    async def SystemSharedMemoryStatus(
        self, request: pb.SystemSharedMemoryStatusRequest, context: Any
    ) -> pb.SystemSharedMemoryStatusResponse:
        registry = self._extensions.system_registry()
        response = pb.SystemSharedMemoryStatusResponse()
        for region in registry.status(request.name or None):
            entry = response.regions[region.name]
            entry.name = region.name
            entry.key = region.key
            entry.offset = region.offset
            entry.byte_size = region.byte_size
        return response

    @rpc
    async def SystemSharedMemoryRegister(
        self, request: pb.SystemSharedMemoryRegisterRequest, context: Any
    ) -> pb.SystemSharedMemoryRegisterResponse:
        registry = self._extensions.system_registry()
        registry.register(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @rpc
    async def SystemSharedMemoryUnregister(
        self, request: pb.SystemSharedMemoryUnregisterRequest, context: Any
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        self._extensions.system_registry().unregister(request.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    @rpc
    async def CudaSharedMemoryStatus(
        self, request: pb.CudaSharedMemoryStatusRequest, context: Any
    ) -> pb.CudaSharedMemoryStatusResponse:
        registry = self._extensions.cuda_registry()
        response = pb.CudaSharedMemoryStatusResponse()
        for region in registry.status(request.name or None):
            entry = response.regions[region.name]
            entry.name = region.name
            entry.device_id = region.device_id
            entry.byte_size = region.byte_size
        return response

    @rpc
    async def CudaSharedMemoryRegister(
        self, request: pb.CudaSharedMemoryRegisterRequest, context: Any
    ) -> pb.CudaSharedMemoryRegisterResponse:
        registry = self._extensions.cuda_registry()
        registry.register(request.name, request.raw_handle, request.device_id, request.byte_size)
        return pb.CudaSharedMemoryRegisterResponse()

    @rpc
    async def CudaSharedMemoryUnregister(
        self, request: pb.CudaSharedMemoryUnregisterRequest, context: Any
    ) -> pb.CudaSharedMemoryUnregisterResponse:
        self._extensions.cuda_registry().unregister(request.name or None)
        return pb.CudaSharedMemoryUnregisterResponse()

    @rpc
    async def TraceSetting(
        self, request: pb.TraceSettingRequest, context: Any
    ) -> pb.TraceSettingResponse:
        extensions = self._extensions
        model = request.model_name or None
        if model is not None:
            extensions.check_model(model)
        if not request.settings:
            return _trace_response(extensions.traces.get(model))
        changes: dict[str, list[str] | None] = {
            key: list(value.value) or None for key, value in request.settings.items()
        }
        return _trace_response(extensions.traces.update(changes, model))

    @rpc
    async def LogSettings(
        self, request: pb.LogSettingsRequest, context: Any
    ) -> pb.LogSettingsResponse:
        logs = self._extensions.logs
        if not request.settings:
            return _log_response(logs.get())
        changes: dict[str, bool | int | str] = {}
        for key, value in request.settings.items():
            given = _log_value(value)
            if given is None:
                raise InvalidInputError(f"log setting {key!r} has no value")
            changes[key] = given
        return _log_response(logs.update(changes))
