"""``precision_check``: the accuracy gate a lower precision passes at load.

A version whose ``precision`` is not ``fp32`` runs a reference set at its precision and at
fp32; past any bound below, the version fails to load, with an error naming the measured
value and the bound (see ``docs/precision.md``). Gated: the built-in text embedding model
(every precision, CPU and GPU), ``backend: onnx`` at ``int8`` and generative models at a
``precision`` other than fp32 or with a ``generate.weight_format`` (token agreement and
perplexity); other models ignore the section.
"""

from __future__ import annotations

from pydantic import Field

from gpuserve.config.base import Strict


class PrecisionCheckConfig(Strict):
    """Bounds of the load-time accuracy gate, measured against fp32 on the reference set.

    Attributes:
        enabled: Run the gate (default true). False loads a lower precision unchecked.
        min_cosine: Smallest accepted cosine similarity between one text's embedding at the
            configured precision and at fp32 (the worst text of the set counts).
        max_abs_error: Largest accepted absolute difference of any one output value
            (unit-norm embeddings: values in [-1, 1]).
        min_neighbour_recall: Smallest accepted mean recall@k of each text's k nearest
            neighbours within the set (cosine), at the precision against fp32.
        neighbours: The k of ``min_neighbour_recall``; capped at the set's size minus one.
        min_token_agreement: Generative models: smallest accepted share of next-token
            predictions (teacher-forced, over the reference texts) whose greedy choice is
            fp32's.
        max_perplexity_ratio: Generative models: largest accepted perplexity on the
            reference texts, as a multiple of fp32's.
        reference_file: In the version folder: for the text model and generative models a
            text file, one
            reference text a line; for ``backend: onnx`` an ``.npz`` file with one array per
            input (first axis: rows). None: the built-in sample of English sentences (text
            model) or 64 seeded random rows (onnx models with floating-point inputs).
    """

    enabled: bool = Field(
        default=True, description="Check a precision other than fp32 against fp32 at load."
    )
    min_cosine: float = Field(
        default=0.99,
        ge=-1.0,
        le=1.0,
        description="Smallest cosine similarity to fp32 accepted for any reference text.",
    )
    max_abs_error: float = Field(
        default=0.05,
        ge=0.0,
        description="Largest absolute difference to fp32 accepted for any output value.",
    )
    min_neighbour_recall: float = Field(
        default=0.9,
        ge=0.0,
        le=1.0,
        description="Smallest mean recall@k of nearest neighbours within the reference set.",
    )
    neighbours: int = Field(
        default=10, ge=1, le=1000, description="k of the neighbour recall (nearest neighbours)."
    )
    min_token_agreement: float = Field(
        default=0.9,
        ge=0.0,
        le=1.0,
        description="Generative models: smallest share of greedy next tokens equal to fp32's.",
    )
    max_perplexity_ratio: float = Field(
        default=1.05,
        ge=1.0,
        description="Generative models: largest perplexity on the reference texts over fp32's.",
    )
    reference_file: str | None = Field(
        default=None,
        description="Reference set relative to the version folder: texts one a line (text "
        "model, generative models) or an .npz of input arrays (backend onnx); None: the "
        "built-in sample.",
    )
