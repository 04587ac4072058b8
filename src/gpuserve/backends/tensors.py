"""Torch tensors next to numpy arrays in batch payloads: tell them apart, concatenate, move
to host.

Inside the server a tensor may travel as a ``torch.Tensor`` on the device that produced it:
an ensemble step whose backend gives tensors hands its output to a next step whose backend
takes tensors on the same device, without a host round trip (see
:mod:`gpuserve.engine.ensemble.handoff`). Everything else (clients, python and ONNX steps, the
ensemble's final outputs) gets numpy arrays, converted by :func:`to_host` in one place.

torch is imported only when a tensor is actually seen, so numpy-only paths never load it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np


def is_tensor(value: object) -> bool:
    """Whether ``value`` is a ``torch.Tensor`` (False for numpy arrays and anything else;
    never imports torch)."""
    if isinstance(value, np.ndarray):
        return False
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def to_host(value: Any) -> np.ndarray:
    """``value`` as a numpy array on the host: a tensor is detached and copied off its device
    (bfloat16 as float32); a numpy array is returned as it is.

    On a CPU tensor this is a view (no copy); on a CUDA tensor it is one device-to-host copy,
    which waits for the work that produces the tensor.
    """
    if not is_tensor(value):
        return np.asarray(value)
    tensor = value.detach()
    if str(tensor.dtype) == "torch.bfloat16":
        tensor = tensor.float()
    array: np.ndarray = tensor.cpu().numpy()
    return array


def concat(parts: Sequence[Any]) -> Any:
    """Concatenate ``parts`` (numpy arrays and tensors, batch dimension first) along axis 0.

    Returns:
        A numpy array when every part is one (``np.concatenate``); otherwise a tensor on the
        device of the first tensor part (``torch.cat``), numpy parts copied onto it.
    """
    device = next((p.device for p in parts if is_tensor(p)), None)
    if device is None:
        return np.concatenate(parts, axis=0)
    import torch

    tensors = [p if is_tensor(p) else _from_numpy(torch, p, device) for p in parts]
    tensors = [t if t.device == device else t.to(device) for t in tensors]
    return torch.cat(tensors, dim=0)


def _from_numpy(torch: Any, array: np.ndarray, device: Any) -> Any:
    if not array.flags.writeable:
        array = array.copy()  # torch.from_numpy needs a writable buffer
    return torch.from_numpy(array).to(device)


def device_of(value: Any) -> str:
    """Where ``value`` lives: ``"cpu"`` for numpy arrays, the torch device (``"cuda:0"``) of a
    tensor."""
    return str(value.device) if is_tensor(value) else "cpu"
