"""One factory at load: a version's runner, picked from its config and its capabilities.

The repository's loader starts a version's instances (each reports its backend's
:class:`~gpuserve.backends.base.Capabilities` once, after load) and calls
:func:`build_runner`, which picks the runner once for the version's whole life:

* generative (the backend loaded a causal LM, ``generate:``): a
  :class:`~gpuserve.engine.runners.generate.GenerateRunner`, continuous batching over a paged
  KV cache;
* decoupled (``model_transaction_policy.decoupled``): a
  :class:`~gpuserve.engine.runners.streaming.StreamingRunner` (the batching runner's driver
  and core, each request answered through a stream); its backend must stream;
* otherwise: a :class:`~gpuserve.engine.runners.batching.BatchingRunner` whose batcher (dynamic,
  or sequence with ``sequence_batching``) is built complete for the capabilities (unpadded
  rows, row ids) and the device (the default token budget).

Ensembles have no instances: :func:`build_ensemble_runner`. A new execution mode (a response
cache) is one more runner chosen here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from gpuserve.backends.base import Capabilities
from gpuserve.backends.cpu_features import compute_threads, usable_cpus
from gpuserve.config import ModelConfig
from gpuserve.engine.admission import AdmissionPool
from gpuserve.engine.batch import BatchResult
from gpuserve.engine.instance import Instance
from gpuserve.engine.regather import shares_cpu_with_event_loop
from gpuserve.engine.runners.base import VersionRunner
from gpuserve.engine.runners.batching import BatchingRunner
from gpuserve.engine.runners.ensemble import EnsembleRunner, StepRouter
from gpuserve.engine.runners.generate import GenerateRunner
from gpuserve.engine.runners.streaming import StreamingRunner
from gpuserve.errors import ConfigError


class BatchRelay:
    """The ``on_done`` of a version's instances, built before its runner exists: forwards
    each :class:`BatchResult` (on an instance thread) to the runner once it is set."""

    def __init__(self) -> None:
        self.runner: BatchingRunner | None = None

    def __call__(self, result: BatchResult) -> None:
        runner = self.runner
        if runner is not None:
            runner.on_batch_done(result)


def build_runner(
    config: ModelConfig,
    version: str,
    instances: list[Instance],
    loop: asyncio.AbstractEventLoop,
    relay: BatchRelay,
    *,
    admission_pool: AdmissionPool | None = None,
    respawn: Callable[[Instance], Awaitable[Instance]] | None = None,
) -> VersionRunner:
    """The runner of a version whose ``instances`` are started (see the module docstring).

    Args:
        config: The version's (completed) configuration.
        version: Its version number as a string.
        instances: Its started instances (their ``on_done`` is ``relay``).
        loop: The server's event loop.
        relay: The instances' result relay; pointed at the runner here.
        admission_pool: Threads for admission steps of large requests.
        respawn: Replaces an instance the watchdog found hung (batching and streaming
            runners).

    Raises:
        ConfigError: the config asks for what the backend cannot do (a decoupled model
            whose backend does not stream).
    """
    capabilities = Capabilities.common([instance.capabilities for instance in instances])
    if capabilities.generation is not None:
        generating = GenerateRunner(config, version, capabilities, admission_pool)
        generating.attach(instances, loop)
        return generating
    if config.model_transaction_policy.decoupled and instances and not capabilities.streams:
        raise ConfigError(
            f"model '{config.name}': model_transaction_policy.decoupled is true, but "
            f"backend '{config.backend}' cannot stream responses (a python model needs "
            "generate(inputs), or Triton's TritonPythonModel with a response sender)"
        )
    on_gpu = any(instance.context.device.startswith("cuda") for instance in instances)
    if config.model_transaction_policy.decoupled:
        runner: BatchingRunner = StreamingRunner(
            config, version, capabilities, admission_pool, on_gpu=on_gpu
        )
    else:
        shared = bool(instances) and shares_cpu_with_event_loop(
            len(instances), on_gpu, compute_threads(), usable_cpus()
        )
        runner = BatchingRunner(
            config,
            version,
            capabilities,
            admission_pool,
            on_gpu=on_gpu,
            regather_beyond_delay=shared,
        )
    relay.runner = runner
    runner.attach(instances, loop, respawn)
    return runner


def build_ensemble_runner(
    config: ModelConfig, version: str, router: StepRouter, loop: asyncio.AbstractEventLoop
) -> EnsembleRunner:
    """The runner of an ensemble version (its steps reached through ``router``)."""
    runner = EnsembleRunner(config, version, router)
    runner.attach_loop(loop)
    return runner


__all__ = ["BatchRelay", "build_ensemble_runner", "build_runner"]
