"""The standard gRPC health service (``grpc.health.v1.Health``), answering server readiness.

The overall service ``""`` and ``inference.GRPCInferenceService`` are SERVING exactly when
``/v2/health/ready`` answers 200 (:meth:`InferenceService.is_ready`), NOT_SERVING otherwise, so a
Kubernetes ``grpc`` readiness probe and the HTTP probe agree. Other service names are
NOT_FOUND (``Check``) or SERVICE_UNKNOWN (``Watch``), as the health protocol specifies.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpuserve.service.inference import InferenceService

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthServicer(health_pb2_grpc.HealthServicer):
    """Health answered from the server's readiness at the moment of the call.

    Args:
        service: The inference service whose readiness is reported.
        services: Service names reported (besides ``""``, the server as a whole).
        watch_interval_s: How often a ``Watch`` stream re-reads readiness, seconds.
    """

    def __init__(
        self,
        service: InferenceService,
        services: tuple[str, ...],
        watch_interval_s: float = 0.5,
    ) -> None:
        self.service = service
        self.services = frozenset(("", *services))
        self.watch_interval_s = watch_interval_s

    def status(self, service: str) -> int:
        """The ``ServingStatus`` of ``service`` now."""
        if service not in self.services:
            return SERVICE_UNKNOWN
        return SERVING if self.service.is_ready() else NOT_SERVING

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: Any
    ) -> health_pb2.HealthCheckResponse:
        status = self.status(request.service)
        if status == SERVICE_UNKNOWN:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: Any
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        last = None
        while True:
            status = self.status(request.service)
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(self.watch_interval_s)
