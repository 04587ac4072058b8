"""The ensemble runner: runs one ensemble version's requests through its step DAG.

A :class:`~gpuserve.engine.runners.base.VersionRunner` (the service admits, decodes against
the ensemble's configuration and calls :meth:`submit` or :meth:`infer`) with no instance and
no queue of its own: each step of a request enters the **step model's own runner** the way a
client's request does (its admission step: token counts, the UTF-8 check, truncation; its
output checks), so it is batched with that model's other traffic by that model's batcher, and
each step's execution is counted in the step model's statistics. Intermediate tensors stay in
the process, handed from one step's response to the next step's request as they are (no
encoding, no copy); where producer and consumers run on one device with backends that give
and take tensors, they stay ``torch.Tensor`` on that device
(:mod:`gpuserve.engine.ensemble.handoff`).

The decisions are :class:`~gpuserve.engine.ensemble.plan.EnsembleRun`'s (which steps may start);
this module only waits, on the event loop, with no task per request: every step future resolves
through a done callback that starts the steps it unblocks. A step that fails (or times out after
``ensemble.step_timeout_s``) fails that request only, with the step's error class and a message
naming the step; the other steps of the request still queued are dropped before they run. What
the steps produced for the ensemble's own outputs is checked against the ensemble's
configuration as every runner checks its model's outputs
(:func:`~gpuserve.engine.assembly.check_outputs`: shape, rows, datatype; 500 naming the
ensemble), not only at load. Step models are found through a :class:`StepRouter` (the model
manager), per request, so a step model that is swapped to a new version is followed, and one
that loads on demand is loaded at the first request that needs it.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpuserve.backends import tensors as _tensors
from gpuserve.backends.base import Capabilities
from gpuserve.config import ModelConfig
from gpuserve.engine.assembly import OutputSpec, check_outputs, request_rows
from gpuserve.engine.ensemble.handoff import HandoffDecision, host_inputs
from gpuserve.engine.ensemble.plan import EnsemblePlan, EnsembleRun
from gpuserve.engine.request import (
    InferenceRequest,
    InferenceResponse,
    RequestTiming,
    end_trace_with,
)
from gpuserve.engine.runners.base import VersionRunner
from gpuserve.engine.stats import ModelStats, RequestStats, StepStats
from gpuserve.errors import (
    BackendError,
    CancelledRequestError,
    GpuserveError,
    ModelNotFoundError,
    ModelNotReadyError,
    RequestTimeoutError,
    UnavailableError,
)

logger = logging.getLogger(__name__)


class StepRouter(Protocol):
    """How the ensemble reaches its step models (the model manager implements it)."""

    def runner(self, name: str, version: str | None) -> VersionRunner:
        """The runner serving ``name`` (version ``version``, None: the default).

        Raises:
            ModelNotFoundError, ModelNotReadyError: it cannot take requests now.
        """
        ...

    def cold(self, name: str) -> bool:
        """Whether ``name`` must be loaded on demand before it takes a request."""
        ...

    async def ensure_loaded(self, name: str) -> None:
        """Load ``name`` on demand (see ``ModelManager.ensure_loaded``)."""
        ...


@dataclass(slots=True, eq=False)
class _Run:
    """One request in flight through the DAG."""

    request: InferenceRequest
    state: EnsembleRun
    future: asyncio.Future[InferenceResponse]
    started: float
    rows: int
    keep: tuple[frozenset[str], ...] = ()
    steps: dict[int, asyncio.Future[InferenceResponse]] = field(default_factory=dict)
    step_started: dict[int, float] = field(default_factory=dict)
    timers: dict[int, asyncio.TimerHandle] = field(default_factory=dict)
    queue_s: float = 0.0
    compute_s: float = 0.0
    over: bool = False

    def gone(self) -> bool:
        """The probe step requests carry: True once the run is over or its client left."""
        if self.over:
            return True
        probe = self.request.is_cancelled
        return probe is not None and probe()


def step_error(label: str, ensemble: str, err: BaseException) -> GpuserveError:
    """``err`` (from step ``label``) as the ensemble's error: the same class (a missing step
    model is 503 for the ensemble, not 404), its message prefixed with the step."""
    prefix = f"ensemble '{ensemble}' {label}: "
    if isinstance(err, ModelNotFoundError):
        return ModelNotReadyError(prefix + err.message)
    if isinstance(err, GpuserveError):
        wrapped = copy.copy(err)
        wrapped.message = prefix + err.message
        wrapped.args = (wrapped.message,)
        return wrapped
    return BackendError(f"{prefix}{type(err).__name__}: {err}")


class EnsembleRunner(VersionRunner):
    """Runs the requests of one ensemble version (module docstring).

    Args:
        config: The ensemble's configuration (``config.ensemble`` set).
        version: Its version number as a string.
        router: Reaches the step models' runners.
        clock: Monotonic clock, seconds.

    Attributes:
        plan: The step DAG.
        stats: The version's statistics, the whole and (``ensemble_steps``) each step's.
        step_stats: Each step's statistics (the same objects as ``stats.ensemble_steps``).
    """

    kind = "ensemble"

    def __init__(
        self,
        config: ModelConfig,
        version: str,
        router: StepRouter,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(config, version, Capabilities(), None, clock)
        assert config.ensemble is not None
        self.plan = EnsemblePlan.of(config)
        self.router = router
        self._outputs = OutputSpec.of(config)
        self.step_stats = [StepStats(s.index, s.model) for s in self.plan.steps]
        self.stats = ModelStats(self.name, version, ensemble_steps=self.step_stats)
        self._step_timeout_s = config.ensemble.step_timeout_s or None
        self._runs: set[_Run] = set()
        self._closing = False
        self._handoff = HandoffDecision(self.plan)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._unhealthy_reason: str | None = None

    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start taking requests on ``loop`` (an ensemble has no instance)."""
        self._loop = loop

    @property
    def unhealthy_reason(self) -> str | None:
        """Why the ensemble is not ready (a step model not served), set by :attr:`healthy`."""
        return self._unhealthy_reason

    @property
    def healthy(self) -> bool:
        """Whether every step model is served now (or loads on demand); otherwise
        :attr:`unhealthy_reason` names the first step that is not, and the ensemble reads as
        not ready (its readiness follows its steps)."""
        for step in self.plan.steps:
            if self.router.cold(step.model):
                continue
            try:
                self.router.runner(step.model, step.version)
            except GpuserveError as err:
                self._unhealthy_reason = f"{step.label} is not served: {err.message}"
                return False
        self._unhealthy_reason = None
        return True

    @property
    def in_flight_requests(self) -> int:
        """Ensemble requests admitted and not yet answered."""
        return len(self._runs)

    # -- admission -------------------------------------------------------------------------

    def _queue(self, request: InferenceRequest) -> asyncio.Future[InferenceResponse]:
        """Start ``request``'s steps and return the future of its response.

        Raises:
            UnavailableError: the ensemble is unloading or not attached.
        """
        loop = self._loop
        if self._closing or loop is None:
            raise UnavailableError(f"model '{self.name}' is unloading")
        future = loop.create_future()
        run = _Run(
            request,
            EnsembleRun.begin(self.plan, request.inputs),
            future,
            self.clock(),
            request_rows(request) if self._batched and request.inputs else 1,
            self._keep(),
        )
        self._runs.add(run)
        self._idle.clear()
        future.add_done_callback(lambda f: self._on_done(run, f))
        self._launch(run, run.state.start())
        return future

    # -- steps -----------------------------------------------------------------------------

    def _served(self, model: str, version: str | None) -> VersionRunner | None:
        if self.router.cold(model):
            return None
        try:
            return self.router.runner(model, version)
        except GpuserveError:
            return None

    def _keep(self) -> tuple[frozenset[str], ...]:
        """Per step, the outputs its request keeps as device tensors."""
        return self._handoff.keep([self._served(s.model, s.version) for s in self.plan.steps])

    def _step_inputs(self, run: _Run, index: int, runner: VersionRunner) -> dict[str, Any]:
        state = run.state
        inputs = state.step_inputs(index)
        return host_inputs(self.plan, index, inputs, state.tensors, runner, self.step_stats[index])

    def _launch(self, run: _Run, indices: list[int]) -> None:
        for index in indices:
            if run.over:
                return
            step = self.plan.steps[index]
            if self.router.cold(step.model):
                assert self._loop is not None
                task = self._loop.create_task(self._load_then_submit(run, index))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            else:
                self._submit_step(run, index)

    async def _load_then_submit(self, run: _Run, index: int) -> None:
        try:
            await self.router.ensure_loaded(self.plan.steps[index].model)
        except Exception as err:  # every run ends with an answer, whatever failed
            self._fail(run, index, err)
            return
        if not run.over:
            self._submit_step(run, index)

    def _submit_step(self, run: _Run, index: int) -> None:
        step = self.plan.steps[index]
        request = run.request
        # A traced ensemble request: the step's span nests under the ensemble's.
        trace = None
        if request.trace is not None:
            trace = request.trace.child(step.model, step.version, "ensemble_step")
        try:
            runner = self.router.runner(step.model, step.version)
            step_request = InferenceRequest(
                model_name=step.model,
                model_version=step.version,
                inputs=self._step_inputs(run, index, runner),
                requested_outputs=step.requested_outputs,
                id=request.id,
                parameters=request.parameters,
                priority=request.priority,
                timeout_us=request.timeout_us,
                is_cancelled=run.gone,
                keep_tensors=run.keep[index] if run.keep else frozenset(),
            )
            step_request.trace = trace
            future = runner.submit(step_request)  # as a client's: admission step first
        except Exception as err:  # refused (GpuserveError), or anything else: this run fails
            if trace is not None:
                trace.end(err)
            self._fail(run, index, err)
            return
        if trace is not None:
            end_trace_with(trace, future)
        run.steps[index] = future
        run.step_started[index] = self.clock()
        future.add_done_callback(lambda f: self._step_done(run, index, f))
        if self._step_timeout_s is not None and self._loop is not None:
            run.timers[index] = self._loop.call_later(
                self._step_timeout_s, self._step_timed_out, run, index
            )

    def _step_done(self, run: _Run, index: int, future: asyncio.Future[InferenceResponse]) -> None:
        run.steps.pop(index, None)
        timer = run.timers.pop(index, None)
        if timer is not None:
            timer.cancel()
        if run.over:
            return
        step_stats = self.step_stats[index]
        elapsed = self.clock() - run.step_started.get(index, run.started)
        if future.cancelled():
            step_stats.fail.add(elapsed)
            self._fail(run, index, CancelledRequestError("the step request was cancelled"))
            return
        error = future.exception()
        if error is not None:
            step_stats.fail.add(elapsed)
            self._fail(run, index, error)
            return
        response = future.result()
        step_stats.success.add(elapsed)
        step_stats.queue.add(response.timing.queue_s)
        step_stats.compute.add(response.timing.compute_s)
        run.queue_s += response.timing.queue_s
        run.compute_s += response.timing.compute_s
        try:
            ready = run.state.complete(index, response.outputs)
        except KeyError as err:
            self._fail(run, index, BackendError(f"the step model returned no output {err}"))
            return
        if run.state.done:
            self._finish(run)
        else:
            self._launch(run, ready)

    def _step_timed_out(self, run: _Run, index: int) -> None:
        run.timers.pop(index, None)
        if run.over or index not in run.steps:
            return
        self.step_stats[index].fail.add(self.clock() - run.step_started.get(index, run.started))
        self._fail(
            run,
            index,
            RequestTimeoutError(
                f"no answer within step_timeout_s={self._step_timeout_s} s (queued or running)"
            ),
        )

    # -- outcomes --------------------------------------------------------------------------

    def _finish(self, run: _Run) -> None:
        request = run.request
        try:
            outputs = run.state.outputs(None)  # every step ran: every declared output
        except KeyError as err:
            self._fail(run, None, BackendError(f"ensemble output {err} was not produced"))
            return
        for name, value in outputs.items():  # never kept as tensors; a guard for clients
            if _tensors.is_tensor(value):
                outputs[name] = _tensors.to_host(value)
        try:  # against the ensemble's own config, as every runner checks its model's outputs
            check_outputs(self._outputs, outputs, run.rows)
        except GpuserveError as err:
            self._fail(run, None, err)
            return
        wanted = request.requested_outputs  # checked against the config on entry
        if wanted is not None:
            outputs = {name: outputs[name] for name in wanted}
        total_s = self.clock() - run.started
        response = InferenceResponse(
            model_name=self.name,
            model_version=self.version,
            id=request.id,
            outputs=outputs,
            timing=RequestTiming(queue_s=run.queue_s, compute_s=run.compute_s, total_s=total_s),
            rows=run.rows,
        )
        self._end(run, None, total_s)
        if not run.future.done():
            run.future.set_result(response)

    def _fail(self, run: _Run, index: int | None, err: BaseException) -> None:
        if run.over:
            return
        if index is not None:
            error = step_error(self.plan.steps[index].label, self.name, err)
            logger.debug("ensemble %s: step %d failed: %s", self.name, index, err)
        elif isinstance(err, GpuserveError):
            error = err
        else:
            error = BackendError(f"ensemble '{self.name}': {type(err).__name__}: {err}")
        self._end(run, error.reason, self.clock() - run.started)
        if not run.future.done():
            run.future.set_exception(error)

    def _end(self, run: _Run, reason: str | None, total_s: float) -> None:
        """Close ``run`` once: drop its pending steps and timers, record its statistics."""
        run.over = True
        for future in list(run.steps.values()):
            future.cancel()  # its request is dropped before it runs (the probe says gone)
        run.steps.clear()
        for timer in run.timers.values():
            timer.cancel()
        run.timers.clear()
        if reason is None:
            self.stats.execution_count += 1
        self.stats.record_request(
            RequestStats(
                self.name,
                self.version,
                run.rows if reason is None else 0,
                run.queue_s,
                run.compute_s,
                total_s,
                reason,
            )
        )
        self._runs.discard(run)
        if not self._runs:
            self._idle.set()

    def _on_done(self, run: _Run, future: asyncio.Future[InferenceResponse]) -> None:
        if future.cancelled() and not run.over:  # the caller went away
            self._end(run, CancelledRequestError.reason, self.clock() - run.started)

    # -- shutdown --------------------------------------------------------------------------

    async def close(self, drain_timeout_s: float = 30.0) -> None:
        """Refuse new requests, let running ones finish (up to the timeout, seconds), then
        fail what is left with 503."""
        self._closing = True
        try:
            await asyncio.wait_for(self._idle.wait(), drain_timeout_s)
        except TimeoutError:
            for run in list(self._runs):
                self._fail(run, None, UnavailableError(f"model '{self.name}' unloaded"))
        for task in list(self._tasks):
            task.cancel()


def is_ensemble(config: ModelConfig) -> bool:
    """Whether ``config`` describes an ensemble."""
    return config.ensemble is not None


__all__ = [
    "EnsembleRunner",
    "StepRouter",
    "is_ensemble",
    "step_error",
]
