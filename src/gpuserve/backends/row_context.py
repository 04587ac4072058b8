"""What a model may know of the request that owns a batch row, besides its inputs.

One :class:`RowContext` per request, built by the engine when the request's batch runs and
handed to the backend with the batch (one entry per row: a request of three rows appears
three times), whatever path the request came by (HTTP, gRPC, a stream, a BLS call, an
ensemble step). It is what a Triton Python model reads from the requests ``execute``
receives: ``request_id()``, ``correlation_id()`` (the client's ``sequence_id``),
``flags()`` (``sequence_start`` / ``sequence_end``), ``parameters()`` and
``is_cancelled()``; and what a call made while the batch runs inherits
(:mod:`gpuserve.backends.call_scope`): how long the rows are still awaited, and the trace a
call nests under.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: Triton's request flags (``TRITONSERVER_REQUEST_FLAG_SEQUENCE_START`` / ``_END``).
SEQUENCE_START = 1
SEQUENCE_END = 2

#: The correlation id of a row whose request names no sequence (Triton's 0).
NO_ID = 0


def sequence_id_of(parameters: Mapping[str, Any]) -> int | str | None:
    """A request's ``sequence_id`` parameter when it is a usable id (a non-zero integer or a
    non-empty string), else None."""
    value = parameters.get("sequence_id")
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return None
    return value if value else None


def sequence_flags(parameters: Mapping[str, Any]) -> int:
    """The request flags its ``sequence_start`` / ``sequence_end`` parameters set."""
    flags = SEQUENCE_START if parameters.get("sequence_start") is True else 0
    if parameters.get("sequence_end") is True:
        flags |= SEQUENCE_END
    return flags


@dataclass(slots=True, eq=False)
class RowContext:
    """The request behind a batch row (module docstring). Compared by identity: one
    object stands for one request, repeated for each of its rows.

    Attributes:
        request_id: The client's request id (``""`` when it sent none).
        correlation_id: Its ``sequence_id``: an ``int`` or a ``str``; :data:`NO_ID` for none.
        flags: :data:`SEQUENCE_START` / :data:`SEQUENCE_END` bits.
        parameters: The request's parameters, as received (not to be modified).
        awaited_until: Monotonic time (s) after which its caller no longer waits for the
            answer, or None: until answered.
        probe: True once its client has gone away (None: never asked).
        trace: Its trace when tracing sampled it (calls made for it nest under it), else None.
    """

    request_id: str = ""
    correlation_id: int | str = NO_ID
    flags: int = 0
    parameters: Mapping[str, Any] = field(default_factory=dict)
    awaited_until: float | None = None
    probe: Callable[[], bool] | None = field(default=None, repr=False)
    trace: Any = field(default=None, repr=False)

    def is_cancelled(self) -> bool:
        """Whether the request's client has gone away."""
        probe = self.probe
        return probe is not None and probe()


#: The context of a row no request owns (a sequence batch's filler row), and the default.
NO_CONTEXT = RowContext()


def context_of(
    request_id: str,
    parameters: Mapping[str, Any],
    awaited_until: float | None = None,
    probe: Callable[[], bool] | None = None,
    trace: Any = None,
) -> RowContext:
    """The context of a request with these parameters: its sequence id and flags read from
    them (``sequence_id``, ``sequence_start``, ``sequence_end``)."""
    correlation_id: int | str = NO_ID
    flags = 0
    if parameters:
        correlation_id = sequence_id_of(parameters) or NO_ID
        flags = sequence_flags(parameters)
    return RowContext(request_id, correlation_id, flags, parameters, awaited_until, probe, trace)


__all__ = [
    "NO_CONTEXT",
    "NO_ID",
    "SEQUENCE_END",
    "SEQUENCE_START",
    "RowContext",
    "context_of",
    "sequence_flags",
    "sequence_id_of",
]
