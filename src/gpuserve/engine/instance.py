"""An instance: one copy of a model on one device, and the threads that run its batches.

Each batch passes three stages: stack the requests' inputs and ``preprocess`` (CPU),
``forward`` (device), ``postprocess`` and split the rows back to their requests (CPU).
A decoupled model's batch is a batch of streams: its forward stage calls the backend's
``stream`` (one request) or ``stream_batch`` (several) with each request's own inputs and
response sink, the other two stages do nothing, and the result reports the call (its time,
whether it raised): the responses went out through the sinks. The instance is free again
when the call returns, even while a stream goes on (a Triton model that hands its response
sender to a thread of its own).

* ``pipeline_depth == 1``: one thread runs the stages one after another.
* ``pipeline_depth > 1``: each stage has its own thread, joined by queues, and up to
  ``pipeline_depth`` batches are in flight, so preprocessing of batch N+1 and postprocessing of
  batch N-1 overlap the forward pass of batch N. A model whose stages take p, f and q seconds
  then runs at about 1 / max(p, f, q) batches per second instead of 1 / (p + f + q).

The thread that runs ``forward`` also loads the backend, so device state such as a CUDA
context belongs to the thread that uses it. Results go back through ``on_done``, called on the
postprocess thread; the scheduler hops them onto its event loop.

An instance never decides what to do about a failed batch: it reports the error, already turned
into a :class:`~gpuserve.errors.GpuserveError` (CUDA out-of-memory becomes
:class:`~gpuserve.errors.OutOfMemoryError` after the allocator cache is freed), and whether
splitting the batch could help. The scheduling core retries halves (see ``scheduling.py``).
Stacking, the output checks and the split are the pure functions of ``assembly.py``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuserve.backends import call_scope
from gpuserve.backends.base import Backend, Capabilities, LoadContext, RowErrors
from gpuserve.backends.streaming import StreamCall
from gpuserve.config import ModelConfig
from gpuserve.engine import tracing
from gpuserve.engine.assembly import (
    OutputMismatch,
    OutputSpec,
    check_outputs,
    split_outputs,
    stack_inputs,
    wants_tensors,
)
from gpuserve.engine.batch import Batch, BatchResult, Outputs, Pending
from gpuserve.engine.padding import PaddingSpec
from gpuserve.engine.rows import BatchRows, context_of
from gpuserve.engine.warmup_samples import WarmupBatch, stream_sample, warmup_batches
from gpuserve.errors import BackendError, GpuserveError, OutOfMemoryError

__all__ = ["BatchResult", "Instance", "resolve_pipeline_depth"]  # BatchResult: engine/batch.py

logger = logging.getLogger(__name__)


class Instance:
    """One model copy and its stage threads.

    Args:
        name: For logs and thread names, e.g. ``text_embedding:1#0``.
        backend: The backend object (not yet loaded).
        context: What the backend is told at load.
        on_done: Called with each :class:`BatchResult` (on an instance thread).
        pipeline_depth: Most batches in flight; >1 runs the stages on separate threads.
    """

    def __init__(
        self,
        name: str,
        backend: Backend,
        context: LoadContext,
        on_done: Callable[[BatchResult], None],
        pipeline_depth: int = 1,
    ) -> None:
        self.name = name
        self.backend = backend
        self.context = context
        self.config: ModelConfig = context.config
        self.on_done = on_done
        self.capacity = max(1, pipeline_depth)
        self.in_flight = 0  # batches submitted and not yet reported; counted by the scheduling core
        #: What the loaded backend can do (``Backend.capabilities``, read once after load).
        self.capabilities = Capabilities()
        self._outputs = OutputSpec.of(self.config)
        self._padding = PaddingSpec.of(self.config)
        #: A decoupled model: each batch is a batch of streams (``_stream``).
        self._streams = self.config.model_transaction_policy.decoupled
        self._reads_rows = False  # the backend's preprocess takes the batch's row contexts
        self._trace = tracing.StageTracer(f"{self.config.name}:{context.version}", context.device)
        self._first: queue.SimpleQueue[BatchResult | Callable[[], None] | None] = (
            queue.SimpleQueue()
        )
        self._threads: list[threading.Thread] = []
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        self._trace_request: tuple[int, Path] | None = None  # set on the loop thread
        self._profiler: Any = None
        self._profile_left = 0
        #: Whether an answer that did not match the declared outputs has been logged (once
        #: per instance: the model's bug repeats on every batch, the log should not).
        self._mismatch_logged = False

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, timeout_s: float | None = None) -> None:
        """Start the threads, load and warm up the backend; block until done.

        Raises:
            BaseException: whatever the backend's load or warmup raised.
        """
        if self.capacity == 1:
            self._spawn("run", self._serial_loop)
        else:
            forward_q: queue.SimpleQueue[BatchResult | None] = queue.SimpleQueue()
            post_q: queue.SimpleQueue[BatchResult | None] = queue.SimpleQueue()
            self._spawn("pre", lambda: self._first_stage_loop(forward_q))
            self._spawn("fwd", lambda: self._forward_loop(forward_q, post_q))
            self._spawn("post", lambda: self._stage_loop(post_q, self._postprocess, None))
        self._loaded.wait(timeout_s)
        if self._load_error is not None:
            self.stop()
            raise self._load_error

    def _spawn(self, stage: str, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, name=f"gpuserve-{self.name}-{stage}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def submit(self, batch: Batch) -> None:
        """Queue ``batch`` for execution (non-blocking)."""
        self._first.put(BatchResult(batch))

    def run_loop(self, loop: Callable[[], None]) -> None:
        """Run ``loop`` on this instance's thread, where the backend loaded (the generation
        engine's step loop); it returns when its owner stops it, then :meth:`stop` unloads
        the backend. Only for instances of pipeline depth 1 (one thread)."""
        if self.capacity != 1:
            raise RuntimeError(f"instance {self.name}: run_loop needs pipeline depth 1")
        self._first.put(loop)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish queued batches, unload the backend and end the threads."""
        self._first.put(None)
        for thread in self._threads:
            thread.join(timeout_s)

    def _load(self) -> bool:
        loaded = False
        try:
            self.backend.load(self.context)
            loaded = True
            self.capabilities = self.backend.capabilities()  # read once, here
            self._reads_rows = self.capabilities.reads_rows
            self.backend.warmup()
            self._run_warmup_samples()
        except BaseException as err:  # reported to start(), which re-raises
            self._load_error = err
            if loaded:  # a failed warm-up: release what the load took (finalize, memory)
                self._unload()
            return False
        finally:
            self._loaded.set()
        return True

    def _run_warmup_samples(self) -> None:
        """Run the config's ``model_warmup`` samples through this instance's stages (its real
        execution path: stacking, preprocess, forward, postprocess, output checks), each
        ``count`` times, outputs discarded (see :mod:`.warmup_samples`).

        Raises:
            ConfigError: a sample does not fit the model, or its data file is bad.
            BackendError: a sample failed to run; names the sample and the cause.
        """
        if not self.config.model_warmup:
            return
        model = self.config.name or ""
        decoupled = self.config.model_transaction_policy.decoupled
        for sample in warmup_batches(self.config, self.context.version_path.parent):
            for _ in range(sample.runs):
                error = (
                    self._stream_sample(sample) if decoupled else self._run_sample(model, sample)
                )
                if error is not None:
                    cause = error.message.removeprefix(f"model '{model}' failed: ")
                    raise BackendError(
                        f"model '{model}' failed to run warmup sample {sample.label}: {cause}"
                    )
            logger.info(
                "instance %s: warmup sample %s ran %d time(s), %d request(s) of inputs %s",
                self.name,
                sample.label,
                sample.runs,
                sample.requests,
                {name: list(array.shape) for name, array in sample.row.items()},
            )

    def _run_sample(self, model: str, sample: WarmupBatch) -> GpuserveError | None:
        """One run of ``sample`` as one batch through the stages; its error, if any."""
        job = BatchResult(sample.batch(model))
        self._preprocess(job)
        self._forward(job)
        self._postprocess(job, report=False)
        return job.error or next((r for r in job.results if isinstance(r, GpuserveError)), None)

    def _stream_sample(self, sample: WarmupBatch) -> GpuserveError | None:
        """One run of ``sample`` on a decoupled model (``stream_sample``); its error."""
        error = stream_sample(self.backend, self.capabilities, sample, self.config.name or "")
        return None if error is None else self._to_error(error)

    def _unload(self) -> None:
        try:
            self.backend.unload()
        except Exception:
            logger.exception("instance %s: unload failed", self.name)

    def _serial_loop(self) -> None:
        if not self._load():
            return
        while (job := self._first.get()) is not None:
            if not isinstance(job, BatchResult):  # a loop handed over by run_loop
                self._run_handed(job)
                continue
            self._preprocess(job)
            self._forward(job)
            self._postprocess(job)
        self._unload()

    def _run_handed(self, job: Callable[[], None]) -> None:
        try:
            job()
        except Exception:
            logger.exception("instance %s: its loop failed", self.name)

    def _first_stage_loop(self, outbox: queue.SimpleQueue[BatchResult | None]) -> None:
        while (job := self._first.get()) is not None:
            if not isinstance(job, BatchResult):
                self._run_handed(job)
                continue
            self._preprocess(job)
            outbox.put(job)
        outbox.put(None)

    def _stage_loop(
        self,
        inbox: queue.SimpleQueue[BatchResult | None],
        stage: Callable[[BatchResult], None],
        outbox: queue.SimpleQueue[BatchResult | None] | None,
    ) -> None:
        while (job := inbox.get()) is not None:
            stage(job)
            if outbox is not None:
                outbox.put(job)
        if outbox is not None:
            outbox.put(None)

    def _forward_loop(
        self,
        inbox: queue.SimpleQueue[BatchResult | None],
        outbox: queue.SimpleQueue[BatchResult | None],
    ) -> None:
        loaded = self._load()
        while (job := inbox.get()) is not None:
            if not loaded:
                continue
            self._forward(job)
            outbox.put(job)
        outbox.put(None)
        if loaded:
            self._unload()

    # -- stages ----------------------------------------------------------------------------

    def _preprocess(self, job: BatchResult) -> None:
        job.started_s = t0 = time.monotonic()
        job.rows = rows = BatchRows(job.batch.items)
        if self._streams:  # each stream's backend call takes its request's own arrays
            return
        self._trace.begin("preprocess", job)
        try:
            padding = self._padding
            items = job.batch.items
            inputs = stack_inputs(items) if padding is None else padding.stack(items)
            if self._reads_rows:
                job.prepared = self.backend.preprocess_rows(inputs, rows)
            else:
                job.prepared = self.backend.preprocess(inputs)
        except BaseException as err:
            self._fail(job, err)
        self._trace.end()
        job.preprocess_s = time.monotonic() - t0

    def start_trace(self, batches: int, directory: Path) -> None:
        """Profile the forward stage of the next ``batches`` batches with ``torch.profiler``
        and write a Chrome-trace file (``*.pt.trace.json``, opened by TensorBoard's profiler
        plugin and by Perfetto) into ``directory``."""
        self._trace_request = (batches, directory)

    def _profile_begin(self) -> None:
        request, self._trace_request = self._trace_request, None
        if request is None or self._profiler is not None:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

        activities = [ProfilerActivity.CPU]
        if self.context.device.startswith("cuda") and torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        batches, directory = request
        worker = self.name.replace(":", "_").replace("#", "_")
        self._profiler = profile(
            activities=activities,
            record_shapes=True,
            on_trace_ready=tensorboard_trace_handler(str(directory), worker_name=worker),
        )
        self._profiler.start()
        self._profile_left = batches
        logger.info(
            "instance %s: tracing the next %d batch(es) into %s", self.name, batches, directory
        )

    def _profile_end(self) -> None:
        self._profile_left -= 1
        if self._profile_left > 0:
            return
        profiler, self._profiler = self._profiler, None
        try:
            profiler.stop()  # writes the trace file
        except Exception:
            logger.exception("instance %s: writing the trace failed", self.name)

    def _forward(self, job: BatchResult) -> None:
        if self._trace_request is not None:
            self._profile_begin()
        if self._profiler is not None:
            try:
                self._forward_once(job)
            finally:
                self._profile_end()
            return
        self._forward_once(job)

    def _forward_once(self, job: BatchResult) -> None:
        if job.error is not None:
            return
        t0 = time.monotonic()
        self._trace.begin("forward", job)
        # a call made from forward inherits from the batch's rows: how long they are
        # awaited, and the trace it nests under
        rows = job.rows  # (never tested for truth: that would build the contexts)
        call_scope.enter_batch(rows if rows is not None else BatchRows(job.batch.items))
        if self._streams:
            self._stream(job)
        else:
            try:
                job.raw = self.backend.forward(job.prepared)
            except BaseException as err:
                self._fail(job, err)
        call_scope.leave_batch()
        self._trace.end()
        job.prepared = None
        job.forward_s = time.monotonic() - t0

    def _stream(self, job: BatchResult) -> None:
        """The forward stage of a batch of streams: one backend call for the requests whose
        clients have not gone (``stream_batch`` with each request's inputs, sink and row
        context; ``stream`` for one when the backend runs no batches of streams), each
        sending its responses to its own sink. The call's exception fails every stream of
        it that had not ended (sent once, logged once). Never retried: responses may have
        gone out."""
        job.retryable = False
        calls = [
            StreamCall(item.request.inputs, item.sink, context_of(item.request))
            for item in job.batch.items
            if item.sink is not None and not item.sink.is_cancelled()
        ]
        if not calls:
            return
        try:
            if len(calls) == 1 and not self.capabilities.streams_batches:
                self.backend.stream(calls[0].inputs, calls[0].sink)
            else:  # a batch of streams, or one with its context (Triton's execute)
                self.backend.stream_batch(calls)
        except BaseException as err:
            job.error = error = self._to_error(err)
            for call in calls:
                call.sink.send(None, final=True, error=error)

    def _postprocess(self, job: BatchResult, report: bool = True) -> None:
        t0 = time.monotonic()
        self._trace.begin("postprocess", job)
        if job.error is None and not self._streams:
            try:
                if wants_tensors(job.batch.items):  # an ensemble step takes device tensors
                    outputs = self.backend.postprocess_tensors(job.raw)
                else:
                    outputs = self.backend.postprocess(job.raw)
                check_outputs(self._outputs, outputs, job.batch.rows)
                row_errors = outputs.errors if isinstance(outputs, RowErrors) else None
                job.results = split_outputs(self._outputs, job.batch.items, outputs, row_errors)
                if self._padding is not None:
                    job.results = _unpad(self._padding, job.batch.items, job.results)
            except BaseException as err:
                self._fail(job, err)
        self._trace.end()
        job.raw = None
        job.postprocess_s = time.monotonic() - t0
        job.finished_s = time.monotonic()
        if not report:  # a warmup batch: nobody waits for it
            return
        try:
            self.on_done(job)
        except Exception:  # the scheduler's callback must not kill the thread
            logger.exception("instance %s: result callback failed", self.name)

    def _fail(self, job: BatchResult, err: BaseException) -> None:
        job.retryable = not isinstance(err, OutputMismatch)
        job.error = self._to_error(err)

    def _to_error(self, err: BaseException) -> GpuserveError:
        if isinstance(err, OutputMismatch) and not self._mismatch_logged:
            # the client gets a 500 with this message; the operator needs it in the log too
            self._mismatch_logged = True
            logger.error(
                "instance %s: answer does not match the declared outputs (first such answer "
                "of this instance; later ones are not logged): %s",
                self.name,
                err.message,
            )
        if isinstance(err, GpuserveError):
            return err
        if _is_out_of_memory(err):
            _free_device_cache()
            return OutOfMemoryError(
                f"model '{self.config.name}' ran out of memory on {self.context.device}: "
                f"{_describe(err)}"
            )
        # The server log gets the whole traceback (the user's model code is in it); the
        # answer carries only the one-line description.
        logger.error(
            "instance %s: model raised %s",
            self.name,
            _describe(err),
            exc_info=(type(err), err, err.__traceback__),
        )
        return BackendError(f"model '{self.config.name}' failed: {_describe(err)}")


def _unpad(
    padding: PaddingSpec, items: list[Pending], results: list[Outputs | GpuserveError]
) -> list[Outputs | GpuserveError]:
    """Each request's outputs cut back to its own sizes (errors pass through)."""
    return [
        result if isinstance(result, GpuserveError) else padding.unpad(item, result)
        for item, result in zip(items, results, strict=True)
    ]


def resolve_pipeline_depth(config: ModelConfig, device: str) -> int:
    """Batches in flight for an instance on ``device`` (``optimization.pipeline_depth``,
    0 = 3 on CUDA devices, 1 elsewhere); always 1 for a generative model, whose engine
    loop owns its one thread."""
    if config.generates:
        return 1
    depth = config.optimization.pipeline_depth
    if depth:
        return depth
    return 3 if device.startswith("cuda") else 1


def _is_out_of_memory(err: BaseException) -> bool:
    if isinstance(err, MemoryError):
        return True
    name = type(err).__name__
    return name == "OutOfMemoryError" or (
        isinstance(err, RuntimeError) and "out of memory" in str(err).lower()
    )


def _free_device_cache() -> None:
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _describe(err: BaseException) -> str:
    text = str(err)
    if len(text) > 500:
        text = text[:497] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
