"""The load-time accuracy gate of the built-in text embedding model.

A version at a precision other than fp32 embeds its reference texts twice, at its precision
and with an fp32 copy of the same weights on the same device, and fails to load past the
``precision_check`` bounds (see :mod:`gpuserve.backends.precision_gate`). Failing the load
(rather than serving fp32 instead) is the choice: a version's config names its precision,
and a server that silently served another one would serve a speed nobody measured.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from gpuserve.backends import precision_gate
from gpuserve.backends.precision_gate import (
    AccuracyReport,
    compare,
    gate_problem,
)
from gpuserve.config.precision import PrecisionCheckConfig
from gpuserve.models.sentence_embedding import SentenceEmbedder

logger = logging.getLogger(__name__)


def reference_texts(bounds: PrecisionCheckConfig, version_path: Path) -> tuple[list[str], str]:
    """The gate's texts and where they came from (at least 2: a spread needs two).

    Raises:
        ValueError: ``reference_file`` unreadable or with fewer than 2 texts.
    """
    return precision_gate.reference_texts(bounds, version_path, minimum=2)


def embed_all(embedder: SentenceEmbedder, texts: list[str], batch: int = 32) -> np.ndarray:
    """float32 [N, H] embeddings of ``texts``, in batches of ``batch``."""
    parts = [embedder.encode(texts[i : i + batch]) for i in range(0, len(texts), batch)]
    return np.concatenate(parts).astype(np.float32)


def measure(
    candidate: SentenceEmbedder,
    reference: SentenceEmbedder,
    texts: list[str],
    precision: str,
    k: int,
) -> AccuracyReport:
    """``candidate`` (at ``precision``) against ``reference`` (fp32) on ``texts``."""
    return compare(precision, embed_all(candidate, texts), embed_all(reference, texts), k)


def check_precision(
    candidate: SentenceEmbedder,
    reference: SentenceEmbedder,
    precision: str,
    bounds: PrecisionCheckConfig,
    version_path: Path,
) -> AccuracyReport | None:
    """Run the gate: None when it is off; the measurement when it passes.

    Raises:
        ValueError: a bound is broken, naming each measured value and its bound.
    """
    if not bounds.enabled or precision == "fp32":
        return None
    texts, source = reference_texts(bounds, version_path)
    report = measure(candidate, reference, texts, precision, bounds.neighbours)
    problem = gate_problem(report, bounds)
    if problem is not None:
        raise ValueError(f"{problem} ({source}); raise the bounds in precision_check or use fp32")
    logger.info("precision_check passed (%s): %s", source, report.line())
    return report
