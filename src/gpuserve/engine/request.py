"""Messages between the protocol layer and the engine.

The protocol layer builds an :class:`InferenceRequest` from wire bytes after all validation;
the engine answers with an :class:`InferenceResponse`. Neither knows about HTTP or gRPC.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

#: The two lanes of a model's queue (see :attr:`InferenceRequest.lane`).
Lane = Literal["interactive", "bulk"]
LANES: tuple[Lane, ...] = ("interactive", "bulk")

if TYPE_CHECKING:
    from gpuserve.engine.generate.messages import GenerationInput


@dataclass(slots=True, frozen=True)
class RequestCost:
    """What one request costs to run, as its model's admission step measured it.

    Filled at admission (before batching) by models that declare an admission step (the
    built-in text models: tokens per text after truncation); the dynamic batcher groups
    requests of similar length and bounds a batch's tokens with it.

    Attributes:
        lengths: Per row, its length in the model's unit (tokens for text models), after any
            truncation the model applies; one entry per batch row.
    """

    lengths: tuple[int, ...]

    @property
    def tokens(self) -> int:
        """Sum of the rows' lengths (the work when execution is unpadded)."""
        return sum(self.lengths)

    @property
    def longest(self) -> int:
        """The longest row (what a padded batch pads every row to), 0 for no rows."""
        return max(self.lengths, default=0)


class RequestTrace(Protocol):
    """The trace of one sampled request (set by the service only when tracing samples it;
    None otherwise, so an untraced request costs nothing here).

    The engine calls :meth:`child` for a request it sends on behalf of this one (an
    ensemble step, a BLS call) and gives the child's outcome to :meth:`end`.
    """

    def child(self, model: str, version: str | None, kind: str) -> RequestTrace:
        """A trace for a nested request to ``model`` (``kind``: ``ensemble_step``,
        ``bls``), started now, under this one."""
        ...

    def end(self, outcome: InferenceResponse | BaseException | None) -> None:
        """The request is answered (a response) or failed (an error; None: cancelled)."""
        ...


def end_trace_with(trace: RequestTrace, future: Any) -> None:
    """End ``trace`` when the asyncio or concurrent ``future`` of its request resolves."""

    def done(finished: Any) -> None:
        if finished.cancelled():
            trace.end(None)
        else:
            error = finished.exception()
            trace.end(error if error is not None else finished.result())

    future.add_done_callback(done)


@dataclass(slots=True, eq=False)
class InferenceRequest:
    """One validated inference request.

    Attributes:
        model_name: Target model.
        model_version: Requested version as a decimal string, or None for the default
            (highest serving) version.
        inputs: Input name -> array. When the model batches (``max_batch_size > 0``) every
            array has the batch dimension first and all agree on it; BYTES inputs are numpy
            ``object`` arrays of ``bytes``.
        requested_outputs: Output names to return, or None for every declared output.
        id: Client's request id, echoed in the response.
        parameters: Request-level parameters, as received.
        priority: Priority level (1 = highest); 0 means the model's default level.
        timeout_us: Queue timeout, microseconds; None means the model's default.
        is_cancelled: Optional probe, True once the client has gone away; a queued request
            whose probe says so is dropped instead of run.
        cost: Lengths per row from the model's admission step, or None when the model
            declares none (every row then counts as one unit).
        trace: The request's trace when tracing sampled it, else None.
        lane: ``interactive`` (default) or ``bulk``: a bulk request takes only the capacity
            interactive traffic leaves (see :mod:`gpuserve.engine.batcher`).
        generation: What a typed generation API (OpenAI's completions and chat) asked a
            generative model for, in place of ``inputs``; None for tensor requests.
        awaited_until: Monotonic time (s) after which its caller no longer waits for the
            answer (a model's call with a timeout), or None: until answered. Calls the
            request's model makes while it runs pass it on, and are refused once it has
            passed (:mod:`gpuserve.backends.call_scope`).
        keep_tensors: Output names it takes as ``torch.Tensor`` on the producing device when
            the backend gives them (an ensemble step whose consumer takes device tensors);
            empty for a client's request: every output comes back as a numpy array.
    """

    model_name: str
    model_version: str | None
    inputs: dict[str, np.ndarray]
    requested_outputs: list[str] | None = None
    id: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    timeout_us: int | None = None
    is_cancelled: Callable[[], bool] | None = None
    cost: RequestCost | None = None
    trace: RequestTrace | None = None
    awaited_until: float | None = None
    generation: GenerationInput | None = None
    lane: Lane = "interactive"
    keep_tensors: frozenset[str] = frozenset()


@dataclass(slots=True)
class RequestTiming:
    """Where a request's time went, seconds (monotonic clock).

    Attributes:
        queue_s: From admission to the start of its batch.
        compute_s: The batch's preprocess + forward + postprocess.
        total_s: From admission to the response being ready.
        batch_size: Rows of the batch the request ran in (0: not batched by the engine).
        tokens: A generated sequence's (prompt tokens, generated tokens); None for other
            requests. Then ``queue_s`` runs from admission to the first token (waiting and
            prefill) and ``compute_s`` is the decode, first token to last.
    """

    queue_s: float = 0.0
    compute_s: float = 0.0
    total_s: float = 0.0
    batch_size: int = 0
    tokens: tuple[int, int] | None = None


@dataclass(slots=True)
class InferenceResponse:
    """The result of one request.

    Attributes:
        model_name / model_version: The model version that ran it.
        id: The request's id, if it had one.
        outputs: Output name -> array, rows of this request only (batch dimension first when
            the model batches). Only the requested outputs are present.
        timing: Queue and compute time.
        rows: The request's batch-dimension size (1 for a model without batching), as the
            engine counted it at admission; 0 for a response built outside the engine that
            did not say.
    """

    model_name: str
    model_version: str
    id: str | None
    outputs: dict[str, np.ndarray]
    timing: RequestTiming = field(default_factory=RequestTiming)
    rows: int = 0
