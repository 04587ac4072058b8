"""JSON bodies of the service's read views, where a view's own field order is not the body.

Most views are dataclasses whose fields are the body (``orjson`` serialises them as they are:
metadata, index rows, model status); the ones here differ: readiness leaves out an empty
reason, the configuration is gpuserve's own configuration plus the platform, and statistics
are the statistics extension's ``model_stats`` list.
"""

from __future__ import annotations

from typing import Any

import orjson

from gpuserve.engine.stats import ModelStats
from gpuserve.service.views import ModelConfigView, ReadyView


def ready(view: ReadyView) -> bytes:
    """``{"ready": true}``, or ``{"ready": false, "reason": "..."}``."""
    if view.ready:
        return b'{"ready":true}'
    return orjson.dumps({"ready": False, "reason": view.reason})


def model_config(view: ModelConfigView) -> bytes:
    """The configuration as loaded (gpuserve's fields) with ``platform`` added."""
    config: dict[str, Any] = view.config.model_dump(mode="json")
    config["platform"] = view.platform
    return orjson.dumps(config)


def statistics(stats: list[ModelStats]) -> bytes:
    """The statistics extension's body: ``{"model_stats": [...]}``, one entry per version."""
    return orjson.dumps({"model_stats": [s.as_dict() for s in stats]})
