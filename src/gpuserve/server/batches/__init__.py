"""The OpenAI Batch API with durable jobs.

* :mod:`~gpuserve.server.batches.api`: the ``/v1/files`` and ``/v1/batches`` endpoints;
* :mod:`~gpuserve.server.batches.jobs`: the runner (validate, run, cancel, expire, finalise,
  resume, storage sweep);
* :mod:`~gpuserve.server.batches.lines`: one line through the in-process services;
* :mod:`~gpuserve.server.batches.bulk`: :func:`~gpuserve.server.batches.bulk.mark_bulk`, where
  the bulk lane plugs in;
* :mod:`~gpuserve.server.batches.store`: the SQLite job store;
* :mod:`~gpuserve.server.batches.state`: the state directory and its paths;
* :mod:`~gpuserve.server.batches.wire`: input lines, output lines and OpenAI's objects.

:func:`batch_api` builds the whole of it for a server.
"""

from __future__ import annotations

from gpuserve.config import ServerConfig
from gpuserve.metrics import ServerMetrics
from gpuserve.metrics.batches import register_batch_storage
from gpuserve.server.batches.api import BatchApi
from gpuserve.server.batches.jobs import BatchJobs, BatchLimits
from gpuserve.server.batches.lines import LineRunner
from gpuserve.server.batches.state import StateDir, default_state_dir
from gpuserve.server.http.app import HttpApp


def batch_api(config: ServerConfig, app: HttpApp, metrics: ServerMetrics | None) -> BatchJobs:
    """Build the Batch API of a server and route ``/v1/files`` and ``/v1/batches`` to it.

    Args:
        config: The server's settings (``state_dir`` and the ``batch_*`` limits).
        app: The HTTP front end (its OpenAI API's services serve the lines).
        metrics: The server's metrics (the storage gauge joins them), or None.

    Returns:
        The runner: call :meth:`~BatchJobs.start` once the models are loaded,
        :meth:`~BatchJobs.begin_stop` on SIGTERM and :meth:`~BatchJobs.close` at shutdown.
    """
    root = config.state_dir or default_state_dir(config.model_repository)
    limits = BatchLimits(
        max_file_bytes=config.batch_max_file_bytes,
        max_lines=config.batch_max_lines,
        concurrent_lines=config.batch_concurrent_lines,
        file_ttl_s=config.batch_file_ttl_s,
        max_storage_bytes=config.batch_max_storage_bytes,
    )
    openai = app.openai
    lines = LineRunner(
        openai.embeddings, openai.generation.generation, app.retrieval, app.limits, app.redactor
    )
    jobs = BatchJobs(StateDir(root), limits, lines)
    openai.serve_batches(BatchApi(jobs, config.access_log, app.spawn))
    if metrics is not None:
        register_batch_storage(metrics.registry, lambda: jobs.storage_bytes)
    return jobs


__all__ = ["BatchApi", "BatchJobs", "BatchLimits", "batch_api"]
