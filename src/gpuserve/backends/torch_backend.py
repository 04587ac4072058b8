"""The ``torch`` backend: an ``nn.Module`` from ``model.py``, or a TorchScript ``model.pt``.

Version folder contents, looked up in this order:

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
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gpuserve.backends.base import Backend, LoadContext
from gpuserve.backends.loader import import_module_from_path
from gpuserve.datatypes import numpy_dtype
from gpuserve.errors import ConfigError


class TorchBackend(Backend):
    """Runs a PyTorch module on one device."""

    def __init__(self) -> None:
        self.module: Any = None
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.input_names: list[str] = []
        self.outputs: list[tuple[str, np.dtype]] = []

    def load(self, context: LoadContext) -> None:
        config = context.config
        self.device = torch.device(context.device)
        self.dtype = context.torch_dtype
        self.input_names = [spec.name for spec in config.inputs]
        self.outputs = [(spec.name, numpy_dtype(spec.datatype)) for spec in config.outputs]
        folder = context.version_path
        script = folder / "model.pt"
        source = folder / "model.py"
        if script.is_file():
            module = torch.jit.load(str(script), map_location=self.device)
        elif source.is_file():
            module = self._module_from_source(context)
        else:
            raise ConfigError(f"{folder}: backend 'torch' needs model.pt (TorchScript) or model.py")
        module = module.to(self.device)
        if self.dtype != torch.float32:
            module = module.to(self.dtype)
        module.eval()
        self.module = module

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
        """Nothing generic to run: shapes are unknown until the first request."""

    def preprocess(self, inputs: dict[str, np.ndarray]) -> list[torch.Tensor]:
        tensors = []
        for name in self.input_names:
            array = inputs[name]
            if array.dtype == object:
                raise ConfigError(f"input '{name}': BYTES inputs need the python backend")
            if not array.flags.writeable:
                array = array.copy()  # torch.from_numpy needs a writable buffer
            tensor = torch.from_numpy(array)
            if tensor.is_floating_point() and tensor.dtype != self.dtype:
                tensor = tensor.to(self.dtype)
            tensors.append(tensor.to(self.device, non_blocking=True))
        return tensors

    def forward(self, prepared: list[torch.Tensor]) -> Any:
        with torch.inference_mode():
            return self.module(*prepared)

    def postprocess(self, raw: Any) -> dict[str, np.ndarray]:
        if isinstance(raw, torch.Tensor):
            raw = (raw,)
        if isinstance(raw, dict):
            items = [(name, raw[name]) for name, _ in self.outputs if name in raw]
        else:
            items = list(zip((n for n, _ in self.outputs), raw, strict=False))
        result: dict[str, np.ndarray] = {}
        wanted = dict(self.outputs)
        for name, value in items:
            tensor = value.detach()
            if tensor.dtype == torch.bfloat16:
                tensor = tensor.float()
            array = tensor.cpu().numpy()
            if array.dtype != wanted[name]:
                array = array.astype(wanted[name])
            result[name] = array
        return result

    def unload(self) -> None:
        self.module = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
