"""Typed configuration: the server's settings and each model's ``config.yaml``.

Submodules (they import each other by these paths, never through this package):

* :mod:`~gpuserve.config.model`: :class:`ModelConfig` and its sections (tensors, batching,
  instances, version policy, canary, ONNX and Hugging Face options), :func:`load_model_config`
  and :func:`parse_model_config`;
* :mod:`~gpuserve.config.server`: :class:`ServerConfig`, the process-wide settings
  (``GPUSERVE_<FIELD>`` variables and ``gpuserve serve`` flags);
* :mod:`~gpuserve.config.base` (the strict pydantic base, dims checks),
  :mod:`~gpuserve.config.embedding`, :mod:`~gpuserve.config.ensemble`,
  :mod:`~gpuserve.config.keys` (unknown-key hints), :mod:`~gpuserve.config.padding`,
  :mod:`~gpuserve.config.reshape`, :mod:`~gpuserve.config.sequence` and
  :mod:`~gpuserve.config.warmup`: the sections and checks :mod:`~gpuserve.config.model` uses.

This package re-exports the names code imports from ``gpuserve.config``.
"""

from gpuserve.config.backend_sections import (
    HuggingFaceConfig,
    OnnxConfig,
    OnnxProvider,
    OptimizationConfig,
)
from gpuserve.config.batching import AdaptiveBatchingConfig, DynamicBatchingConfig
from gpuserve.config.embedding import EmbeddingConfig, embedding_problem
from gpuserve.config.model import (
    CONFIG_FILENAME,
    CanaryConfig,
    InstanceGroup,
    LatestPolicy,
    ModelConfig,
    SpecificPolicy,
    TensorSpec,
    TransactionPolicyConfig,
    VersionPolicy,
    load_model_config,
    parse_model_config,
)
from gpuserve.config.server import ServerConfig, default_model_repository

__all__ = [
    "CONFIG_FILENAME",
    "AdaptiveBatchingConfig",
    "CanaryConfig",
    "DynamicBatchingConfig",
    "EmbeddingConfig",
    "HuggingFaceConfig",
    "InstanceGroup",
    "LatestPolicy",
    "ModelConfig",
    "OnnxConfig",
    "OnnxProvider",
    "OptimizationConfig",
    "ServerConfig",
    "SpecificPolicy",
    "TensorSpec",
    "TransactionPolicyConfig",
    "VersionPolicy",
    "default_model_repository",
    "embedding_problem",
    "load_model_config",
    "parse_model_config",
]
