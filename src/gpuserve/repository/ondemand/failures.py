"""What the shared failure record says about a model that is not loaded (load on demand).

Reads of :class:`~gpuserve.repository.lifecycle.retry.RetryBackoff` (the one record polls, explicit
loads and loads on demand keep) against a model's folder and configuration as scanned now:
whether a failed load holds the next one back, the 503 of a load that just failed, and the
readiness of a model whose last load failed.
"""

from __future__ import annotations

from gpuserve.errors import GpuserveError, ModelNotReadyError
from gpuserve.repository.ondemand import demand
from gpuserve.repository.report import model_status
from gpuserve.repository.lifecycle.retry import Failure, RetryBackoff
from gpuserve.repository.scan import Fingerprint, ModelEntry, read_model
from gpuserve.repository.state import Model


def selected(entry: ModelEntry) -> dict[int, Fingerprint]:
    """The versions a load of ``entry`` would load, with their folders' content now."""
    return {v: entry.folders[v].fingerprint for v in entry.versions if v in entry.folders}


def holding(retry: RetryBackoff, entry: ModelEntry) -> Failure | None:
    """The failure whose back-off holds back a load of ``entry``'s model now (every version
    it would load failed with the folder content and the configuration it has now), or
    None."""
    config = entry.config
    if config is None or not retry.has_failures(entry.name):
        return None
    return retry.blocking(entry.name, selected(entry), config.model_dump_json)


def held_by_folders(retry: RetryBackoff, entry: ModelEntry) -> bool:
    """Whether the folders alone (a changed configuration not counted) are held back: then a
    load that goes ahead anyway must try the failed versions again (``retry_failed``)."""
    return entry.config is not None and retry.blocking(entry.name, selected(entry)) is not None


def failed_error(retry: RetryBackoff, model: Model, entry: ModelEntry) -> ModelNotReadyError:
    """The 503 of a load on demand that served nothing: the error and when the next attempt
    is due (the message the back-off answers later requests with)."""
    failure = retry.blocking(model.name, selected(entry))
    if failure is not None:
        wait_s = failure.retry_at - retry.clock()
        return ModelNotReadyError(demand.backoff_message(model.name, failure, wait_s), wait_s)
    return ModelNotReadyError(
        f"model '{model.name}' is not ready: {model.error or model_status(model)}"
    )


def ready_reason(retry: RetryBackoff, model: Model) -> str | None:
    """For a model that is not loaded and that a request would load: None when such a
    request would load it now, else why not (its back-off after a failed load, which a
    changed folder or configuration ends; an invalid configuration). Reads the model's
    folder only when it has a failure recorded (a few ``stat`` calls and its configuration
    file; blocking, but short)."""
    if model.source_config is None:
        return model.error or "no valid configuration"
    if model.path is None or not retry.has_failures(model.name):
        return None
    try:
        entry = read_model(model.path)
    except GpuserveError as err:
        return err.message
    failure = holding(retry, entry)
    if failure is None:
        return None
    return demand.backoff_message(model.name, failure, failure.retry_at - retry.clock())
