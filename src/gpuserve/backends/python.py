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

An optional **admission step** runs once per request, at admission, before batching, on the
server's pool of admission threads (``--admission-workers``), off the event loop::

        def admit(self, inputs):            # one request's inputs -> Admitted
            texts = inputs["TEXT"]          # e.g. cut long texts, count their tokens
            return Admitted(lengths=(...one per row...), inputs=None or {same names/shapes})

It returns :class:`~gpuserve.backends.base.Admitted`: each row's length (tokens for a text
model; the dynamic batcher groups requests by it and bounds a batch's tokens with it) and,
optionally, inputs to queue instead (same names, datatypes and shapes: texts truncated before
tokenisation, so one huge text costs no more than the model's limit). It runs on several
threads at once and beside the instance's stages, so it must be thread-safe and never touch
what ``preprocess`` uses (keep a copy of the tokenizer for it). Raising ``InvalidInputError``
fails that request alone with 400 (name the input); any other exception fails it with 500.
A model without ``admit`` is queued as soon as it is decoded, as before.

A **decoupled** model (``model_transaction_policy: {decoupled: true}``) defines a generator
instead of ``forward``::

        def generate(self, inputs):         # one request's inputs -> zero or more responses
            for token in ...:
                yield {"TOKEN": np.array([token])}

Each yielded dict is one response (output name -> array or torch tensor; the declared outputs,
or the ones it has). The stream's final mark follows the generator's end; an exception ends
the stream with that error. ``yield`` blocks while the client reads slowly (bounded buffer),
and when the client cancels or goes away the generator is closed (``GeneratorExit`` at the
``yield``; its ``finally`` runs).

A model may **complete its own configuration** (inputs, outputs, ``max_batch_size``, ...) once
per version at load, before the configuration is validated, so ``config.yaml`` may leave them
out (rules in :mod:`gpuserve.backends.completion`; ``--disable-auto-complete-config`` turns it
off)::

        @classmethod
        def complete_config(cls, config):   # ModelConfig -> ModelConfig
            return config.model_copy(update={"inputs": [...], "outputs": [...]})
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from gpuserve.backends.base import AdmissionStep, Backend, Capabilities, LoadContext, RowErrors
from gpuserve.backends.loader import import_module_from_path
from gpuserve.backends.streaming import ResponseSink, run_generator
from gpuserve.config import ModelConfig
from gpuserve.errors import ConfigError


class PythonModel:
    """Base class for user models of the ``python`` backend (hooks documented on the module).

    Attributes:
        context: The :class:`LoadContext` given at load (set before ``load`` is called).
    """

    context: LoadContext

    @classmethod
    def complete_config(cls, config: ModelConfig) -> ModelConfig:
        """Optional: complete the model's configuration once per version at load, before it
        is validated and before any instance exists (gpuserve's form of Triton's
        ``auto_complete_config``). Return ``config.model_copy(update={...})`` with
        ``max_batch_size``, more ``inputs``/``outputs`` (:class:`~gpuserve.config.TensorSpec`),
        ``dynamic_batching`` or ``model_transaction_policy`` set; declared tensors, a
        configured larger ``max_batch_size`` and every other field must stay as they are
        (:mod:`gpuserve.backends.completion`). Default: ``config`` unchanged.
        """
        return config

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

    def generate(self, inputs: dict[str, np.ndarray]) -> Iterator[dict[str, Any]]:
        """Decoupled models only: yield the responses of one request (see the module
        docstring). ``inputs``: name -> array of this request alone (batch dimension first
        when ``max_batch_size > 0``)."""
        raise NotImplementedError("Model.generate is not implemented (decoupled models)")

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
        self._admit_of: Any = None
        self._admit: AdmissionStep | None = None

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
        # a model that packs variable-length rows itself (no padding) says so
        self.unpadded_batches = bool(getattr(self.model, "unpadded_batches", False))

    def admission(self) -> AdmissionStep | None:
        """``Model.admit`` when the model defines one (looked up once per model object)."""
        model = self.model
        if model is not self._admit_of:
            hook = getattr(model, "admit", None)
            self._admit, self._admit_of = (hook if callable(hook) else None), model
        return self._admit

    def capabilities(self) -> Capabilities:
        """The user's ``Model`` hooks, read once at load: ``admit`` (admission step),
        ``generate`` (decoupled), ``count_tokens``, ``tokenize``, ``unpadded_batches``."""
        model = self.model
        count = getattr(model, "count_tokens", None)
        tokenize = getattr(model, "tokenize", None)
        return Capabilities(
            streams=callable(getattr(model, "generate", None)),
            unpadded=bool(getattr(model, "unpadded_batches", False)),
            admission=self.admission(),
            count_tokens=count if callable(count) else None,
            tokenize=tokenize if callable(tokenize) else None,
        )

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

    def stream(self, inputs: dict[str, np.ndarray], sink: ResponseSink) -> None:
        """Decoupled execution: ``Model.generate(inputs)`` into ``sink`` (see
        :mod:`gpuserve.backends.streaming`)."""
        generate = getattr(self.model, "generate", None)
        if generate is None:
            raise ConfigError("a decoupled python model needs a generate(inputs) method")
        run_generator(generate(inputs), sink)

    def unload(self) -> None:
        hook = getattr(self.model, "unload", None)
        if hook is not None:
            hook()
        self.model = None
