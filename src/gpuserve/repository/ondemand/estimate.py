"""What a model never loaded is expected to hold, from its own configuration and files.

Before a model's first load its footprint is unknown, and the memory limit must still make
room for it. The estimate comes from the model alone, never from another model (one large
model must not make every model never loaded look as large):

* its configured ``expected_memory_bytes`` per device it runs on, when set;
* else the size on disk of the version folders it would load (their weights), times its
  instances per device, halved when its declared ``precision`` is ``fp16``, ``bf16`` or
  ``int8`` (weights are assumed stored at fp32). A model that builds its weights in code
  (a ``model.py`` that allocates them) is estimated small; its measurement after the load
  corrects it, and what then no longer fits is evicted.

Pure: it reads the sizes recorded in a scan's fingerprints, no file.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from gpuserve.config import ModelConfig
from gpuserve.repository.ondemand.residency import HOST
from gpuserve.repository.scan import ModelEntry

#: How much of the on-disk size a declared precision keeps in memory.
PRECISION_FACTOR = {"fp32": 1.0, "fp16": 0.5, "bf16": 0.5, "int8": 0.5}


def devices(config: ModelConfig, gpus_visible: int) -> Counter[str]:
    """Instances per device key (``cpu``, ``cuda:<n>``) of ``config``'s ``instance_group``
    on a machine with ``gpus_visible`` GPUs (GPU ids it does not have are skipped)."""
    placed: Counter[str] = Counter()
    for group in config.instance_group:
        kind = group.kind
        if kind == "auto":
            kind = "gpu" if gpus_visible else "cpu"
        if kind == "cpu" or not gpus_visible:
            placed[HOST] += group.count
            continue
        for gpu in group.gpus or range(gpus_visible):
            if gpu < gpus_visible:
                placed[f"cuda:{gpu}"] += group.count
    return placed


def files_bytes(entry: ModelEntry, versions: Iterable[int] | None = None) -> int:
    """Bytes on disk of ``versions`` (default: those the version policy selects), from the
    scan's fingerprints."""
    chosen = entry.versions if versions is None else versions
    return sum(
        size
        for v in chosen
        if v in entry.folders
        for _path, size, _mtime in entry.folders[v].fingerprint
    )


def expected(entry: ModelEntry, gpus_visible: int = 0) -> dict[str, int]:
    """``entry``'s expected footprint by device, bytes (the module docstring's rule); empty
    without a valid configuration."""
    config = entry.config
    if config is None:
        return {}
    placed = devices(config, gpus_visible)
    if config.expected_memory_bytes is not None:
        return {d: config.expected_memory_bytes for d in placed}
    per_copy = files_bytes(entry) * PRECISION_FACTOR.get(config.precision, 1.0)
    return {d: int(per_copy * count) for d, count in placed.items()}
