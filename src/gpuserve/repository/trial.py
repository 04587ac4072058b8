"""A trial load of one model version, for ``gpuserve models validate``.

Reading a config and finding the model file says nothing of the code in it: a ``model.py``
with a SyntaxError, a ``Model`` whose constructor needs arguments, or a ``forward`` that
returns ``OUT`` where the config declares ``OUTPUT0`` all pass those checks, and the server
would find them only at load, or at the first request (a 500). :func:`trial_problems` loads
the version as the server does (one instance, on the CPU: the backend's load, its warm-up and
the config's ``model_warmup`` samples), and, when the config declares no warm-up sample, runs
one request of zeros (one row; variable dimensions 1; BYTES as empty strings) through the
instance's real stages and output checks. Each failure is one problem naming the version
folder and the cause.

Left out, with no problem reported: ensembles (their steps are models of their own),
sequence models (their control inputs and state need a sequence), ``huggingface`` models
(the weights are large and the backend's own code is what would run), and models whose
inputs the model file declares (filled in by ``complete_config``, checked already).
"""

from __future__ import annotations

import logging
from pathlib import Path

from gpuserve.backends import create_backend
from gpuserve.backends.base import LoadContext
from gpuserve.config import ModelConfig
from gpuserve.config.warmup import WarmupInput, WarmupSample
from gpuserve.engine.instance import Instance
from gpuserve.errors import GpuserveError

logger = logging.getLogger(__name__)

#: The name of the one request of zeros, as the instance's warm-up names it in its errors.
TRIAL_SAMPLE = "validate: one request of zeros"
#: Longest a trial load may take, seconds (a model that downloads or compiles at load).
LOAD_TIMEOUT_S = 300.0


def trial_skipped(config: ModelConfig) -> str | None:
    """Why ``config``'s model is not tried, or None when it is."""
    if config.backend in ("ensemble", "huggingface"):
        return f"backend '{config.backend}'"
    if config.sequence_batching is not None:
        return "a sequence model"
    if not config.inputs or not config.outputs:
        return "tensors declared by the model file"
    return None


def zero_request(config: ModelConfig) -> WarmupSample:
    """One request of zeros for every required input of ``config`` (variable dims 1)."""
    inputs = {
        spec.name: WarmupInput(
            data_type=spec.datatype,
            dims=[1 if dim == -1 else dim for dim in spec.shape],
            zero_data=True,
        )
        for spec in config.inputs
        if not spec.optional
    }
    return WarmupSample(name=TRIAL_SAMPLE, batch_size=1, inputs=inputs)


def trial_problems(config: ModelConfig, version_path: Path, version: int) -> list[str]:
    """Load version ``version`` of ``config`` on the CPU and run its warm-up, or one request
    of zeros; the problems found (empty when it loads and answers as declared).

    Args:
        config: The version's configuration, completed from its model file.
        version_path: The version folder.
        version: The version number.
    """
    if trial_skipped(config) is not None:
        return []
    tried = config
    if not config.model_warmup:
        tried = config.model_copy(update={"model_warmup": [zero_request(config)]})
    context = LoadContext(
        config=tried,
        version_path=version_path,
        version=version,
        device="cpu",
        parameters=dict(tried.parameters),
    )
    instance = Instance(
        f"{config.name}:{version}#validate",
        create_backend(config.backend),
        context,
        lambda _result: None,
        pipeline_depth=1,
    )
    quiet = logging.getLogger("gpuserve.engine.instance")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # the problem line says it; no second copy in the log
    try:
        instance.start(LOAD_TIMEOUT_S)
    except GpuserveError as err:
        return [f"{version_path}: {_cause(err.message, config.name or '')}"]
    except Exception as err:
        return [f"{version_path}: cannot be loaded: {type(err).__name__}: {err}"]
    finally:
        quiet.setLevel(level)
    instance.stop()
    return []


def _cause(message: str, model: str) -> str:
    """The trial's failure without the warm-up's framing of it."""
    marker = f"failed to run warmup sample model_warmup[0] ({TRIAL_SAMPLE!r}): "
    if marker in message:
        cause = message.split(marker, 1)[1].removeprefix(f"model '{model}' failed: ")
        return f"one request of zeros failed: {cause}"
    return message
