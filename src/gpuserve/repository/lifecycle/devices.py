"""Placing instances on devices from a model's ``instance_group``."""

from __future__ import annotations

import gc
import sys

from gpuserve.config import ModelConfig


def cuda_device_count() -> int:
    """Visible CUDA devices (0 without torch or CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def instance_devices(config: ModelConfig, gpu_count: int | None = None) -> list[str]:
    """One torch device string per instance to create, e.g. ``["cuda:0", "cuda:1"]``.

    ``kind: auto`` means GPU when one is visible, else CPU; an empty ``gpus`` list means every
    visible GPU (so the default is one instance per GPU, or one CPU instance).

    Raises:
        ValueError: kind ``gpu`` without a visible GPU, or a GPU id that does not exist.
    """
    gpus_visible = cuda_device_count() if gpu_count is None else gpu_count
    devices: list[str] = []
    for group in config.instance_group:
        kind = group.kind
        if kind == "auto":
            kind = "gpu" if gpus_visible else "cpu"
        if kind == "cpu":
            devices.extend(["cpu"] * group.count)
            continue
        if not gpus_visible:
            raise ValueError("instance_group kind 'gpu' but no CUDA device is visible")
        ids = group.gpus or list(range(gpus_visible))
        for gpu in ids:
            if gpu >= gpus_visible:
                raise ValueError(
                    f"instance_group gpus: {gpu} does not exist ({gpus_visible} visible)"
                )
            devices.extend([f"cuda:{gpu}"] * group.count)
    return devices


def release_device_memory(*, frozen: bool = True) -> None:
    """Return freed device memory after a version unloaded: collect the garbage its objects
    left, then hand PyTorch's cached CUDA blocks back to the driver (when CUDA is in use).

    Args:
        frozen: Also collect objects kept out of the collector by
            :func:`freeze_loaded_objects` (a full walk of every object: ~0.1 s with torch
            imported, on the event loop). False for models loaded on demand and evicted:
            they were never frozen, so a collection of the unfrozen objects frees them.
    """
    if frozen:
        gc.unfreeze()
        gc.collect()
        gc.freeze()
    else:
        gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def freeze_loaded_objects() -> None:
    """Keep the objects alive now (imported modules, loaded models) out of the cyclic garbage
    collector's full collections (``gc.freeze``).

    A serving process builds hundreds of thousands of long-lived objects while it imports
    torch and loads models; every full collection walks all of them, which on a small CPU
    stalls the event loop for ~100 ms several times a minute under load and shows up directly
    in tail latency. After the load they never become garbage until a version unloads, and
    :func:`release_device_memory` unfreezes, collects and freezes again then.
    """
    gc.collect()
    gc.freeze()
