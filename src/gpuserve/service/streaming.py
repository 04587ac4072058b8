"""Streams of responses, as the service hands them to front ends.

A front end reads every request as a :class:`ResponseStream` when it wants each response as
it comes (gRPC ``ModelStreamInfer``, HTTP ``/generate_stream``): an async iterator of
:class:`StreamedResponse`, the last one marked ``final``, from the version's runner
(:meth:`gpuserve.engine.runners.base.VersionRunner.stream`). A decoupled model's stream has
as many responses as the model sends; any other model's has its one response. Front ends
call :meth:`ResponseStream.cancel` when their client goes away; the model then stops.
"""

from __future__ import annotations

from gpuserve.engine.runners.base import ResponseStream, StreamedResponse

__all__ = ["ResponseStream", "StreamedResponse"]
