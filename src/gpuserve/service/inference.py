"""The inference service: the one admission path under every front end.

A front end turns its wire into a :class:`WireRequest` (an object that can tell the request's
id cheaply and decode the rest against a configuration) and calls :meth:`InferenceService.admit`,
which runs admission once, in this order:

1. resolve the model and version (unknown -> ``ModelNotFoundError``, not serving ->
   ``ModelNotReadyError``; counted as refused before any version took them);
2. split to the canary by the request id, **before** decoding, for requests naming no version;
3. decode against the routed version's configuration (a canary may be served with another
   ``max_batch_size`` than the default version: requests are held to the version that takes
   them), counted on that version when it fails;
4. refuse new work while the server shuts down (503);
5. install the front end's cancellation probe (a queued request whose client went away is
   dropped before it runs).

A model that is not loaded but loads on demand (``load_on_demand``, or a model evicted or
unloaded when idle) is loaded first: a front end that awaits calls
:meth:`InferenceService.admit_loaded`, which does both (a dict lookup when the model is
loaded, so its request pays nothing more). The HTTP front end, which answers from a future's
callback without a task per request, calls :meth:`~InferenceService.admit` directly and
spawns a task on :meth:`~InferenceService.admit_loaded` only for a cold model
(:meth:`InferenceService.cold`).

Then :meth:`InferenceService.submit` hands it to the routed version's runner without a task
(the HTTP front end answers from the future's done callback), :meth:`InferenceService.run`
awaits it (gRPC handlers; cancelling the awaiting task takes the request out of the queue),
and :meth:`InferenceService.stream` reads its responses one at a time (a decoupled model's
many, any other's one). The runner (:mod:`gpuserve.engine.runners`) runs the model's admission
step first when it declares one (the built-in text models count tokens and cut long texts):
ensemble steps and BLS calls enter the same runners the same way.

Statistics and Prometheus series of the requests a version took are recorded by its runner
(a decoupled request's once, when its stream ends); refusals before that are recorded here,
so every request is counted once, and
:func:`~gpuserve.service.outcome.log_access` writes the access line of every answer.

Nothing here knows HTTP or protobuf: signatures carry names, typed requests and callables.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from gpuserve.config import ModelConfig, ServerConfig
from gpuserve.engine.admission import AdmissionPool
from gpuserve.engine.request import InferenceRequest, InferenceResponse, end_trace_with
from gpuserve.engine.runners.base import ResponseStream, VersionRunner
from gpuserve.engine.stats import RequestStats
from gpuserve.errors import GpuserveError, InvalidInputError, UnavailableError
from gpuserve.metrics import ServerMetrics
from gpuserve.metrics.generation import GenerationCollector
from gpuserve.metrics.responses import ResponseCollector
from gpuserve.metrics.sequences import SequenceCollector, manager_schedulers
from gpuserve.repository.manager import ModelManager
from gpuserve.service.commands import RepositoryCommands
from gpuserve.service.extensions import Extensions, ExtensionViews
from gpuserve.service.lanes import LANE, PARAMETER, parse_lane
from gpuserve.service.names import check_version_label
from gpuserve.service.tracing.traces import TracedStream


class WireRequest(Protocol):
    """One inference request as a front end received it, not yet decoded.

    Implemented by the protocol codecs (the HTTP body with its JSON header, the gRPC
    ``ModelInferRequest``); the service calls :meth:`request_id` first when the model has a
    canary (to route the request), then :meth:`decode` with the routed version's configuration.
    """

    def request_id(self) -> str | None:
        """The client's request id, or None.

        Raises:
            InvalidInputError: the request cannot be read far enough to tell (malformed
                JSON header, an id that is not a string).
        """
        ...

    def decode(
        self, config: ModelConfig, model_name: str, model_version: str | None
    ) -> InferenceRequest:
        """Validate the request against ``config`` and build the engine's request.

        Raises:
            InvalidInputError: names the field, the value received and what is expected.
        """
        ...


@dataclass(slots=True, eq=False)
class Admission:
    """A request the service admitted, and the version that takes it.

    Attributes:
        model: The model name.
        version: The version that takes it (decimal string; the canary's when routed there).
        config: That version's configuration (encode the response against it).
        request: The decoded request (inputs as numpy arrays, batch dimension first).
    """

    model: str
    version: str
    config: ModelConfig
    request: InferenceRequest
    runner: VersionRunner = field(repr=False)

    @property
    def rows(self) -> int:
        """The request's rows (its batch dimension; 1 for a model without batching)."""
        if not self.config.max_batch_size:
            return 1
        first = next(iter(self.request.inputs.values()), None)
        return int(first.shape[0]) if first is not None and first.ndim else 1

    def shapes(self) -> dict[str, list[int]]:
        """Input name -> shape, for the access log."""
        return {name: list(array.shape) for name, array in self.request.inputs.items()}


class InferenceService:
    """Admission, read views and repository commands over one model manager.

    Args:
        manager: The model manager requests are routed to.
        config: Server settings (management, tokens, trace directory).
        metrics: Counts requests refused before they reach a model version; None for none.
    """

    def __init__(
        self, manager: ModelManager, config: ServerConfig, metrics: ServerMetrics | None = None
    ) -> None:
        self.manager = manager
        self.config = config
        self.metrics = metrics
        self.views = ExtensionViews(manager, config)
        self.repository = RepositoryCommands(manager, self.views, config)
        # Triton's shared-memory, classification, trace and log settings extensions
        self.extensions = Extensions(manager, config)
        # models' admission steps (engine/admission.py): bounded threads, bounded waiting,
        # shared by every version's runner
        if manager.admission_pool is None:
            manager.admission_pool = AdmissionPool(
                config.admission_workers, config.admission_queue, config.admission_inline_bytes
            )
        self.admission_pool: AdmissionPool = manager.admission_pool

    @classmethod
    def from_config(cls, config: ServerConfig, *, with_metrics: bool = True) -> InferenceService:
        """A service over a new model manager for ``config``, with Prometheus series fed by
        every version it loads (unless ``with_metrics`` is False)."""
        manager = ModelManager.from_config(config)
        metrics = ServerMetrics(manager) if with_metrics else None
        if metrics is not None:
            manager.version_listeners.append(metrics.watch_version)
            manager.stop_listeners.append(metrics.version_stopped)
            manager.removal_listeners.append(metrics.model_removed)
            manager.on_demand.listeners.append(metrics.on_residency)
            metrics.registry.register(SequenceCollector(manager_schedulers(manager)))
            metrics.registry.register(ResponseCollector(manager_schedulers(manager)))
            metrics.registry.register(GenerationCollector(manager_schedulers(manager)))
        return cls(manager, config, metrics)

    # -- admission -------------------------------------------------------------------------

    def cold(self, model: str) -> bool:
        """Whether a request for ``model`` must await :meth:`ensure_loaded` before
        :meth:`admit` (it loads on demand and serves nothing now). A dict lookup."""
        return self.manager.on_demand.cold(model)

    async def ensure_loaded(self, model: str) -> None:
        """Load ``model`` on demand (making room under the limits), waiting up to its
        queue timeout; requests waiting for the same model share one load. Call
        :meth:`admit` right after, without awaiting in between.

        Raises:
            GpuserveError: 404 unknown model; 503 when it could not be loaded in time (the
                reason: e.g. every loaded model pinned or busy). Already counted.
        """
        try:
            await self.manager.ensure_loaded(model)
        except GpuserveError as err:
            self.record_unrouted(model, None, err.reason)
            raise

    async def admit_loaded(
        self,
        model: str,
        version: str | None,
        wire: WireRequest,
        is_cancelled: Callable[[], bool] | None = None,
        traceparent: str | None = None,
    ) -> Admission:
        """:meth:`admit`, after loading ``model`` on demand when it is cold (awaits only
        then; admission follows the load with no await in between, so the model cannot be
        evicted before the request is queued). The entry of every front end that awaits.

        Raises:
            GpuserveError: as :meth:`ensure_loaded` and :meth:`admit` (already counted).
        """
        if self.manager.on_demand.cold(model):
            await self.ensure_loaded(model)
        return self.admit(model, version, wire, is_cancelled, traceparent)

    def admit(
        self,
        model: str,
        version: str | None,
        wire: WireRequest,
        is_cancelled: Callable[[], bool] | None = None,
        traceparent: str | None = None,
    ) -> Admission:
        """Resolve, route, decode and check one request (steps 1-5 of the module docstring).

        Args:
            model: The model name the client sent.
            version: The version label it sent, or None for the default version.
            wire: The undecoded request.
            is_cancelled: Probe, True once the client has gone away.
            traceparent: The client's W3C trace context, if it sent one (read by the front
                end only while tracing is on: see :attr:`tracing`).

        Raises:
            GpuserveError: why the request is refused (already counted).
        """
        traces = self.extensions.traces
        # Started before decoding, so the admission span covers it; None unless sampled.
        trace = traces.start(model, version, None, traceparent) if traces.active else None
        try:
            if version is not None:
                check_version_label(model, version)
            mv = self.manager.version(model, version)
        except GpuserveError as err:
            self.record_unrouted(model, version, err.reason)
            if trace is not None:
                trace.end(err)
            raise
        runner = mv.runner
        assert runner is not None
        try:
            if version is None:  # a canary may take it, by a hash of its id
                routed = self.manager.canary_split(mv, wire.request_id)
                if routed is not mv and routed.runner is not None:
                    mv, runner = routed, routed.runner
            request = wire.decode(mv.config, model, version)
            if self.manager.shutting_down:
                raise UnavailableError("server is shutting down; retry on another replica")
        except GpuserveError as err:  # counted here: it never reaches the runner
            runner.stats.record_request(
                RequestStats(model, runner.version, 0, 0.0, 0.0, 0.0, err.reason)
            )
            if trace is not None:
                trace.end(err)
            raise
        request.is_cancelled = is_cancelled
        lane = request.parameters.get(PARAMETER) if request.parameters else None
        if lane is not None:
            try:
                request.lane = parse_lane(lane, "request parameter 'lane'")
            except InvalidInputError as err:
                runner.stats.record_request(
                    RequestStats(model, runner.version, 0, 0.0, 0.0, 0.0, err.reason)
                )
                if trace is not None:
                    trace.end(err)
                raise
        elif LANE.get() == "bulk":  # the call's lane (a decoder may have set it already)
            request.lane = "bulk"
        if trace is not None:
            request.trace = trace
            trace.request_id = request.id or ""
        return Admission(model, runner.version, mv.config, request, runner)

    def submit(self, admission: Admission) -> asyncio.Future[InferenceResponse]:
        """Hand an admitted request to its version's runner; the future resolves with its
        one response or fails with why (queue timeout, model failure, unloaded; a decoupled
        model that sent no response or several: 400). No task is created.

        Raises:
            GpuserveError: refused at once (queue full, unknown priority, unloading, the
                model's admission step, the admission pool full: 429). Counted.
        """
        trace = admission.request.trace
        if trace is None:
            return admission.runner.submit(admission.request)
        try:
            future = admission.runner.submit(admission.request)
        except BaseException as err:
            trace.end(err)
            raise
        end_trace_with(trace, future)
        return future

    async def run(self, admission: Admission) -> InferenceResponse:
        """Run an admitted request and wait for its one response; cancelling the caller takes
        it out of the queue if it has not run.

        Raises:
            GpuserveError: as :meth:`submit`, and what its future fails with.
        """
        trace = admission.request.trace
        if trace is None:
            return await admission.runner.infer(admission.request)
        try:
            response = await admission.runner.infer(admission.request)
        except asyncio.CancelledError:
            trace.end(None)
            raise
        except BaseException as err:
            trace.end(err)
            raise
        trace.end(response)
        return response

    @property
    def tracing(self) -> bool:
        """Whether requests may be traced now: front ends read a client's ``traceparent``
        only then (one attribute read per request otherwise)."""
        return self.extensions.traces.active

    def stream(self, admission: Admission) -> ResponseStream:
        """Run an admitted request; its responses come from the returned stream as the model
        produces them (see :mod:`gpuserve.service.streaming`): a decoupled model's many, any
        other model's one, final.

        Raises:
            GpuserveError: refused at once (queue full: 429; unloading: 503).
        """
        stream = admission.runner.stream(admission.request)
        trace = admission.request.trace
        return stream if trace is None else TracedStream(stream, trace)

    def record_unrouted(self, model: str, version: str | None, reason: str) -> None:
        """Count a request that failed before any model version took it (unknown model or
        version, not ready, bad path, missing API token)."""
        if self.metrics is not None:
            self.metrics.record_unrouted(model, version, reason)

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def shutting_down(self) -> bool:
        """Whether new inference requests are refused (server stopping)."""
        return self.manager.shutting_down

    def begin_shutdown(self) -> None:
        """Refuse new inference requests from now on; readiness turns false."""
        self.manager.shutting_down = True

    def is_ready(self) -> bool:
        """Server readiness (see :meth:`ModelManager.is_ready`)."""
        return self.manager.is_ready()

    async def load_all(self) -> None:
        """The initial model load (see :meth:`ModelManager.load_all`)."""
        await self.manager.load_all()

    def initial_load_failed(self) -> None:
        """Mark the initial load as finished after it raised (readiness then follows the
        models that loaded, if any)."""
        self.manager.initial_load_done = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is queued or running; False after ``timeout_s`` seconds."""
        started = asyncio.get_running_loop().time()
        if not await self.admission_pool.wait_idle(timeout_s):  # requests in admission steps
            return False
        left = timeout_s - (asyncio.get_running_loop().time() - started)
        return await self.manager.wait_idle(max(0.0, left))

    async def close(self, drain_timeout_s: float) -> None:
        """Drain every version (up to ``drain_timeout_s`` seconds) and unload."""
        await self.manager.close(drain_timeout_s)
        self.repository.close()  # the folders of models loaded from a request's files

    def release(self) -> None:
        """Release what the metrics hold (NVML) and the client shared-memory regions."""
        self.extensions.close()
        self.admission_pool.close()
        if self.metrics is not None:
            self.metrics.close()
