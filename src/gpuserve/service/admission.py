"""Models' admission steps: per request, before batching, on a bounded pool of threads.

A model may declare an admission step (:meth:`gpuserve.backends.base.Backend.admission`; a
``python`` model's ``Model.admit``): the built-in text models count each row's tokens and cut
long texts before tokenisation. :class:`~gpuserve.service.inference.InferenceService` runs it
between decoding a request and queueing it, only for models that declare one (the others are
queued at once, with no await and no thread hop):

* :func:`admission_step` finds a served version's step (its first instance's backend).
* :class:`AdmissionPool` runs steps on ``admission_workers`` threads, off the event loop, and
  bounds the waiting work: a request that would make more than ``admission_queue`` requests
  wait or run there is refused at once with 429 (``OverloadedError``), saying so. A small
  request (inputs of at most ``admission_inline_bytes``: a sentence) runs its step on the
  event loop instead (:func:`step_inline`): measuring it costs less than the hop to a thread
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from gpuserve.backends.base import AdmissionStep, Admitted
from gpuserve.engine.request import InferenceRequest, InferenceResponse, RequestCost
from gpuserve.engine.scheduler import ModelScheduler
from gpuserve.engine.stats import RequestStats
from gpuserve.errors import BackendError, GpuserveError, OverloadedError, UnavailableError

if TYPE_CHECKING:
    from gpuserve.service.inference import Admission

logger = logging.getLogger(__name__)


def admission_step(scheduler: ModelScheduler) -> AdmissionStep | None:
    """The admission step of a served version, or None when its model declares none (or it
    has no instance right now, while a hung one is replaced).

    Asked per request, so it allocates nothing: attribute reads and method calls (the
    backends store their step at load; ``python`` models' is looked up once per model).
    """
    instances = scheduler.core.instances  # the property's list, without its call
    if not instances:
        return None
    try:
        return instances[0].backend.admission()
    except AttributeError:  # an instance or a backend without the hook (test doubles)
        return None


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
                self._executor(), _call, step, request.inputs, rows, label
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


def _call(step: AdmissionStep, inputs: dict[str, np.ndarray], rows: int, label: str) -> Admitted:
    """Worker: run ``step`` and check its answer (see the module docstring)."""
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
        if not isinstance(new, np.ndarray) or new.dtype != array.dtype or new.shape != array.shape:
            got = f"{getattr(new, 'dtype', type(new).__name__)} {list(getattr(new, 'shape', ()))}"
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


def step_inline(pool: AdmissionPool, admission: Admission) -> bool:
    """Run ``admission``'s step here, at once, when its inputs are small (at most
    ``pool.inline_bytes``); True when it ran (the step is then cleared), False to leave it to
    the threads.

    Raises:
        GpuserveError: the step failed (counted on the version; this request only).
    """
    limit = pool.inline_bytes
    if limit <= 0 or input_bytes(admission.request.inputs, limit) > limit:
        return False
    step, admission.step = admission.step, None
    assert step is not None
    try:
        apply(
            admission.request,
            _call(step, admission.request.inputs, admission.rows, _label(admission)),
        )
    except GpuserveError as err:
        _count(admission, err)
        raise
    return True


def submit_after_step(
    pool: AdmissionPool,
    admission: Admission,
    submit: Callable[[Admission], asyncio.Future[InferenceResponse]],
) -> asyncio.Future[InferenceResponse]:
    """Run ``admission``'s step on ``pool``, then queue it with ``submit`` (the service's own
    ``submit``, now without a step); the returned future is the response's. No task.

    Raises:
        OverloadedError: the pool's bound is reached (counted on the version).
    """
    step, admission.step = admission.step, None
    assert step is not None
    try:
        started = pool.run(step, admission.request, admission.rows, _label(admission))
    except GpuserveError as err:
        _count(admission, err)
        raise
    outer: asyncio.Future[InferenceResponse] = asyncio.get_running_loop().create_future()

    def admitted(done: asyncio.Future[Admitted]) -> None:
        if outer.done():
            return
        if done.cancelled():
            outer.cancel()
            return
        try:
            apply(admission.request, done.result())
        except GpuserveError as err:  # the step's own error: this request only
            _count(admission, err)
            outer.set_exception(err)
            return
        try:
            queued = submit(admission)
        except GpuserveError as err:  # refused at the queue (counted there)
            outer.set_exception(err)
            return
        queued.add_done_callback(lambda ran: _copy(ran, outer))

    started.add_done_callback(admitted)
    return outer


async def run_step(pool: AdmissionPool, admission: Admission) -> None:
    """Run ``admission``'s step on ``pool`` and apply its answer (the gRPC path: awaited, so
    cancelling the caller drops a step that has not started).

    Raises:
        GpuserveError: the pool's bound is reached, or the step failed (counted).
    """
    step, admission.step = admission.step, None
    assert step is not None
    try:
        apply(
            admission.request,
            await pool.run(step, admission.request, admission.rows, _label(admission)),
        )
    except GpuserveError as err:
        _count(admission, err)
        raise


def _label(admission: Admission) -> str:
    return f"model '{admission.model}' version {admission.version}"


def _count(admission: Admission, err: GpuserveError) -> None:
    """Count a request refused before its version's scheduler took it."""
    admission.scheduler.stats.record_request(
        RequestStats(admission.model, admission.version, 0, 0.0, 0.0, 0.0, err.reason)
    )


def _copy(source: asyncio.Future[InferenceResponse], target: asyncio.Future[Any]) -> None:
    if target.done():
        if not source.cancelled():
            source.exception()
        return
    if source.cancelled():
        target.cancel()
    elif source.exception() is not None:
        target.set_exception(source.exception())  # type: ignore[arg-type]
    else:
        target.set_result(source.result())
