"""Loading an ensemble version: its steps first, then the checks, then its scheduler.

An ensemble needs its step models: :func:`load_ensemble` waits for each step model that is
loading (all models load in parallel at start), loads one that is not loaded in ``explicit``
mode (as Triton loads an ensemble's dependencies), and leaves one that loads on demand to the
first request that needs it. Then it checks the ensemble against the configurations its steps
are served with (:func:`~gpuserve.engine.ensemble.plan.step_problems`) and attaches an
:class:`~gpuserve.engine.runners.ensemble.EnsembleRunner`. Any problem marks the version
failed with a reason naming the file, the step, the field and the value.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpuserve.config import ModelConfig
from gpuserve.engine.ensemble.plan import step_problems
from gpuserve.engine.runners.factory import build_ensemble_runner
from gpuserve.errors import ConfigError, GpuserveError
from gpuserve.repository.state import Model, ModelVersion, VersionState

if TYPE_CHECKING:
    from gpuserve.repository.manager import ModelManager

logger = logging.getLogger(__name__)

# How often a step model that is loading is looked at, seconds.
_STEP_POLL_S = 0.02


async def load_ensemble(
    mv: ModelVersion, listeners: list[Callable[[ModelVersion], None]], manager: ModelManager
) -> None:
    """Load ensemble version ``mv`` (module docstring); marks it READY or failed (raises no
    Exception)."""
    loop = asyncio.get_running_loop()
    try:
        configs = await _step_configs(mv, manager)
        problems = step_problems(mv.config, configs)
        if problems:
            raise ConfigError(
                f"{_config_file(mv)}: the ensemble does not fit its steps: " + "; ".join(problems)
            )
        runner = build_ensemble_runner(mv.config, str(mv.version), manager, loop)
    except GpuserveError as err:
        mv.state = VersionState.FAILED
        mv.reason = f"failed to load: {err.message}"
        logger.error("model %s version %d %s", mv.model, mv.version, mv.reason)
        return
    mv.runner = runner
    for listener in listeners:
        listener(mv)
    mv.state = VersionState.READY
    steps = ", ".join(s.model for s in runner.plan.steps)
    logger.info("model %s version %d ready: ensemble of %s", mv.model, mv.version, steps)


def _config_file(mv: ModelVersion) -> str:
    return str(mv.path.parent / "config.yaml")


async def _step_configs(mv: ModelVersion, manager: ModelManager) -> dict[int, ModelConfig]:
    """Each step's served configuration (or, for a step that loads on demand, the one it will
    load with), once its model is loaded.

    Raises:
        ConfigError: a step model is not in the repository, failed to load, or did not load
            in time.
    """
    ensemble = mv.config.ensemble
    assert ensemble is not None
    configs: dict[int, ModelConfig] = {}
    for index, step in enumerate(ensemble.steps):
        where = f"{_config_file(mv)}: ensemble.steps[{index}].model_name"
        name = step.model_name
        if name == mv.model:
            raise ConfigError(f"{where}: {name!r} is the ensemble itself")
        model = manager.models.get(name)
        if model is None:
            known = sorted(n for n in manager.models if n != mv.model)
            raise ConfigError(
                f"{where}: {name!r} is not a model of the repository (models: {known})"
            )
        if manager.cold(name):  # loads at the first request that needs it
            config = model.source_config or model.config
            if config is None:
                raise ConfigError(f"{where}: model {name!r} cannot be loaded: {model.error}")
            configs[index] = config
            continue
        await _wait_for(model, manager, where)
        try:
            configs[index] = manager.version(name, step.version_label).config
        except GpuserveError as err:
            raise ConfigError(f"{where}: {err.message}") from None
    return configs


async def _wait_for(model: Model, manager: ModelManager, where: str) -> None:
    """Return once ``model`` serves a version; load it in ``explicit`` mode if nothing loads it.

    Raises:
        ConfigError: it failed to load, or serves nothing after the load timeout.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + manager.on_demand.timeout_s
    tried = False
    while model.route.default is None:
        loading = model.pending or any(
            v.state is VersionState.LOADING for v in model.versions.values()
        )
        if model.error and not loading:
            raise ConfigError(f"{where}: model {model.name!r} cannot be loaded: {model.error}")
        if not loading and model.notes and manager.initial_load_done:
            notes = "; ".join(f"version {v}: {n}" for v, n in sorted(model.notes.items()))
            raise ConfigError(f"{where}: model {model.name!r} serves no version ({notes})")
        if not loading and not tried and manager.control_mode == "explicit":
            tried = True
            try:
                await manager.load(model.name)
            except GpuserveError as err:
                raise ConfigError(f"{where}: loading model {model.name!r}: {err.message}") from None
            continue
        if loop.time() >= deadline:
            raise ConfigError(
                f"{where}: model {model.name!r} serves no version after "
                f"{manager.on_demand.timeout_s} s ({manager.model_status(model)})"
            )
        if not loading and model.failed:
            notes = "; ".join(f"version {v}: {n}" for v, n in sorted(model.notes.items()))
            raise ConfigError(f"{where}: model {model.name!r} failed to load ({notes})")
        await asyncio.sleep(_STEP_POLL_S)
