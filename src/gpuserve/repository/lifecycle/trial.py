"""A trial load of one model version, for ``gpuserve models validate``.

Reading a config and finding the model file says nothing of the code in it: a ``model.py``
with a SyntaxError, a ``Model`` whose constructor needs arguments, or a ``forward`` that
returns ``OUT`` where the config declares ``OUTPUT0`` all pass those checks, and the server
would find them only at load, or at the first request (a 500). :func:`trial_problems` loads
the version as the server does (one instance, on the CPU: the backend's load, its warm-up and
the config's ``model_warmup`` samples), and, when the config declares no warm-up sample, sends
it one request of zeros (one row; variable dimensions 1; BYTES as empty strings) through the
instance's real stages and output checks. Each failure is one problem naming the version
folder and the cause.

Left out, with no problem reported: ensembles (their steps are models of their own),
sequence models (their control inputs and state need a sequence), ``huggingface`` models
(the weights are large and the backend's own code is what would run). Loaded but sent no
request: decoupled models, models with a ``reshape`` and models that declare warm-up samples.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from gpuserve.backends import backend_for
from gpuserve.backends.base import LoadContext
from gpuserve.config import ModelConfig
from gpuserve.config.reshape import uses_reshape
from gpuserve.engine.batch import BatchResult
from gpuserve.engine.instance import Instance
from gpuserve.engine.warmup_samples import WarmupBatch, zero_tensor
from gpuserve.errors import GpuserveError

logger = logging.getLogger(__name__)

#: Longest a trial load, or the one request, may take, seconds (a model that compiles at load).
TIMEOUT_S = 300.0


def trial_skipped(config: ModelConfig) -> str | None:
    """Why ``config``'s model is not loaded for a trial, or None when it is."""
    if config.backend in ("ensemble", "huggingface"):
        return f"backend '{config.backend}'"
    if config.sequence_batching is not None:
        return "a sequence model"
    return None


def zero_request(config: ModelConfig) -> WarmupBatch | None:
    """One request of zeros for every required input of ``config`` (one row, variable dims
    1, BYTES empty), or None where the trial sends none: the config declares no tensors,
    declares warm-up samples of its own (they ran at load), reshapes an input, or the model
    is decoupled (its answers are a stream)."""
    if not config.inputs or not config.outputs or config.model_warmup:
        return None
    if config.model_transaction_policy.decoupled or any(uses_reshape(s) for s in config.inputs):
        return None
    batched = config.max_batch_size > 0
    row = {
        spec.name: zero_tensor(
            spec.datatype, ([1] if batched else []) + [1 if d == -1 else d for d in spec.shape]
        )
        for spec in config.inputs
        if not spec.optional
    }
    return WarmupBatch("one request of zeros", row, requests=1, runs=1, batched=batched)


def trial_problems(config: ModelConfig, version_path: Path, version: int) -> list[str]:
    """Load version ``version`` of ``config`` on the CPU (its load, warm-up and
    ``model_warmup`` samples) and send it one request of zeros; the problems found (empty when
    it loads and answers as declared).

    Args:
        config: The version's configuration, completed from its model file.
        version_path: The version folder.
        version: The version number.
    """
    if trial_skipped(config) is not None:
        return []
    done = threading.Event()
    results: list[BatchResult] = []

    def on_done(result: BatchResult) -> None:
        results.append(result)
        done.set()

    context = LoadContext(
        config=config,
        version_path=version_path,
        version=version,
        device="cpu",
        parameters=dict(config.parameters),
    )
    name = config.name or version_path.parent.name
    instance = Instance(f"{name}:{version}#validate", backend_for(config)(), context, on_done)
    quiet = logging.getLogger("gpuserve.engine.instance")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # the problem line says it; no second copy in the log
    try:
        try:
            instance.start(TIMEOUT_S)
        except GpuserveError as err:
            return [f"{version_path}: cannot be loaded: {err.message}"]
        except Exception as err:
            return [f"{version_path}: cannot be loaded: {type(err).__name__}: {err}"]
        request = zero_request(config)
        if request is None:
            instance.stop()
            return []
        instance.submit(request.batch(name))
        problem: str | None
        if not done.wait(TIMEOUT_S):
            problem = f"no answer within {TIMEOUT_S:.0f} s"
        else:
            result = results[0]
            error = result.error or next(
                (r for r in result.results if isinstance(r, GpuserveError)), None
            )
            problem = None if error is None else error.message
        instance.stop()
    finally:
        quiet.setLevel(level)
    if problem is None:
        return []
    return [f"{version_path}: one request of zeros failed: {problem}"]
