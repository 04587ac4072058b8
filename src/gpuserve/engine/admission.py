"""Models' admission steps: per request, before batching, on a bounded pool of threads.

A model may declare an admission step (``Capabilities.admission``, from
:meth:`gpuserve.backends.base.Backend.admission`; a ``python`` model's ``Model.admit``): the
built-in text models count each row's tokens and cut long texts before tokenisation. Every
runner runs it (:meth:`gpuserve.engine.runners.base.VersionRunner.submit`) between a request's
admission and its queueing, whoever sent it (a client, an ensemble step, a BLS call), only for
models that declare one (the others are queued at once, with no await and no thread hop):

* :class:`AdmissionPool` runs steps on ``admission_workers`` threads, off the event loop, and
  bounds the waiting work: a request that would make more than ``admission_queue`` requests
  wait or run there is refused at once with 429 (``OverloadedError``), saying so. A small
  request (inputs of at most ``admission_inline_bytes``: a sentence) runs its step on the
  event loop instead: measuring it costs less than the hop to a thread
  and back, and it reaches the batcher while the batch it can join is still forming.
* The step's answer (:class:`~gpuserve.backends.base.Admitted`) is checked on the worker: one
  length per row, replacement inputs with the request's names, datatypes and shapes. A step
  that raises fails its own request only: ``GpuserveError`` as it is (``InvalidInputError``:
  400 naming the input), anything else as ``BackendError`` (500), logged with its traceback.

The step's work per request is bounded by the model (a text model reads at most a fixed
number of characters per row), so one huge request holds one worker for milliseconds, and a
short request from another client is admitted by another worker meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from gpuserve.backends.base import AdmissionStep, Admitted
from gpuserve.engine.request import InferenceRequest, RequestCost
from gpuserve.errors import BackendError, GpuserveError, OverloadedError, UnavailableError

logger = logging.getLogger(__name__)


class AdmissionPool:
    """The admission threads of one server, and the bound on the work waiting for them.

    Args:
        workers: Threads (started on first use).
        max_waiting: Most requests waiting for or running a step at once; beyond it a
            request is refused with 429.
        inline_bytes: Requests whose inputs hold at most this many bytes run their step on
            the caller's thread (the event loop) instead (:func:`step_inline`); 0: never.
    """

    def __init__(self, workers: int, max_waiting: int, inline_bytes: int = 0) -> None:
        self.workers = max(1, workers)
        self.max_waiting = max(1, max_waiting)
        self.inline_bytes = inline_bytes
        self._waiting = 0
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._idle: asyncio.Event | None = None

    @property
    def waiting(self) -> int:
        """Requests waiting for or running their step now."""
        return self._waiting

    def run(
        self, step: AdmissionStep, request: InferenceRequest, rows: int, label: str
    ) -> asyncio.Future[Admitted]:
        """Start ``step`` on ``request``'s inputs on a worker; the future resolves with its
        checked answer (apply it with :func:`apply`). Call on the event loop.

        Args:
            step: The model's step.
            request: The decoded request (its inputs are read, not changed, by the step).
            rows: Its batch-dimension size (the answer must have one length per row).
            label: ``model 'm' version v``, for messages.

        Raises:
            OverloadedError: ``max_waiting`` requests already wait (nothing was started).
        """
        if self._waiting >= self.max_waiting:
            raise OverloadedError(
                f"{label}: {self._waiting} requests are waiting for the model's admission "
                f"step (the limit, admission_queue = {self.max_waiting}, on "
                f"{self.workers} admission workers); retry later"
            )
        loop = asyncio.get_running_loop()
        try:
            future = loop.run_in_executor(
                self._executor(), run_checked, step, request.inputs, rows, label
            )
        except RuntimeError:  # the threads were stopped (the server is closing)
            raise UnavailableError(f"{label}: the server is shutting down") from None
        self._waiting += 1
        if self._idle is not None:
            self._idle.clear()
        future.add_done_callback(self._finished)
        return future

    def _finished(self, future: asyncio.Future[Admitted]) -> None:
        self._waiting -= 1
        if not future.cancelled():
            future.exception()  # seen here too: an abandoned step's error is not "never retrieved"
        if not self._waiting and self._idle is not None:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no step waits or runs; False after ``timeout_s`` seconds."""
        if not self._waiting:
            return True
        if self._idle is None:
            self._idle = asyncio.Event()
        self._idle.clear()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        """Stop the threads (steps still running finish; queued ones are dropped)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.workers, thread_name_prefix="gpuserve-admission"
                )
            return self._pool


def apply(request: InferenceRequest, admitted: Admitted) -> None:
    """Give ``request`` its step's answer: its cost, and its replacement inputs if any."""
    request.cost = RequestCost(admitted.lengths)
    if admitted.inputs is not None:
        request.inputs = admitted.inputs


def run_checked(
    step: AdmissionStep, inputs: dict[str, np.ndarray], rows: int, label: str
) -> Admitted:
    """Run ``step`` and check its answer (see the module docstring); on a worker thread, or
    inline for a small request.

    Raises:
        GpuserveError: the step's own error (as it is), or BackendError for anything else it
            raised or a wrong answer (logged).
    """
    try:
        admitted = step(inputs)
    except GpuserveError:
        raise
    except Exception as err:
        logger.error(
            "%s: the admission step failed", label, exc_info=(type(err), err, err.__traceback__)
        )
        raise BackendError(
            f"{label}: the admission step failed ({type(err).__name__}: {err})"
        ) from None
    problem = _problem(admitted, inputs, rows)
    if problem is not None:
        logger.error("%s: the admission step answered wrongly: %s", label, problem)
        raise BackendError(f"{label}: the admission step answered wrongly: {problem}")
    if not all(type(n) is int for n in admitted.lengths) or type(admitted.lengths) is not tuple:
        admitted = Admitted(tuple(int(n) for n in admitted.lengths), admitted.inputs)
    return admitted


def _problem(admitted: Any, inputs: dict[str, np.ndarray], rows: int) -> str | None:
    """What is wrong with a step's answer, or None."""
    if not isinstance(admitted, Admitted):
        return f"expected an Admitted, got {type(admitted).__name__}"
    lengths = admitted.lengths
    if len(lengths) != rows:
        return f"{len(lengths)} lengths for {rows} rows"
    if any(not isinstance(n, int | np.integer) or n < 0 for n in lengths):
        return f"lengths must be non-negative integers, got {list(lengths)[:8]}"
    replaced = admitted.inputs
    if replaced is None:
        return None
    if set(replaced) != set(inputs):
        return f"replacement inputs {sorted(replaced)}, the request has {sorted(inputs)}"
    for name, array in inputs.items():
        new = replaced[name]
        if not isinstance(new, np.ndarray):
            return f"input '{name}' replaced by a {type(new).__name__}, expected a numpy array"
        if new.dtype != array.dtype or new.shape != array.shape:
            got = f"{new.dtype} {list(new.shape)}"
            return f"input '{name}' replaced by {got}, expected {array.dtype} {list(array.shape)}"
    return None


def input_bytes(inputs: dict[str, np.ndarray], limit: int) -> int:
    """Bytes the request's inputs hold (BYTES elements by their length), counted until
    ``limit`` is passed (then some value above it)."""
    total = 0
    for array in inputs.values():
        if array.dtype != object:
            total += array.nbytes
        else:
            for element in array.flat:
                total += len(element) if isinstance(element, bytes | str) else limit + 1
                if total > limit:
                    return total
        if total > limit:
            return total
    return total
