"""The load-time accuracy gate of a generative model at a lower precision or weight format.

A version whose ``precision`` is not fp32, or that sets ``generate.weight_format``, scores
its reference texts (``precision_check.reference_file``, else the built-in reference
sentences) teacher-forced, once as served and once with a float32 copy of the same
checkpoint on the same device, and fails to load when the token agreement or the
perplexity ratio breaks its ``precision_check`` bound (:mod:`.accuracy`). Failing the load,
rather than serving fp32 instead, is the choice of every gate in gpuserve: a config that
names a format gets that format, measured, or an error.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from gpuserve.backends import precision_gate
from gpuserve.backends.causal_lm.accuracy import (
    GenerationAccuracy,
    gate_problem,
    measure,
    passages,
    score,
)
from gpuserve.backends.causal_lm.loader import LoadedCausalLM, load_causal_lm
from gpuserve.config.precision import PrecisionCheckConfig
from gpuserve.errors import ConfigError

logger = logging.getLogger(__name__)

#: Reference passages scored at load and their length, tokens.
GATE_PASSAGES = 4
GATE_TOKENS = 128


def reference_texts(bounds: PrecisionCheckConfig, version_path: Path) -> tuple[list[str], str]:
    """The gate's texts (one a line) and where they came from.

    Raises:
        ConfigError: ``reference_file`` unreadable or empty.
    """
    try:
        return precision_gate.reference_texts(bounds, version_path)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_generation(
    loaded: LoadedCausalLM,
    source: Path,
    label: str,
    bounds: PrecisionCheckConfig,
    version_path: Path,
    device: str,
) -> GenerationAccuracy | None:
    """Run the gate on ``loaded`` (served as ``label``, e.g. ``bf16+int4``) against a float32
    load of ``source``. None when ``precision_check.enabled`` is false.

    Leaves ``loaded.model`` with a small scoring cache: allocate the serving cache after.

    Raises:
        ConfigError: a bound is broken (naming each measured value and its bound), or the
            model has no tokenizer to read the texts with.
    """
    if not bounds.enabled:
        return None
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        raise ConfigError("precision_check of a generative model needs its tokenizer")
    texts, where = reference_texts(bounds, version_path)
    tokens = [list(tokenizer.encode(text + " ", add_special_tokens=False)) for text in texts]
    sequences = passages(tokens, GATE_TOKENS, GATE_PASSAGES)
    if not sequences:
        raise ConfigError(f"precision_check: the reference texts ({where}) hold under 2 tokens")
    candidate = [score(loaded.model, sequence) for sequence in sequences]
    reference_model = load_causal_lm(source, torch.float32, device, load_tokenizer=False).model
    reference = [score(reference_model, sequence) for sequence in sequences]
    del reference_model
    report = measure(label, candidate, reference)
    problem = gate_problem(report, bounds)
    if problem is not None:
        raise ConfigError(
            f"{problem} ({where}); raise the bounds in precision_check, or use another "
            "precision or generate.weight_format"
        )
    logger.info("precision_check passed (%s): %s", where, report.line())
    return report


__all__ = ["GATE_PASSAGES", "GATE_TOKENS", "check_generation", "reference_texts"]
