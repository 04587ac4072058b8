"""The ``python`` backend: a user class in the version folder's ``model.py``.

``model.py`` defines a class named ``Model``, usually a subclass of :class:`PythonModel`::

    class Model(PythonModel):
        def load(self, context):            # weights onto context.device
            ...
        def preprocess(self, inputs):       # CPU: dict[str, np.ndarray] -> anything
            ...
        def forward(self, batch):           # device: run the batch
            ...
        def postprocess(self, outputs):     # CPU: -> dict[str, np.ndarray], batch dim first
            ...

Only ``forward`` is required. The default ``preprocess`` passes the numpy inputs through; the
default ``postprocess`` accepts a dict of numpy arrays or torch tensors (moved to the CPU).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuserve.backends.base import Backend, LoadContext, RowErrors
from gpuserve.backends.loader import import_module_from_path
from gpuserve.errors import ConfigError


class PythonModel:
    """Base class for user models of the ``python`` backend (hooks documented on the module).

    Attributes:
        context: The :class:`LoadContext` given at load (set before ``load`` is called).
    """

    context: LoadContext

    def load(self, context: LoadContext) -> None:
        """Load weights; ``context.device`` names the device. Default: nothing."""

    def warmup(self) -> None:
        """Optional: run a small batch after load."""

    def preprocess(self, inputs: dict[str, np.ndarray]) -> Any:
        """CPU stage. ``inputs``: name -> array, batch dimension first. Default: unchanged."""
        return inputs

    def forward(self, batch: Any) -> Any:
        """Device stage; must be overridden."""
        raise NotImplementedError("Model.forward is not implemented")

    def postprocess(self, outputs: Any) -> dict[str, np.ndarray]:
        """CPU stage: name -> numpy array. Default: converts torch tensors to numpy."""
        return to_numpy_dict(outputs)

    def unload(self) -> None:
        """Release resources. Default: nothing."""


def to_numpy_dict(outputs: Any) -> dict[str, np.ndarray]:
    """Convert a mapping of numpy arrays / torch tensors / lists to numpy arrays.

    Raises:
        TypeError: ``outputs`` is not a mapping.
    """
    if not isinstance(outputs, dict):
        raise TypeError(f"postprocess must return a dict of outputs, got {type(outputs).__name__}")
    result: dict[str, np.ndarray] = {}
    for name, value in outputs.items():
        if isinstance(value, np.ndarray):
            result[name] = value
        elif hasattr(value, "detach"):  # torch.Tensor, without importing torch here
            result[name] = value.detach().cpu().numpy()
        else:
            result[name] = np.asarray(value)
    if isinstance(outputs, RowErrors):
        return RowErrors(result, outputs.errors)
    return result


class PythonBackend(Backend):
    """Runs the ``Model`` class of ``<version>/model.py``."""

    def __init__(self) -> None:
        self.model: Any = None

    def load(self, context: LoadContext) -> None:
        path = context.version_path / "model.py"
        if not path.is_file():
            raise ConfigError(f"{path}: backend 'python' needs a model.py defining class Model")
        module = import_module_from_path(path, context.config.name or "model", context.version)
        cls = getattr(module, "Model", None)
        if cls is None or not isinstance(cls, type):
            raise ConfigError(f"{path}: no class named 'Model' (backend 'python')")
        self.model = cls()
        self.model.context = context
        self.model.load(context)

    def warmup(self) -> None:
        hook = getattr(self.model, "warmup", None)
        if hook is not None:
            hook()

    def preprocess(self, inputs: dict[str, np.ndarray]) -> Any:
        hook = getattr(self.model, "preprocess", None)
        return inputs if hook is None else hook(inputs)

    def forward(self, prepared: Any) -> Any:
        return self.model.forward(prepared)

    def postprocess(self, raw: Any) -> dict[str, np.ndarray]:
        hook = getattr(self.model, "postprocess", None)
        return to_numpy_dict(raw if hook is None else hook(raw))

    def unload(self) -> None:
        hook = getattr(self.model, "unload", None)
        if hook is not None:
            hook()
        self.model = None
