"""Execution options of the torch backend: precision, torch.compile, CUDA graphs, copies.

Every option has a CPU behaviour, so the same code runs (and is tested) without a GPU:

* **Precision** ``fp16``/``bf16`` casts weights and floating inputs; ``int8`` applies dynamic
  quantisation to ``nn.Linear`` layers (CPU only: PyTorch's dynamic quantised kernels are CPU
  kernels); outputs are cast back to the declared datatypes by the backend.
* **torch.compile** wraps the module (``optimization.compile``, ``compile_mode``); a failure to
  compile falls back to eager with the reason logged.
* **CUDA graphs** (``optimization.cuda_graphs``): one graph per batch-size bucket, captured at
  warm-up; a batch is padded up to the nearest bucket, the graph replayed, and the padding rows
  dropped. Needs a CUDA device and inputs whose non-batch dimensions are all fixed; otherwise
  the module runs eagerly and the reason is logged.
* **Copies**: on a CUDA device, inputs are staged in pinned host memory and copied on a side
  stream; the forward stream waits on an event, not on a global synchronisation.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from gpuserve.backends.cpu_features import require_cpu_precision
from gpuserve.config import ModelConfig
from gpuserve.datatypes import numpy_dtype

logger = logging.getLogger(__name__)

ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


def batch_buckets(max_batch_size: int, preferred: Sequence[int] = ()) -> list[int]:
    """Batch sizes to capture: powers of two up to ``max_batch_size``, the preferred sizes and
    ``max_batch_size`` itself, ascending. ``[1]`` for a model without batching."""
    if max_batch_size <= 0:
        return [1]
    sizes = {max_batch_size, *preferred}
    size = 1
    while size < max_batch_size:
        sizes.add(size)
        size *= 2
    return sorted(s for s in sizes if 0 < s <= max_batch_size)


def quantize_linear_int8(module: ModuleT) -> ModuleT:
    """Dynamic int8 quantisation of every ``nn.Linear``, with per-output-channel weight scales
    (per-tensor scales cost all-MiniLM-L6-v2 about 0.05 of cosine similarity; per-channel about
    0.02, see benchmarks/precision_accuracy.py). Activations are quantised per batch, at run
    time. CPU kernels only.

    Why this deprecated ``torch.ao.quantization`` path stays for the torch backend: it is the
    one int8 route torch offers for an arbitrary ``nn.Module`` with no export step (its
    successor, PT2E quantisation, needs a ``torch.export`` trace the module may not allow).
    The built-in text embedding model no longer uses it: its int8 runs on ONNX Runtime
    (:mod:`gpuserve.models.bert_onnx_int8`), accurate where this one is not.

    Returns:
        A quantised copy of ``module`` of the same class (``quantize_dynamic`` deep-copies the
        module and swaps its ``nn.Linear`` children, never the module itself).
    """
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    return quantize_dynamic(module, {torch.nn.Linear: per_channel_dynamic_qconfig})


def apply_precision(module: torch.nn.Module, precision: str, device: torch.device) -> Any:
    """Return ``module`` in the configured precision.

    Raises:
        ValueError: ``int8`` on a non-CPU device; ``bf16`` on a CPU without AVX-512 BF16 or
            AMX (:func:`~gpuserve.backends.cpu_features.require_cpu_precision`).
    """
    if device.type == "cpu":
        require_cpu_precision(precision)
    if precision == "int8":
        if device.type != "cpu":
            raise ValueError("precision int8 (dynamic quantisation) runs on CPU instances only")
        return quantize_linear_int8(module)
    if precision == "fp16":
        return module.to(torch.float16)
    if precision == "bf16":
        return module.to(torch.bfloat16)
    return module


def example_inputs(
    config: ModelConfig, batch: int, device: torch.device, float_dtype: torch.dtype
) -> list[torch.Tensor]:
    """Zero tensors shaped like a batch of ``batch`` rows (variable dims set to 1)."""
    tensors = []
    for spec in config.inputs:
        model_shape = spec.shape if spec.reshape is None else spec.reshape  # what it takes
        dims = [1 if d < 0 else d for d in model_shape]
        shape = [batch, *dims] if config.max_batch_size else dims
        tensor = torch.from_numpy(np.zeros(shape, numpy_dtype(spec.datatype)))
        if tensor.is_floating_point():
            tensor = tensor.to(float_dtype)
        tensors.append(tensor.to(device))
    return tensors


def maybe_compile(module: Any, mode: str, name: str, backend: str = "inductor") -> Any:
    """``torch.compile(module, mode=mode, backend=backend)``, or ``module`` when compilation
    is unavailable."""
    try:
        if backend != "inductor":
            return torch.compile(module, backend=backend, dynamic=None)
        return torch.compile(module, mode=None if mode == "default" else mode, dynamic=None)
    except Exception as err:  # the eager module still serves
        logger.warning("model %s: torch.compile unavailable (%s); running eagerly", name, err)
        return module


class CudaGraphRunner:
    """Replays one captured CUDA graph per batch-size bucket.

    Args:
        module: The module to capture (called positionally).
        config: Model config (fixed non-batch input shapes are required).
        device: A CUDA device.
        float_dtype: Dtype of floating-point inputs.
        buckets: Batch sizes to capture, ascending.
    """

    def __init__(
        self,
        module: Any,
        config: ModelConfig,
        device: torch.device,
        float_dtype: torch.dtype,
        buckets: list[int],
    ) -> None:
        self.module = module
        self.config = config
        self.device = device
        self.float_dtype = float_dtype
        self.buckets = buckets
        self.graphs: dict[int, tuple[Any, list[torch.Tensor], Any]] = {}

    @staticmethod
    def unsupported_reason(config: ModelConfig, device: torch.device) -> str | None:
        """Why graphs cannot be used for this model on this device, or None."""
        if device.type != "cuda":
            return f"CUDA graphs need a CUDA device (instance is on {device})"
        variable = [s.name for s in config.inputs if any(d < 0 for d in s.shape)]
        if variable:
            return f"inputs {variable} have variable dimensions; graphs need fixed shapes"
        return None

    def capture_all(self) -> None:
        """Capture every bucket (at load, so no request pays for it)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for bucket in self.buckets:
            static_in = example_inputs(self.config, bucket, self.device, self.float_dtype)
            with torch.cuda.stream(stream), torch.inference_mode():
                for _ in range(3):  # warm-up outside capture (cuBLAS handles, autotuning)
                    self.module(*static_in)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph), torch.inference_mode():
                static_out = self.module(*static_in)
            self.graphs[bucket] = (graph, static_in, static_out)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        rows = inputs[0].shape[0] if self.config.max_batch_size else 1
        bucket = next((b for b in self.buckets if b >= rows), None)
        if bucket is None:
            return self.module(*inputs)
        graph, static_in, static_out = self.graphs[bucket]
        for target, source in zip(static_in, inputs, strict=True):
            target[:rows].copy_(source, non_blocking=True)
        graph.replay()
        return _slice_rows(static_out, rows)


