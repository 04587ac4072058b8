"""Backend name ``ensemble``: a placeholder so repository checks can ask it for its config.

An ensemble has no instance: the model manager gives its versions an
:class:`~gpuserve.engine.runners.ensemble.EnsembleRunner`, which submits each step to the
step model's own scheduler. Only :meth:`Backend.complete_config` (inputs and outputs must be
declared) is ever used; building an instance of it is a bug and says so.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuserve.backends.base import Backend, LoadContext
from gpuserve.errors import ConfigError


class EnsembleBackend(Backend):
    """Refuses to run: ensembles are run by the engine, not on an instance."""

    def load(self, context: LoadContext) -> None:
        raise ConfigError(
            f"model '{context.config.name}' is an ensemble: its steps run on their own models"
        )

    def preprocess(self, inputs: dict[str, np.ndarray]) -> Any:  # pragma: no cover
        raise NotImplementedError

    def forward(self, prepared: Any) -> Any:  # pragma: no cover
        raise NotImplementedError

    def postprocess(self, raw: Any) -> dict[str, np.ndarray]:  # pragma: no cover
        raise NotImplementedError
