"""The accuracy of a causal LM at a lower precision or weight format, against float32.

The served model (``precision`` bf16/fp16, or ``generate.weight_format`` int8/int4) and a
float32 copy of the same checkpoint read the same texts, teacher-forced (each position sees
the true text before it, so one early difference does not cascade). Two figures:

* **token agreement**: the share of positions where both models' greedy choice (argmax) is
  the same token: how often greedy decoding picks what float32 would, given the same prefix;
* **perplexity** of each model on the texts (the exponential of the mean negative
  log-likelihood of each next token), and their ratio.

:func:`gate_problem` holds a measurement against the ``precision_check`` bounds
``min_token_agreement`` and ``max_perplexity_ratio``; the load-time gate of generative models
(:mod:`gpuserve.backends.causal_lm.backend`) and ``benchmarks/generate_accuracy.py`` both use
:func:`measure`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from gpuserve.backends.causal_lm.model import CausalLM
from gpuserve.backends.causal_lm.step import ChunkInput, StepBatch
from gpuserve.config.precision import PrecisionCheckConfig

#: KV cache block size of the scoring passes (any size works; tokens per block).
_BLOCK = 16


@dataclass(frozen=True, slots=True)
class GenerationAccuracy:
    """A causal LM against its float32 reference on the same token sequences.

    Attributes:
        label: What was measured (``bf16``, ``bf16+int4``).
        texts: Sequences scored.
        positions: Next-token predictions compared (each sequence's length minus one).
        token_agreement: Share of positions whose argmax agrees with the reference's.
        perplexity: The model's perplexity on the sequences.
        reference_perplexity: The float32 reference's.
    """

    label: str
    texts: int
    positions: int
    token_agreement: float
    perplexity: float
    reference_perplexity: float

    @property
    def perplexity_ratio(self) -> float:
        """``perplexity / reference_perplexity`` (1.0: no loss)."""
        return self.perplexity / self.reference_perplexity

    def as_dict(self) -> dict[str, float | int | str]:
        """JSON-ready fields, the ratio included."""
        return {**dataclasses.asdict(self), "perplexity_ratio": self.perplexity_ratio}

    def line(self) -> str:
        """One human line: ``bf16+int8: token agreement 0.9812, perplexity 12.41 ...``."""
        return (
            f"{self.label}: token agreement {self.token_agreement:.4f}, perplexity "
            f"{self.perplexity:.3f} vs fp32 {self.reference_perplexity:.3f} (ratio "
            f"{self.perplexity_ratio:.4f}; {self.texts} texts, {self.positions} positions)"
        )


@dataclass(frozen=True, slots=True)
class Scores:
    """One model's predictions along one sequence of ``n`` tokens.

    Attributes:
        greedy: int64 ``[n - 1]``: the argmax token after each prefix.
        nll: float64 ``[n - 1]``: the negative log-likelihood of each true next token, nats.
    """

    greedy: torch.Tensor
    nll: torch.Tensor


@torch.inference_mode()
def score(model: CausalLM, token_ids: list[int]) -> Scores:
    """Run ``token_ids`` (at least 2) through ``model`` in one prefill and score every position.

    Allocates (replacing any earlier one) a KV cache just large enough: call
    ``allocate_cache`` again before serving.

    Raises:
        ValueError: fewer than 2 tokens.
    """
    if len(token_ids) < 2:
        raise ValueError(f"scoring needs at least 2 tokens, got {len(token_ids)}")
    blocks = -(-len(token_ids) // _BLOCK)
    model.allocate_cache(blocks, _BLOCK)
    batch = StepBatch.build(
        [ChunkInput(list(token_ids), 0, list(range(blocks)), True)], _BLOCK, model.device
    )
    rows = torch.arange(len(token_ids) - 1, device=model.device)
    logits = model.forward(dataclasses.replace(batch, logits_rows=rows))
    target = torch.tensor(token_ids[1:], dtype=torch.int64, device=logits.device)
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    nll = -logprobs.gather(1, target[:, None])[:, 0]
    return Scores(greedy=logits.argmax(dim=-1).cpu(), nll=nll.cpu())


def measure(
    label: str, candidate: list[Scores], reference: list[Scores]
) -> GenerationAccuracy:
    """Compare two models' :class:`Scores` of the same sequences (same order).

    Raises:
        ValueError: different numbers of sequences or lengths, or nothing to compare.
    """
    if len(candidate) != len(reference) or not candidate:
        raise ValueError(
            f"cannot compare scores of {len(candidate)} and {len(reference)} sequences"
        )
    agree = positions = 0
    nll_candidate = nll_reference = 0.0
    for mine, theirs in zip(candidate, reference, strict=True):
        if mine.greedy.shape != theirs.greedy.shape:
            raise ValueError("scores of sequences of different lengths cannot be compared")
        agree += int((mine.greedy == theirs.greedy).sum())
        positions += int(mine.greedy.numel())
        nll_candidate += float(mine.nll.sum())
        nll_reference += float(theirs.nll.sum())
    return GenerationAccuracy(
        label=label,
        texts=len(candidate),
        positions=positions,
        token_agreement=agree / positions,
        perplexity=math.exp(nll_candidate / positions),
        reference_perplexity=math.exp(nll_reference / positions),
    )


def gate_problem(report: GenerationAccuracy, bounds: PrecisionCheckConfig) -> str | None:
    """Which generation bounds of ``precision_check`` ``report`` breaks, in one sentence;
    None: it passes."""
    broken = []
    if report.token_agreement < bounds.min_token_agreement:
        broken.append(
            f"token agreement {report.token_agreement:.4f} < min_token_agreement "
            f"{bounds.min_token_agreement!r}"
        )
    if report.perplexity_ratio > bounds.max_perplexity_ratio:
        broken.append(
            f"perplexity ratio {report.perplexity_ratio:.4f} ({report.perplexity:.3f} vs "
            f"{report.reference_perplexity:.3f}) > max_perplexity_ratio "
            f"{bounds.max_perplexity_ratio!r}"
        )
    if not broken:
        return None
    return (
        f"{report.label} fails precision_check against fp32 on {report.texts} reference "
        f"texts ({report.positions} positions): {'; '.join(broken)}"
    )


def passages(token_lists: list[list[int]], length: int, count: int) -> list[list[int]]:
    """Consecutive texts' tokens joined and cut into up to ``count`` sequences of ``length``
    tokens (the last may be shorter but has at least 2)."""
    flat = [token for tokens in token_lists for token in tokens]
    cut = [flat[i : i + length] for i in range(0, len(flat), length)][:count]
    return [tokens for tokens in cut if len(tokens) >= 2]


__all__ = ["GenerationAccuracy", "Scores", "gate_problem", "measure", "passages", "score"]
