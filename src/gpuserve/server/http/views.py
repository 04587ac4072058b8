"""JSON bodies of the service's read views, where a view's own field order is not the body.

Most views are dataclasses whose fields are the body (``orjson`` serialises them as they are:
metadata, index rows, model status); the ones here differ: model readiness carries the model
``name`` (KServe's schema) and leaves out an empty reason, the configuration is Triton's
``ModelConfig`` as JSON (the content gRPC's ``ModelConfig`` answers) or gpuserve's own
configuration plus the platform, and statistics are the statistics extension's
``model_stats`` list.
"""

from __future__ import annotations

from typing import Any

import orjson

from gpuserve.config.triton import triton_model_config_dict
from gpuserve.engine.stats import ModelStats
from gpuserve.service.views import ModelConfigView, ReadyView


def ready(view: ReadyView, name: str | None = None) -> bytes:
    """``{"ready": true}``, or ``{"ready": false, "reason": "..."}``; with ``name`` (a model's
    readiness) ``{"name": "m", "ready": ...}``."""
    body: dict[str, Any] = {} if name is None else {"name": name}
    body["ready"] = view.ready
    if not view.ready:
        body["reason"] = view.reason
    return orjson.dumps(body)


def model_config(view: ModelConfigView) -> bytes:
    """Triton's ``ModelConfig`` as JSON (``input``/``output``, ``data_type: TYPE_FP32``,
    ``dims``, ``instance_group[].kind: KIND_CPU``, ...): what gRPC's ``ModelConfig`` carries."""
    return orjson.dumps(triton_model_config_dict(view.name, view.platform, view.config))


def gpuserve_config(view: ModelConfigView) -> bytes:
    """The configuration as loaded (gpuserve's ``config.yaml`` fields) with ``platform``
    added."""
    config: dict[str, Any] = view.config.model_dump(mode="json")
    config["platform"] = view.platform
    return orjson.dumps(config)


def statistics(stats: list[ModelStats]) -> bytes:
    """The statistics extension's body: ``{"model_stats": [...]}``, one entry per version."""
    return orjson.dumps({"model_stats": [s.as_dict() for s in stats]})
