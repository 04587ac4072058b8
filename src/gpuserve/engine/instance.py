"""An instance: one copy of a model on one device, with its own execution thread.

The instance thread loads the backend (so device state such as a CUDA context belongs to the
thread that uses it), then runs batches handed to it by the scheduler: stack the requests'
inputs, ``preprocess`` -> ``forward`` -> ``postprocess``, check the outputs against the batch and
split them back into per-request results. Results go back through ``on_done``, called on the
instance thread; the scheduler hops them onto its event loop.

Failure policy: when a batch of several requests raises, each request is run again on its own,
so only the request that causes the failure gets an error (BC-14). A batch whose outputs do not
have one row per input row fails every request in it with a message that says so (BC-09).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from gpuserve.backends.base import Backend, LoadContext, RowErrors
from gpuserve.config import ModelConfig
from gpuserve.engine.batcher import Batch
from gpuserve.engine.request import InferenceRequest
from gpuserve.errors import BackendError, GpuserveError

logger = logging.getLogger(__name__)

Outputs = dict[str, np.ndarray]


@dataclass(slots=True)
class BatchResult:
    """What an instance reports for one batch.

    Attributes:
        batch: The batch that ran.
        results: Per item of ``batch.items``: its outputs or the error it gets.
        started_s / finished_s: Monotonic seconds around the execution.
        preprocess_s / forward_s / postprocess_s: Stage durations of the (first) attempt.
        executions: Model executions used (more than 1 when a failed batch was split).
    """

    batch: Batch
    results: list[Outputs | GpuserveError]
    started_s: float
    finished_s: float
    preprocess_s: float = 0.0
    forward_s: float = 0.0
    postprocess_s: float = 0.0
    executions: int = 1
    batch_sizes: list[int] = field(default_factory=list)


class Instance:
    """One model copy and its execution thread.

    Args:
        name: For logs and thread names, e.g. ``text_embedding:1#0``.
        backend: The backend object (not yet loaded).
        context: What the backend is told at load.
        on_done: Called on the instance thread with each :class:`BatchResult`.
    """

    def __init__(
        self,
        name: str,
        backend: Backend,
        context: LoadContext,
        on_done: Callable[[BatchResult], None],
    ) -> None:
        self.name = name
        self.backend = backend
        self.context = context
        self.config: ModelConfig = context.config
        self.on_done = on_done
        self.in_flight = 0  # batches submitted and not yet reported; owned by the scheduler
        self._queue: queue.SimpleQueue[Batch | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        self._batched = self.config.max_batch_size > 0
        self._output_names = [o.name for o in self.config.outputs]

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, timeout_s: float | None = None) -> None:
        """Start the thread, load and warm up the backend; block until done.

        Raises:
            BaseException: whatever the backend's load or warmup raised.
        """
        self._thread = threading.Thread(
            target=self._main, name=f"gpuserve-{self.name}", daemon=True
        )
        self._thread.start()
        self._loaded.wait(timeout_s)
        if self._load_error is not None:
            raise self._load_error

    def submit(self, batch: Batch) -> None:
        """Queue ``batch`` for execution (non-blocking)."""
        self._queue.put(batch)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish queued batches, unload the backend and end the thread."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _main(self) -> None:
        try:
            self.backend.load(self.context)
            self.backend.warmup()
        except BaseException as err:  # reported to start(), which re-raises
            self._load_error = err
            self._loaded.set()
            return
        self._loaded.set()
        while True:
            batch = self._queue.get()
            if batch is None:
                break
            result = self.run(batch)
            try:
                self.on_done(result)
            except Exception:  # the scheduler's callback must not kill the thread
                logger.exception("instance %s: result callback failed", self.name)
        try:
            self.backend.unload()
        except Exception:
            logger.exception("instance %s: unload failed", self.name)

    # -- execution -------------------------------------------------------------------------

    def run(self, batch: Batch) -> BatchResult:
        """Execute ``batch`` on this thread and return per-request results (never raises)."""
        started = time.monotonic()
        requests = [item.request for item in batch.items]
        result = BatchResult(batch, [], started, started, batch_sizes=[batch.rows])
        try:
            outputs, times = self._execute(requests, batch.rows)
            result.preprocess_s, result.forward_s, result.postprocess_s = times
            result.results = self._split(requests, outputs)
        except Exception as err:
            if len(requests) > 1:
                logger.warning(
                    "instance %s: batch of %d requests failed (%s); running them one by one",
                    self.name,
                    len(requests),
                    _describe(err),
                )
                result.results = []
                for item in batch.items:
                    result.executions += 1
                    result.batch_sizes.append(item.rows)
                    try:
                        outputs, _ = self._execute([item.request], item.rows)
                        result.results.extend(self._split([item.request], outputs))
                    except Exception as single_err:
                        result.results.append(self._to_error(single_err))
            else:
                result.results = [self._to_error(err)]
        result.finished_s = time.monotonic()
        return result

    def _to_error(self, err: Exception) -> GpuserveError:
        if isinstance(err, GpuserveError):
            return err
        logger.error("instance %s: model raised %s", self.name, _describe(err))
        return BackendError(f"model '{self.config.name}' failed: {_describe(err)}")

    def _execute(
        self, requests: list[InferenceRequest], rows: int
    ) -> tuple[Outputs, tuple[float, float, float]]:
        inputs = self._stack(requests)
        t0 = time.monotonic()
        prepared = self.backend.preprocess(inputs)
        t1 = time.monotonic()
        raw = self.backend.forward(prepared)
        t2 = time.monotonic()
        outputs = self.backend.postprocess(raw)
        t3 = time.monotonic()
        self._check_outputs(outputs, rows)
        return outputs, (t1 - t0, t2 - t1, t3 - t2)

    def _stack(self, requests: list[InferenceRequest]) -> dict[str, np.ndarray]:
        first = requests[0].inputs
        if len(requests) == 1:
            return first
        return {name: np.concatenate([r.inputs[name] for r in requests], axis=0) for name in first}

    def _check_outputs(self, outputs: Outputs, rows: int) -> None:
        missing = [name for name in self._output_names if name not in outputs]
        if missing:
            raise BackendError(
                f"model '{self.config.name}' did not return output(s) {missing}; "
                f"it returned {sorted(outputs)}"
            )
        if not self._batched:
            return
        for name in self._output_names:
            array = outputs[name]
            got = array.shape[0] if array.ndim else None
            if got != rows:
                got_text = "a scalar" if got is None else f"{got} rows"
                raise BackendError(
                    f"model '{self.config.name}' returned {got_text} in output '{name}' "
                    f"for a batch of {rows} rows"
                )

    def _split(
        self, requests: list[InferenceRequest], outputs: Outputs
    ) -> list[Outputs | GpuserveError]:
        results: list[Outputs | GpuserveError] = []
        row_errors = outputs.errors if isinstance(outputs, RowErrors) else None
        offset = 0
        for request in requests:
            names = request.requested_outputs or self._output_names
            rows = _rows(request, self._batched)
            end = offset + rows
            if row_errors:
                failed = [row for row in range(offset, end) if row in row_errors]
                if failed:
                    results.append(self._row_error(failed[0] - offset, row_errors[failed[0]]))
                    offset = end
                    continue
            if len(requests) == 1:
                results.append({name: outputs[name] for name in names})
            else:
                results.append({name: outputs[name][offset:end] for name in names})
            offset = end
        return results

    def _row_error(self, row: int, error: object) -> GpuserveError:
        if isinstance(error, GpuserveError):
            return error
        return BackendError(
            f"model '{self.config.name}' failed on row {row} of the request: {error}"
        )


def _rows(request: InferenceRequest, batched: bool) -> int:
    if not batched:
        return 1
    return next(iter(request.inputs.values())).shape[0]


def _describe(err: BaseException) -> str:
    text = str(err)
    if len(text) > 500:
        text = text[:497] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
