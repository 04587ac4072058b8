"""The arrays a loaded model holds, found by walking its objects: a floor under its measured
memory footprint that nothing else in the process can move.

The footprint of :mod:`.footprint` is a difference of process-wide samples, so memory that any
other thread frees while a model loads is taken off the model (a 40 MB model measured 0 in a
long test run). The arrays reachable from the model's backend objects (numpy arrays, PyTorch
tensors and modules' parameters and buffers, in attributes, lists, tuples, dicts and sets) are
what it certainly holds; :func:`held_bytes` sums them by device, each buffer once. Memory a
runtime keeps out of sight (an ONNX Runtime session, a tokenizer's Rust heap) is not found
here: the sampled difference still counts it.

The walk is bounded (:data:`MAX_OBJECTS` objects, :data:`MAX_DEPTH` levels): it runs once
per load, off the event loop.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import numpy as np

#: Most objects one walk visits (a model's attributes, its modules' dicts, containers).
MAX_OBJECTS = 200_000

#: Most levels below the roots.
MAX_DEPTH = 12

#: Types never walked into (their contents hold no model arrays).
_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), type)


def held_bytes(roots: Iterable[object], host: str = "cpu") -> dict[str, int]:
    """Bytes of the distinct arrays reachable from ``roots``, by device.

    Args:
        roots: The objects to walk (a version's backends).
        host: The key for host memory.

    Returns:
        ``{device: bytes}``: numpy arrays and CPU tensors under ``host``, CUDA tensors under
        ``cuda:<n>``; views count their base buffer once.
    """
    torch = sys.modules.get("torch")
    tensor_type = torch.Tensor if torch is not None else None
    seen_objects: set[int] = set()
    seen_buffers: set[tuple[str, int]] = set()
    totals: dict[str, int] = {}
    stack: list[tuple[Any, int]] = [(root, 0) for root in roots]
    while stack and len(seen_objects) < MAX_OBJECTS:
        obj, depth = stack.pop()
        if isinstance(obj, _LEAVES) or id(obj) in seen_objects:
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, np.ndarray):
            _add_array(obj, host, seen_buffers, totals)
            continue
        if tensor_type is not None and isinstance(obj, tensor_type):
            _add_tensor(obj, host, seen_buffers, totals)
            continue
        if depth >= MAX_DEPTH:
            continue
        for child in _children(obj):
            stack.append((child, depth + 1))
    return totals


def _add_array(array: np.ndarray, host: str, seen: set[tuple[str, int]], totals: dict) -> None:
    base = array
    while isinstance(base.base, np.ndarray):
        base = base.base
    if base.base is not None:  # a view of a foreign buffer (a mapped file, bytes): not held
        return
    key = (host, base.ctypes.data)
    if key in seen:
        return
    seen.add(key)
    totals[host] = totals.get(host, 0) + int(base.nbytes)


def _add_tensor(tensor: Any, host: str, seen: set[tuple[str, int]], totals: dict) -> None:
    try:
        storage = tensor.untyped_storage()
        size = int(storage.nbytes())
        pointer = int(storage.data_ptr())
    except (RuntimeError, NotImplementedError):  # meta, sparse or nested tensors
        return
    device = tensor.device
    key = host if device.type == "cpu" else f"{device.type}:{device.index or 0}"
    if (key, pointer) in seen or size == 0:
        return
    seen.add((key, pointer))
    totals[key] = totals.get(key, 0) + size


def _children(obj: Any) -> Iterable[Any]:
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, list | tuple | set | frozenset):
        return list(obj)
    children: list[Any] = []
    attributes = getattr(obj, "__dict__", None)
    if isinstance(attributes, dict):
        children.extend(attributes.values())
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            value = getattr(obj, name, None)
            if value is not None:
                children.append(value)
    return children
