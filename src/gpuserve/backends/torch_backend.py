"""The ``torch`` backend: a ``torch.export`` program, a TorchScript archive, or an ``nn.Module``.

Version folder contents, looked up in this order:

* ``model.pt2`` - a ``torch.export`` program (``torch.export.save``), loaded with
  ``torch.export.load(...).module()`` after moving it to the instance's device. Export it in
  eval mode, with a ``torch.export.Dim`` for the batch dimension of every input (its ``max``,
  when given, bounds ``max_batch_size``). Its inputs and outputs are read from the program,
  so ``config.yaml`` may omit them (see :meth:`TorchBackend.complete_config`).
* ``model.pt`` - a TorchScript archive (``torch.jit.save``), loaded with ``torch.jit.load``.
* ``model.py`` - defines ``create_model(context) -> nn.Module`` or a class ``Model``
  (an ``nn.Module`` constructed with no arguments). If ``weights.pt`` or ``model.safetensors``
  sits beside it, it is loaded as the module's state dict (strict).

The module is called as ``module(*inputs)`` with one tensor per declared input, in config
order, already on the instance's device. It returns a tensor (one output), a tuple/list (in
config output order) or a dict keyed by output name.

Precision: floating-point inputs and the module's weights are cast to the configured dtype
(fp16/bf16); outputs are cast back to each output's declared datatype at the boundary, so
clients keep the datatypes the config declares.

Versions load in parallel; their ``torch.compile`` warm-ups and CUDA graph captures take
turns (:data:`CAPTURE_LOCK`).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpuserve.backends import tensors as _tensors
from gpuserve.backends.base import Backend, LoadContext
from gpuserve.backends.loader import import_module_from_path
from gpuserve.backends.optional import library_lock
from gpuserve.backends.signature import ModelSignature, ModelTensor, complete_config
from gpuserve.backends.torch_exec import (
    CudaGraphRunner,
    HostToDevice,
    apply_precision,
    batch_buckets,
    device_memory,
    example_inputs,
    maybe_compile,
)
from gpuserve.config import CONFIG_FILENAME, ModelConfig
from gpuserve.datatypes import numpy_dtype
from gpuserve.errors import ConfigError

logger = logging.getLogger(__name__)

EXPORTED_FILENAME = "model.pt2"
#: ``torch.compile`` warm-ups and CUDA graph captures of versions loading at the same time
#: run one at a time (BC-35): dynamo's compilation state is process-wide and not made for
#: concurrent compiles, and two captures never overlap (a failed capture falls back to eager,
#: with the reason logged).
CAPTURE_LOCK = "torch-capture"

# torch.export.load keeps its deserializer in a global: loads on two threads at once (models
# load in parallel) fail with "_CURRENT_DESERIALIZER is already set".
_EXPORT_LOAD_LOCK = threading.Lock()

#: torch dtypes -> V2 datatypes (bfloat16 and complex types have none).
TORCH_DATATYPES = {
    torch.bool: "BOOL",
    torch.uint8: "UINT8",
    torch.uint16: "UINT16",
    torch.uint32: "UINT32",
    torch.uint64: "UINT64",
    torch.int8: "INT8",
    torch.int16: "INT16",
    torch.int32: "INT32",
    torch.int64: "INT64",
    torch.float16: "FP16",
    torch.float32: "FP32",
    torch.float64: "FP64",
}


class TorchBackend(Backend):
    """Runs a PyTorch module on one device.

    It takes ``torch.Tensor`` inputs beside numpy arrays and gives its outputs as tensors on
    its device (:meth:`postprocess_tensors`), so an ensemble hands tensors between two torch
    steps on one device without a host round trip.
    """

    takes_tensors = True
    gives_tensors = True

    def __init__(self) -> None:
        self.module: Any = None
        self.runner: Any = None  # what forward calls: the module, compiled, or graph replays
        self.graphs: CudaGraphRunner | None = None
        self.config: ModelConfig | None = None
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.input_names: list[str] = []
        self.outputs: list[tuple[str, np.dtype]] = []
        self.h2d: HostToDevice | None = None
        self.memory: dict[str, int] = {}
        self._tensor_dtypes: dict[str, torch.dtype] = {}  # declared output dtypes, for torch

    @classmethod
    def complete_config(
        cls, config: ModelConfig, version_path: Path, *, auto_complete: bool = True
    ) -> ModelConfig:
        """Complete/check ``config`` from a ``model.pt2`` program; other formats must declare.

        A ``torch.export`` program is called positionally, so its inputs are matched to the
        declared ones by position (count, datatype, shape); outputs by name when the module
        returns a dict, else by position. Completed names are the ``forward`` argument names
        and the dict keys, or ``OUTPUT0``, ``OUTPUT1``, ... for a tensor or tuple result.
        """
        path = version_path / EXPORTED_FILENAME
        if not path.is_file():
            return super().complete_config(config, version_path)
        return complete_config(
            config, exported_signature(load_exported(path)), version_path.parent / CONFIG_FILENAME
        )

    def load(self, context: LoadContext) -> None:
        config = context.config
        self.device = torch.device(context.device)
        self._memory_before = device_memory(self.device)
        self.dtype = context.torch_dtype
        self.input_names = [spec.name for spec in config.inputs]
        self.outputs = [(spec.name, numpy_dtype(spec.datatype)) for spec in config.outputs]
        folder = context.version_path
        exported = folder / EXPORTED_FILENAME
        script = folder / "model.pt"
        source = folder / "model.py"
        if exported.is_file():
            program = load_exported(exported)
            if self.device.type != "cpu":
                from torch.export.passes import move_to_device_pass

                # Moves parameters and the device arguments recorded in the graph's ops.
                program = move_to_device_pass(program, self.device)
            module = program.module()
            # An exported module keeps the mode it was exported in (eval() is unsupported).
            self._finish_load(apply_precision(module, config.precision, self.device), context)
            return
        if script.is_file():
            module = torch.jit.load(str(script), map_location=self.device)
        elif source.is_file():
            module = self._module_from_source(context)
        else:
            raise ConfigError(
                f"{folder}: backend 'torch' needs {EXPORTED_FILENAME} (torch.export), "
                "model.pt (TorchScript) or model.py"
            )
        module = module.to(self.device)
        module.eval()
        self._finish_load(apply_precision(module, config.precision, self.device), context)

    def _finish_load(self, module: Any, context: LoadContext) -> None:
        config = context.config
        self.config = config
        self.module = self.runner = module
        self.h2d = HostToDevice(self.device)
        opt = config.optimization
        if opt.compile:
            self.runner = maybe_compile(
                module, opt.compile_mode, config.name or "", opt.compile_backend
            )
        if opt.cuda_graphs:
            reason = CudaGraphRunner.unsupported_reason(config, self.device)
            if reason is not None:
                logger.warning(
                    "model %s: cuda_graphs off: %s; running eagerly", config.name, reason
                )
            else:
                buckets = batch_buckets(
                    config.max_batch_size, config.dynamic_batching.preferred_batch_sizes
                )
                self.graphs = CudaGraphRunner(self.runner, config, self.device, self.dtype, buckets)

    def _module_from_source(self, context: LoadContext) -> torch.nn.Module:
        path = context.version_path / "model.py"
        mod = import_module_from_path(path, context.config.name or "model", context.version)
        factory = getattr(mod, "create_model", None)
        if factory is not None:
            module = factory(context)
        elif isinstance(getattr(mod, "Model", None), type):
            module = mod.Model()
        else:
            raise ConfigError(f"{path}: define create_model(context) or an nn.Module class Model")
        if not isinstance(module, torch.nn.Module):
            raise ConfigError(f"{path}: the model is a {type(module).__name__}, not an nn.Module")
        for name in ("weights.pt", "model.safetensors"):
            weights = context.version_path / name
            if weights.is_file():
                if name.endswith(".safetensors"):
                    from safetensors.torch import load_file

                    state = load_file(str(weights))
                else:
                    state = torch.load(str(weights), map_location="cpu", weights_only=True)
                module.load_state_dict(state, strict=True)
                break
        return module

    def warmup(self) -> None:
        """Capture CUDA graphs, or run every batch-size bucket once when compiling, so that the
        first request pays no capture or compile cost; then record device memory."""
        config = self.config
        assert config is not None
        if self.graphs is not None:
            try:
                with library_lock(CAPTURE_LOCK):
                    self.graphs.capture_all()
                self.runner = self.graphs
            except Exception as err:
                logger.warning(
                    "model %s: CUDA graph capture failed (%s); running eagerly", config.name, err
                )
                self.graphs = None
        elif config.optimization.compile:
            try:
                with library_lock(CAPTURE_LOCK), torch.inference_mode():
                    for bucket in batch_buckets(
                        config.max_batch_size, config.dynamic_batching.preferred_batch_sizes
                    ):
                        self.runner(*example_inputs(config, bucket, self.device, self.dtype))
            except Exception as err:
                logger.warning(
                    "model %s: torch.compile failed at warm-up (%s); running eagerly",
                    config.name,
                    err,
                )
                self.runner = self.module
        after = device_memory(self.device)
        before = getattr(self, "_memory_before", {})
        self.memory = {key: value - before.get(key, 0) for key, value in after.items()}
        budget_mib = config.optimization.gpu_memory_budget_mib
        used_mib = self.memory["allocated_bytes"] / 2**20
        if budget_mib and self.device.type == "cuda" and used_mib > budget_mib:
            raise ConfigError(
                f"model {config.name} on {self.device}: {used_mib:.0f} MiB allocated after load "
                f"and warm-up ({self.memory['reserved_bytes'] / 2**20:.0f} MiB reserved) exceeds "
                f"optimization.gpu_memory_budget_mib={budget_mib}"
            )
        if self.device.type == "cuda":
            logger.info(
                "model %s on %s: %.1f MiB allocated, %.1f MiB reserved",
                config.name,
                self.device,
                self.memory["allocated_bytes"] / 2**20,
                self.memory["reserved_bytes"] / 2**20,
            )

    def preprocess(self, inputs: dict[str, np.ndarray]) -> Any:
        tensors = []
        for name in self.input_names:
            array = inputs[name]
            if isinstance(array, torch.Tensor):  # handed on by an ensemble step
                tensor = array if array.device.type == "cpu" else array.to(self.device)
            else:
                if array.dtype == object:
                    raise ConfigError(f"input '{name}': BYTES inputs need the python backend")
                if not array.flags.writeable:
                    array = array.copy()  # torch.from_numpy needs a writable buffer
                tensor = torch.from_numpy(array)
            if tensor.is_floating_point() and tensor.dtype != self.dtype:
                tensor = tensor.to(self.dtype)
            tensors.append(tensor)
        assert self.h2d is not None
        return self.h2d.copy(tensors)

    def forward(self, prepared: Any) -> Any:
        tensors, event = prepared
        assert self.h2d is not None
        self.h2d.wait(event, tensors)
        with torch.inference_mode():
            return self.runner(*tensors)

    def _raw_items(self, raw: Any) -> list[tuple[str, Any]]:
        if isinstance(raw, torch.Tensor):
            raw = (raw,)
        if isinstance(raw, dict):
            return [(name, raw[name]) for name, _ in self.outputs if name in raw]
        return list(zip((n for n, _ in self.outputs), raw, strict=False))

    def postprocess_tensors(self, raw: Any) -> dict[str, Any]:
        """The outputs as tensors on the instance's device, in the declared datatypes (a
        CUDA graph's output buffers are copied: the next replay reuses them)."""
        dtypes = self._tensor_dtypes
        if not dtypes:
            for name, declared in self.outputs:
                dtypes[name] = torch.from_numpy(np.empty(0, declared)).dtype
        result: dict[str, Any] = {}
        for name, value in self._raw_items(raw):
            tensor = value.detach()
            dtype = dtypes[name]
            if tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            elif self.graphs is not None:
                tensor = tensor.clone()
            result[name] = tensor
        return result

    def postprocess(self, raw: Any) -> dict[str, np.ndarray]:
        result: dict[str, np.ndarray] = {}
        wanted = dict(self.outputs)
        for name, value in self._raw_items(raw):
            array = _tensors.to_host(value)  # the one device-to-host copy
            if array.dtype != wanted[name]:
                array = array.astype(wanted[name])
            result[name] = array
        return result

    def unload(self) -> None:
        self.module = self.runner = self.graphs = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def load_exported(path: Path) -> Any:
    """``torch.export.load(path)`` (an ``ExportedProgram``).

    Raises:
        ConfigError: the file is not a loadable ``torch.export`` program.
    """
    try:
        with _EXPORT_LOAD_LOCK:
            return torch.export.load(str(path))
    except Exception as err:  # torch raises assorted classes for bad archives
        raise ConfigError(
            f"{path}: not a torch.export program: {type(err).__name__}: {err}"
        ) from None


