"""Which models serve embeddings, and how their token counts are obtained.

:func:`embedding_spec` resolves a served configuration's opt-in (its ``embedding:`` section,
:class:`~gpuserve.config.EmbeddingConfig`, or the automatic case of the ``huggingface``
backend's ``feature-extraction`` task) into an :class:`EmbeddingSpec`: the tensors that carry
the text (or token ids) and the embedding, the widths it may be cut to, and where token counts
come from. :func:`model_counter` gives a version's ``count_tokens(texts) -> list[int]`` (as its
backend declared it at load) and :func:`count_pool` is the small
thread pool long calls are counted on (see :mod:`gpuserve.service.apis.embeddings`).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

from gpuserve.backends.base import TokenCounter as _TokenCounter
from gpuserve.backends.huggingface import FEATURE_EXTRACTION, TEXT_INPUT
from gpuserve.config import EmbeddingConfig, ModelConfig, embedding_problem
from gpuserve.engine.runners.base import VersionRunner
from gpuserve.errors import ConfigError, InvalidInputError

#: Threads of the token-count pool (shared by every model of the process).
COUNT_WORKERS = max(1, min(4, os.cpu_count() or 1))

#: Tokens per text, after the model's truncation (special tokens included).
TokenCounter = _TokenCounter


class EmbeddingInputError(InvalidInputError):
    """A 400 of the embeddings API that names the request field at fault.

    Attributes:
        param: The field (``input``, ``model``, ``dimensions``, ``encoding_format``,
            ``user``), or None for the body as a whole.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class EmbeddingSpec:
    """How one served configuration serves embeddings (resolved :class:`EmbeddingConfig`).

    Attributes:
        text_input: BYTES input taking one text per row, or None (token ids only).
        token_ids_input: INT64/INT32 ``[-1]`` input taking token ids, or None.
        output: Output holding one embedding per row.
        width: Values per embedding, or None when the output's width is variable.
        dimensions: Widths a request may cut the embedding to (empty: none).
        normalize_truncated: L2-normalise a cut embedding.
        token_counts: ``model`` (the model's ``count_tokens``) or ``none``.
    """

    text_input: str | None
    token_ids_input: str | None
    output: str
    width: int | None
    dimensions: tuple[int, ...]
    normalize_truncated: bool
    token_counts: Literal["model", "none"]

    def check_dimensions(self, model: str, dimensions: int | None) -> None:
        """Refuse a ``dimensions`` the model does not allow.

        Raises:
            EmbeddingInputError: the model declares no ``embedding.dimensions``, or
                ``dimensions`` is neither one of them nor the full width.
        """
        if dimensions is None or (dimensions == self.width and self.dimensions):
            return
        if not self.dimensions:
            raise EmbeddingInputError(
                f"model '{model}' does not support 'dimensions': its embeddings cannot be "
                "truncated (a Matryoshka model declares embedding.dimensions in its config)",
                "dimensions",
            )
        if dimensions not in self.dimensions:
            allowed = sorted({*self.dimensions, *([self.width] if self.width else [])})
            raise EmbeddingInputError(
                f"model '{model}' supports dimensions {allowed}, got {dimensions}", "dimensions"
            )


_SPECS: dict[int, tuple[ModelConfig, EmbeddingSpec | None]] = {}


def embedding_spec(config: ModelConfig) -> EmbeddingSpec | None:
    """How ``config`` serves embeddings, or None when it does not (see the module docstring).

    Resolved once per configuration object (configurations are immutable).

    Raises:
        ConfigError: the declaration does not fit the tensors the version is served with.
    """
    hit = _SPECS.get(id(config))
    if hit is not None and hit[0] is config:
        return hit[1]
    spec = _resolve(config)
    if len(_SPECS) >= 256:  # old configurations of reloaded versions: start afresh
        _SPECS.clear()
    _SPECS[id(config)] = (config, spec)
    return spec


def _resolve(config: ModelConfig) -> EmbeddingSpec | None:
    declared = config.embedding
    if declared is None:
        # A task left unset is read from the folder at load: until then (a model not
        # loaded yet) it may well be feature extraction, the common case; loaded, it is set.
        if config.backend != "huggingface" or config.huggingface.task not in (
            None,
            FEATURE_EXTRACTION,
        ):
            return None
        text = config.inputs[0].name if config.inputs else TEXT_INPUT
        declared = EmbeddingConfig(text_input=text, output="EMBEDDING")
    elif not declared.enabled:
        return None
    problem = embedding_problem(config, declared)
    if problem is not None:
        raise ConfigError(f"model '{config.name}': {problem}")
    out = next((t for t in config.outputs if t.name == declared.output), None)
    width = out.shape[0] if out is not None and out.shape[0] > 0 else None
    return EmbeddingSpec(
        text_input=declared.text_input,
        token_ids_input=declared.token_ids_input,
        output=declared.output,
        width=width,
        dimensions=tuple(declared.dimensions),
        normalize_truncated=declared.normalize_truncated,
        token_counts=declared.token_counts,
    )


def model_counter(runner: VersionRunner) -> TokenCounter | None:
    """The ``count_tokens`` a version's backend declared at load
    (``Capabilities.count_tokens``: a text backend's, or a ``python`` model's own), or None."""
    return runner.capabilities.count_tokens


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def count_pool() -> ThreadPoolExecutor:
    """The process's token-count threads (:data:`COUNT_WORKERS`), started on first use."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(COUNT_WORKERS, thread_name_prefix="gpuserve-tokens")
        return _pool
