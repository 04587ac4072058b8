"""The KServe V2 gRPC front end (``inference.GRPCInferenceService`` and ``grpc.health.v1``).

:mod:`~gpuserve.server.grpc.server` runs the grpc.aio listener; :mod:`.service` implements the
inference service, :mod:`.health` the health service, :mod:`.messages` builds the metadata,
configuration, statistics and index messages, and :mod:`.access` writes the access log. The
wire codec of inference requests lives in :mod:`gpuserve.protocol.grpc_codec`, the ``.proto``
files and generated modules in :mod:`gpuserve.protocol.protos`.
"""
