"""Loading, health and stopping of one model version (the manager decides when).

``load_version`` completes a version's config from its model file, starts its instances, picks
its runner (:func:`gpuserve.engine.runners.factory.build_runner`, with a respawn hook for the
watchdog) and marks it READY or failed; ``stop_version``
drains and unloads it; ``serving`` refuses a version whose instances are all being replaced.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

from gpuserve.backends import backend_for, complete_for_version
from gpuserve.backends.base import LoadContext
from gpuserve.backends.completion import require_declared
from gpuserve.engine.admission import AdmissionPool
from gpuserve.engine.batch import BatchResult
from gpuserve.engine.calls import InProcessCaller
from gpuserve.engine.instance import Instance, resolve_pipeline_depth
from gpuserve.engine.runners.ensemble import StepRouter
from gpuserve.engine.runners.factory import BatchRelay, build_runner
from gpuserve.errors import ModelNotReadyError
from gpuserve.repository.lifecycle.devices import instance_devices
from gpuserve.repository.state import ModelVersion, VersionState

logger = logging.getLogger(__name__)

# How often a draining version's in-flight count is checked, seconds.
_DRAIN_POLL_S = 0.005


async def load_version(
    mv: ModelVersion,
    listeners: list[Callable[[ModelVersion], None]],
    router: StepRouter | None = None,
    admission_pool: AdmissionPool | None = None,
    auto_complete: bool = True,
) -> None:
    """Complete the config, build and start every instance of ``mv``, pick its runner from
    the config and the instances' capabilities, then mark it READY; on failure stop what
    started and mark it failed with the reason (raises no Exception). ``router`` (the
    manager) lets its models call other models (``LoadContext.infer``). ``auto_complete``
    False (``--disable-auto-complete-config``): the config must declare its inputs and
    outputs; backends only check it against the model file."""
    loop = asyncio.get_running_loop()
    caller = InProcessCaller(router, loop, mv.model) if router is not None else None
    started = loop.time()
    instances: list[Instance] = []
    relay = BatchRelay()
    try:
        # The backend completes the config from this version's model file (or checks it
        # against it) before anything is built, so the runner, the protocol and the
        # config endpoints all see the completed config (a huggingface task read from
        # the folder, the sections checked against the tensors the model has).
        if not auto_complete:  # Triton's strict model config: nothing is filled in
            require_declared(mv.config, mv.path)
        complete = functools.partial(complete_for_version, auto_complete=auto_complete)
        mv.config = await loop.run_in_executor(None, complete, mv.config, mv.path)
        for index, device in enumerate(instance_devices(mv.config)):
            instances.append(
                await loop.run_in_executor(None, start_instance, mv, relay, index, device, caller)
            )

        async def respawn(dead: Instance) -> Instance:
            """Replacement for an instance the runner's watchdog found hung."""
            ctx = dead.context
            return await loop.run_in_executor(
                None, start_instance, mv, relay, ctx.instance_index, ctx.device, caller
            )

        runner = build_runner(
            mv.config,
            str(mv.version),
            instances,
            loop,
            relay,
            admission_pool=admission_pool,
            respawn=respawn,
        )
    except BaseException as err:
        for instance in instances:
            await loop.run_in_executor(None, instance.stop)
        mv.state = VersionState.FAILED
        mv.reason = f"failed to load: {type(err).__name__}: {err}"
        logger.error("model %s version %d %s", mv.model, mv.version, mv.reason)
        if not isinstance(err, Exception):
            raise
        return
    mv.runner = runner
    for listener in listeners:
        listener(mv)
    mv.state = VersionState.READY
    logger.info(
        "model %s version %d ready: %d instance(s) on %s (%s runner), loaded in %.2f s",
        mv.model,
        mv.version,
        len(instances),
        ", ".join(i.context.device for i in instances),
        runner.kind,
        loop.time() - started,
    )


def start_instance(
    mv: ModelVersion,
    on_done: Callable[[BatchResult], None],
    index: int,
    device: str,
    caller: InProcessCaller | None = None,
) -> Instance:
    """Build, load and warm up instance ``index`` of ``mv`` on ``device`` (blocking);
    ``on_done`` takes its batch results, ``caller`` lets the model call other models."""
    context = LoadContext(
        config=mv.config,
        version_path=mv.path,
        version=mv.version,
        device=device,
        instance_index=index,
        parameters=dict(mv.config.parameters),
        caller=caller,
    )
    instance = Instance(
        f"{mv.model}:{mv.version}#{index}",
        backend_for(mv.config)(),
        context,
        on_done,
        pipeline_depth=resolve_pipeline_depth(mv.config, device),
    )
    instance.start()
    return instance


async def stop_version(mv: ModelVersion, timeout_s: float) -> None:
    """Drain ``mv`` (its queued and running requests finish, up to ``timeout_s``), stop
    its instances (each backend's ``unload`` runs) and drop the references to them."""
    runner = mv.runner
    if runner is None:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    # The route no longer leads here; requests already admitted finish. Polling the
    # count (not closing at once) lets a request that looked the route up just before the
    # switch still be admitted.
    while runner.in_flight_requests > 0 and loop.time() < deadline:
        await asyncio.sleep(_DRAIN_POLL_S)
    await asyncio.sleep(_DRAIN_POLL_S)
    await runner.close(max(0.0, deadline - loop.time()))
    mv.runner = None
    logger.info("model %s version %d unloaded", mv.model, mv.version)


def serving(mv: ModelVersion) -> ModelVersion:
    """``mv``, unless its runner cannot take requests now: every instance of it is being
    replaced after a hang, or it is an ensemble one of whose steps is not served.

    Raises:
        ModelNotReadyError: it cannot take requests until that changes.
    """
    runner = mv.runner
    if runner is not None and not runner.healthy:
        raise ModelNotReadyError(
            f"model '{mv.model}' version {mv.version} is not ready: "
            + (runner.unhealthy_reason or "its instance is being restarted")
        )
    return mv