def _slice_rows(value: Any, rows: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value[:rows].clone()
    if isinstance(value, dict):
        return {k: _slice_rows(v, rows) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_slice_rows(v, rows) for v in value)
    return value


class HostToDevice:
    """Copies batch inputs to a CUDA device from pinned memory on a side stream.

    ``copy`` runs on the preprocess thread and returns device tensors plus an event;
    ``wait`` makes the forward stream wait for that event.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
        if self.stream is None:
            return [t.to(self.device) for t in tensors], None
        with torch.cuda.stream(self.stream):
            moved = [  # a tensor already on the device (an ensemble hand-off) stays as it is
                t if t.device == self.device else t.pin_memory().to(self.device, non_blocking=True)
                for t in tensors
            ]
            event = torch.cuda.Event()
            event.record(self.stream)
        return moved, event

    def wait(self, event: Any, tensors: list[torch.Tensor]) -> None:
        if event is None:
            return
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for tensor in tensors:  # keep the caching allocator from reusing them too early
            tensor.record_stream(current)


def device_memory(device: torch.device) -> dict[str, int]:
    """Allocated and reserved bytes on ``device`` (zeros on CPU)."""
    if device.type != "cuda":
        return {"allocated_bytes": 0, "reserved_bytes": 0}
    return {
        "allocated_bytes": int(torch.cuda.memory_allocated(device)),
        "reserved_bytes": int(torch.cuda.memory_reserved(device)),
    }