def exported_signature(program: Any, source: str = EXPORTED_FILENAME) -> ModelSignature:
    """The inputs and outputs of an ``ExportedProgram`` (flat tensor arguments only).

    Raises:
        ConfigError: an input or output is not a tensor (nested inputs, constants).
    """
    from torch.export.graph_signature import InputKind, OutputKind

    nodes = {node.name: node for node in program.graph.nodes}
    signature = program.graph_signature
    user_inputs = [
        spec.arg.name for spec in signature.input_specs if spec.kind == InputKind.USER_INPUT
    ]
    call = program.module_call_graph[0].signature if program.module_call_graph else None
    arg_names = list(getattr(call, "forward_arg_names", None) or [])
    if len(arg_names) != len(user_inputs):
        arg_names = user_inputs
    user_outputs = [
        getattr(spec.arg, "name", None)
        for spec in signature.output_specs
        if spec.kind == OutputKind.USER_OUTPUT
    ]
    out_spec = program.call_spec.out_spec
    by_name = out_spec is not None and out_spec.type is dict
    if by_name:
        out_names = [str(key) for key in out_spec.context]
    else:
        out_names = [f"OUTPUT{i}" for i in range(len(user_outputs))]

    def tensor(kind: str, node_name: str | None, name: str) -> ModelTensor:
        node = nodes.get(node_name) if node_name is not None else None
        value = node.meta.get("val") if node is not None else None
        if not isinstance(value, torch.Tensor):
            raise ConfigError(
                f"{source}: {kind} '{name}' is not a tensor ({type(value).__name__}); "
                "only flat tensor inputs and outputs can be served"
            )
        shape = tuple(d if isinstance(d, int) else None for d in value.shape)
        return ModelTensor(name, TORCH_DATATYPES.get(value.dtype, str(value.dtype)), shape)

    return ModelSignature(
        source=source,
        inputs=[tensor("input", n, name) for n, name in zip(user_inputs, arg_names, strict=True)],
        outputs=[
            tensor("output", n, name) for n, name in zip(user_outputs, out_names, strict=False)
        ],
        inputs_by_name=False,
        outputs_by_name=by_name,
        max_batch=_batch_limit(program, nodes, user_inputs),
    )


def _batch_limit(program: Any, nodes: dict[str, Any], user_inputs: list[str]) -> int | None:
    """The upper bound of the first input's dynamic first dimension, when finite."""
    if not user_inputs:
        return None
    value = nodes[user_inputs[0]].meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return None
    dim = value.shape[0]
    if isinstance(dim, int):
        return None
    bounds = program.range_constraints.get(dim.node.expr)
    upper = getattr(bounds, "upper", None)
    try:
        return int(upper) if upper is not None and upper.is_finite else None
    except (TypeError, AttributeError):
        return None
