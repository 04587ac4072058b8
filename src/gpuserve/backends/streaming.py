"""The contract of decoupled execution: a backend sends a request's responses to a sink.

A model with ``model_transaction_policy: {decoupled: true}`` answers one request with zero or
more responses and a final mark. The engine runs it with one request at a time per instance
by calling the backend's ``stream`` method::

    backend.stream(inputs, sink)        # on the instance's thread, the instance held

A backend that can serve several requests in one call (Triton's ``execute(requests)``, each
request with its own response sender) also has ``stream_batch``, and ``streams_batches`` True;
the engine uses it for a model with ``dynamic_batching`` and ``max_batch_size > 0``, for the
batches its dynamic batcher forms (see :mod:`gpuserve.engine.runners.streaming`)::

    backend.stream_batch([StreamCall(inputs, sink), ...])   # one sink per request

Each request's responses go to its own sink (its own id, bounded buffer and cancel); an
exception from ``stream_batch`` fails every request of the call that has not ended. gpuserve's
generator API (``Model.generate(inputs)``) has no batched form: a generator is one request's
stream, so such a model runs one request per call whatever its batching settings.

``inputs`` are the request's own arrays (batch dimension first when ``max_batch_size > 0``).
The backend calls :meth:`ResponseSink.send` for every response, from any thread, and once
with ``final=True`` (with or without a last response); the request is done then. ``send``
**blocks** while the sink's bounded buffer is full (the client reads slowly: back-pressure)
and returns False once the client has gone or cancelled, after which the backend should stop
producing (a generator is closed). ``stream`` may return before the final response is sent
(Triton's response sender used from the model's own threads); the instance is free again
when it returns.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from gpuserve.backends.row_context import NO_CONTEXT, RowContext, context_of


class ResponseSink(Protocol):
    """Where a decoupled backend sends one request's responses (thread-safe)."""

    @property
    def request_id(self) -> str:
        """The client's request id (``""`` when it sent none)."""
        ...

    @property
    def parameters(self) -> dict[str, Any]:
        """The request's parameters, as received."""
        ...

    def send(
        self,
        outputs: dict[str, np.ndarray] | None,
        *,
        final: bool = False,
        error: BaseException | None = None,
    ) -> bool:
        """Send one response (``outputs``, or ``error`` failing this response), and/or the
        final mark (``final=True``, ``outputs`` None for an empty final).

        Blocks while the buffer is full. Returns False when the request is cancelled or the
        final mark was already sent (nothing is delivered then).
        """
        ...

    def is_cancelled(self) -> bool:
        """True once the client went away or cancelled: stop producing."""
        ...


@dataclass(slots=True)
class StreamCall:
    """One request of a batch of decoupled requests (``backend.stream_batch``).

    Attributes:
        inputs: The request's own arrays (batch dimension first; never stacked with other
            requests').
        sink: Where its responses go.
        context: The request's context (its id, sequence id and flags, parameters,
            cancellation; :mod:`gpuserve.backends.row_context`).
    """

    inputs: dict[str, np.ndarray]
    sink: ResponseSink
    context: RowContext = NO_CONTEXT


def sink_context(sink: ResponseSink) -> RowContext:
    """The context of a request known only by its sink (``Backend.stream``): its id,
    parameters (its sequence id and flags among them) and cancellation."""
    return context_of(sink.request_id, sink.parameters, probe=sink.is_cancelled)


def run_generator(responses: Iterator[dict[str, Any]], sink: ResponseSink) -> None:
    """Drive a generator of responses (each a dict of output name -> array) into ``sink``:
    one response per item, then an empty final when it ends. When the client cancels, the
    generator is closed (``GeneratorExit`` is raised at its ``yield``, its ``finally`` runs).
    An exception from the generator is sent as the stream's last, final, error.

    Args:
        responses: The model's generator (``Model.generate(inputs)``).
        sink: Where the responses go.
    """
    close = getattr(responses, "close", None)
    try:
        for outputs in responses:
            if not isinstance(outputs, dict):
                raise TypeError(
                    f"generate must yield dicts of outputs, got {type(outputs).__name__}"
                )
            if not sink.send(outputs):
                return  # cancelled: the finally closes the generator
        sink.send(None, final=True)
    except Exception as err:
        sink.send(None, final=True, error=err)
    finally:
        if close is not None:
            close()
