"""Which lane a request takes: interactive (the default) or bulk.

A client marks a request bulk with the V2 request parameter ``lane`` (HTTP and gRPC,
``"interactive"`` or ``"bulk"``), or, on every HTTP route (OpenAI, TEI, Cohere and V2 alike),
with the header ``x-gpuserve-lane: bulk``; every request a batch job sends is bulk. Front ends
set :data:`LANE` for the work of one call (a context variable: the tasks a call spawns
inherit it); :meth:`InferenceService.admit <gpuserve.service.inference.InferenceService.admit>`
reads it, the request's own parameter winning. The scheduler then serves bulk rows only with
the capacity interactive traffic leaves (:mod:`gpuserve.engine.batcher`).
"""

from __future__ import annotations

from contextvars import ContextVar

from gpuserve.engine.request import LANES, Lane
from gpuserve.errors import InvalidInputError

#: The HTTP header naming a call's lane.
HEADER = b"x-gpuserve-lane"
#: The request parameter naming a request's lane.
PARAMETER = "lane"

#: The lane of the call being served (set by front ends and the batch runner).
LANE: ContextVar[Lane] = ContextVar("gpuserve_lane", default="interactive")


def parse_lane(value: object, where: str) -> Lane:
    """``value`` as a lane.

    Raises:
        InvalidInputError: it is not ``interactive`` or ``bulk`` (the message names ``where``).
    """
    if value == "bulk":
        return "bulk"
    if value == "interactive":
        return "interactive"
    raise InvalidInputError(
        f"{where} must be one of {', '.join(repr(lane) for lane in LANES)}, got {value!r}"
    )


__all__ = ["HEADER", "LANE", "PARAMETER", "parse_lane"]
