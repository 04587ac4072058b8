"""Choosing the next token of every sequence of a decode step, in one batched call.

The engine calls one :class:`Sampler` per step with the step's last-position logits and one
:class:`SamplingRow` per sequence::

    tokens = sampler(logits, rows)      # logits: float32 [R, vocab], rows[i] <-> logits[i]

Per row, in this order (the order of Hugging Face's and vLLM's logits processors):

1. **Penalties** on the raw logits: ``repetition_penalty`` (Hugging Face: over the prompt and
   the output, positive logits divided, negative multiplied), then ``frequency_penalty`` (times
   the token's count in the output) and ``presence_penalty`` (once per token in the output),
   subtracted (OpenAI).
2. **min_tokens**: until the output has ``min_tokens`` tokens, EOS (unless ``ignore_eos``) and
   ``stop_token_ids`` get ``-inf``.
3. **Greedy** rows (``temperature`` below 1e-5, 0 in practice) take the argmax (ties: the
   lowest id). Other rows are divided by ``temperature``, then truncated: ``top_k`` (the k
   largest logits, ties at the k-th kept), ``top_p`` (the smallest most-likely set whose mass
   is at least ``top_p``; the most likely token always stays), ``min_p`` (tokens below
   ``min_p`` times the top probability dropped); then one token is drawn.

**Log-probabilities** (``logprobs`` / ``top_logprobs``) are the log-softmax of the logits
after steps 1-2 and the temperature (a greedy row: temperature 1), before the truncation of
step 3: the distribution the model's choice was made from, with the alternatives truncation
removed still visible (and finite). With no penalties and temperature 1 they are the model's
own log-softmax.

**Drawing**: one uniform number per row, from the row's own ``torch.Generator`` when it has
one, mapped through the row's cumulative distribution (inverse-CDF sampling). A seeded
request therefore draws the same tokens whatever else is in its batch, and each draw costs one
random number instead of ``torch.multinomial``'s pass over the vocabulary (measured on a CPU:
~1 ms per 49,152-token row for ``multinomial``, ~35 us for this). The draw is exact: a token
with probability 0 is never chosen.

**Cost**: a batch of greedy rows without penalties, min_tokens or logprobs is one argmax. The
penalties touch only the prompt's and output's tokens (gather/scatter, no [R, vocab] masks).
``top_p`` looks at the 1,024 most likely tokens of a row and sorts the whole row only when
those hold less than ``top_p`` of the mass (a flat distribution).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gpuserve.backends.causal_lm.params import SamplingParams

#: Temperatures below this are greedy (dividing by them overflows float32 logits).
GREEDY_TEMPERATURE = 1e-5

#: Candidates ``top_p`` looks at before sorting a whole row.
_TOP_P_CANDIDATES = 1024


@dataclass(slots=True)
class SamplingRow:
    """One sequence of a decode step.

    Attributes:
        params: The request's sampling parameters.
        prompt_ids: The prompt's token ids (the repetition penalty covers them).
        output_ids: The tokens generated so far, this step's excluded.
        generator: The sequence's own random generator, on the logits' device, seeded with
            ``params.seed`` (see :func:`make_generator`); None draws from torch's default
            generator.
    """

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    generator: torch.Generator | None = None


@dataclass(slots=True)
class SampledToken:
    """The token chosen for one row.

    Attributes:
        token_id: The chosen token.
        logprob: Its log-probability (see the module docstring for which distribution);
            None unless the row asked for ``logprobs`` or ``top_logprobs``.
        top_logprobs: ``(token_id, logprob)`` of the ``params.top_logprobs`` most likely
            tokens, best first; None when ``top_logprobs`` is 0.
    """

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def make_generator(
    params: SamplingParams, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    """The random generator of one sequence: seeded with ``params.seed``, or None (torch's
    default generator) when the request gave no seed."""
    if params.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


def _is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_TEMPERATURE


def _has_penalty(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


def _wants_logprobs(params: SamplingParams) -> bool:
    return params.logprobs or params.top_logprobs > 0


class Sampler:
    """Chooses one token per row of a step's logits (see the module docstring).

    Holds nothing between calls but its configuration, so one sampler serves every
    sequence of a model; two calls at once are safe as long as they share no row (a row's
    generator advances with each draw).
    """

    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        """
        Args:
            eos_token_ids: The model's end-of-sequence tokens, masked while a row has fewer
                than ``min_tokens`` output tokens (unless it sets ``ignore_eos``).
        """
        self.eos_token_ids = tuple(eos_token_ids)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        """Choose the next token of every row.

        Args:
            logits: float32 [R, vocab], the last position's logits of each sequence, on any
                device (each row's generator on the same one). Not modified.
            rows: R rows, ``rows[i]`` describing ``logits[i]``.

        Returns:
            R tokens, in the order of ``rows``.

        Raises:
            ValueError: ``logits`` is not [len(rows), vocab].
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [rows, vocab] with {len(rows)} rows, "
                f"got shape {tuple(logits.shape)}"
            )
        if not rows:
            return []
        masks = self._min_tokens_masks(rows, logits.shape[1])
        if not masks and all(
            _is_greedy(row.params)
            and not _has_penalty(row.params)
            and not _wants_logprobs(row.params)
            for row in rows
        ):
            return [SampledToken(token) for token in logits.argmax(dim=-1).tolist()]

        # Temperature 1 for greedy rows: their argmax does not depend on it, and their
        # logprobs are those of the model (after penalties).
        temperatures = [1.0 if _is_greedy(row.params) else row.params.temperature for row in rows]
        tempered = any(t != 1.0 for t in temperatures)
        scores = logits.float()
        if scores is logits and (masks or tempered or any(_has_penalty(r.params) for r in rows)):
            scores = scores.clone()  # the caller's logits stay as they were
        _apply_penalties(scores, rows)
        if masks:
            row_index, token_index = zip(*masks, strict=True)
            scores[list(row_index), list(token_index)] = -math.inf
        if tempered:
            scores.div_(torch.tensor(temperatures, device=scores.device).unsqueeze(1))

        chosen = torch.empty(len(rows), dtype=torch.long, device=scores.device)
        greedy = [i for i, row in enumerate(rows) if _is_greedy(row.params)]
        sampled = [i for i, row in enumerate(rows) if not _is_greedy(row.params)]
        if greedy:
            chosen[greedy] = scores[greedy].argmax(dim=-1)
        if sampled:
            chosen[sampled] = _draw(scores[sampled], [rows[i] for i in sampled])

        token_ids: list[int] = chosen.tolist()
        results = [SampledToken(token) for token in token_ids]
        wanted = [i for i, row in enumerate(rows) if _wants_logprobs(row.params)]
        if wanted:
            _fill_logprobs(
                results, scores[wanted], chosen[wanted], [rows[i] for i in wanted], wanted
            )
        return results

    def _min_tokens_masks(self, rows: list[SamplingRow], vocab: int) -> list[tuple[int, int]]:
        """(row, token) pairs to mask for rows still short of ``min_tokens``."""
        pairs: list[tuple[int, int]] = []
        for index, row in enumerate(rows):
            params = row.params
            if len(row.output_ids) >= params.min_tokens:
                continue
            banned = set(params.stop_token_ids)
            if not params.ignore_eos:
                banned.update(self.eos_token_ids)
            # a stop token id past the vocabulary cannot be sampled anyway
            pairs.extend((index, token) for token in sorted(banned) if 0 <= token < vocab)
        return pairs


def _unique_tokens(
    rows: list[SamplingRow],
    selected: list[int],
    with_prompt: bool,
    vocab: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct (row, token) pairs of the selected rows and each pair's count.

    Returns:
        row index int64 [P], token id int64 [P], count int64 [P].
    """
    # numpy turns a list of ints into an array ~6x faster than torch.tensor does (and takes
    # an array or a CPU tensor as it is)
    parts: list[np.ndarray] = []
    for index in selected:
        row = rows[index]
        if with_prompt:
            parts.append(np.asarray(row.prompt_ids, dtype=np.int64))
        parts.append(np.asarray(row.output_ids, dtype=np.int64))
    lengths = [
        (len(rows[index].prompt_ids) if with_prompt else 0) + len(rows[index].output_ids)
        for index in selected
    ]
    if not any(lengths):
        empty = torch.empty(0, dtype=torch.long, device=device)
        return empty, empty, empty
    tokens = torch.from_numpy(np.concatenate(parts)).to(device)
    owners = torch.repeat_interleave(
        torch.tensor(selected, dtype=torch.long, device=device),
        torch.tensor(lengths, dtype=torch.long, device=device),
    )
    # an id past the logits' width (a tokenizer's added token) has no logit to penalise
    valid = (tokens >= 0) & (tokens < vocab)
    keys = owners[valid] * vocab + tokens[valid]
    unique, counts = torch.unique(keys, return_counts=True)
    return unique // vocab, unique % vocab, counts


def _apply_penalties(scores: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Repetition, frequency and presence penalties, in place on float32 [R, vocab]."""
    vocab = scores.shape[1]
    device = scores.device
    repeated = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    if repeated:
        row_index, token_index, _ = _unique_tokens(rows, repeated, True, vocab, device)
        if row_index.numel():
            penalty = torch.tensor([row.params.repetition_penalty for row in rows], device=device)[
                row_index
            ]
            values = scores[row_index, token_index]
            scores[row_index, token_index] = torch.where(
                values > 0, values / penalty, values * penalty
            )
    additive = [
        i
        for i, row in enumerate(rows)
        if row.params.presence_penalty != 0.0 or row.params.frequency_penalty != 0.0
    ]
    if additive:
        row_index, token_index, counts = _unique_tokens(rows, additive, False, vocab, device)
        if row_index.numel():
            presence = torch.tensor([row.params.presence_penalty for row in rows], device=device)
            frequency = torch.tensor([row.params.frequency_penalty for row in rows], device=device)
            scores[row_index, token_index] -= (
                frequency[row_index] * counts.to(scores.dtype) + presence[row_index]
            )


def _truncate(scores: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """top_k, top_p and min_p on tempered logits float32 [r, vocab] (a copy; may be
    modified in place): dropped tokens become -inf."""
    vocab = scores.shape[1]
    device = scores.device

    top_k = [(i, row.params.top_k) for i, row in enumerate(rows) if 0 < row.params.top_k < vocab]
    if top_k:
        index = [i for i, _ in top_k]
        ks = torch.tensor([k for _, k in top_k], device=device)
        values = torch.topk(scores[index], int(ks.max()), dim=-1).values
        kth = values.gather(1, (ks - 1).unsqueeze(1))
        part = scores[index]
        scores[index] = part.masked_fill(part < kth, -math.inf)

    top_p = [(i, row.params.top_p) for i, row in enumerate(rows) if row.params.top_p < 1.0]
    if top_p:
        index = [i for i, _ in top_p]
        ps = torch.tensor([p for _, p in top_p], device=device).unsqueeze(1)
        part = scores[index]
        probs = torch.softmax(part, dim=-1)
        width = min(vocab, _TOP_P_CANDIDATES)
        top_probs, top_ids = torch.topk(probs, width, dim=-1)
        # a row whose candidates hold less than top_p of the mass is sorted in full
        short = (top_probs.sum(dim=-1, keepdim=True) < ps).squeeze(1)
        if width < vocab and bool(short.any()):
            full_probs, full_ids = torch.sort(probs[short], dim=-1, descending=True)
            keep_full = _nucleus(full_probs, ps[short])
            keep = torch.zeros_like(part, dtype=torch.bool)
            keep[short] = torch.zeros_like(full_probs, dtype=torch.bool).scatter(
                1, full_ids, keep_full
            )
            keep_top = _nucleus(top_probs[~short], ps[~short])
            keep[~short] = torch.zeros(
                (keep_top.shape[0], vocab), dtype=torch.bool, device=device
            ).scatter(1, top_ids[~short], keep_top)
        else:
            keep_top = _nucleus(top_probs, ps)
            keep = torch.zeros_like(part, dtype=torch.bool).scatter(1, top_ids, keep_top)
        scores[index] = part.masked_fill(~keep, -math.inf)

    min_p = [(i, row.params.min_p) for i, row in enumerate(rows) if row.params.min_p > 0.0]
    if min_p:
        index = [i for i, _ in min_p]
        # p < min_p * p_max  <=>  logit < max_logit + log(min_p)
        offsets = torch.tensor([math.log(p) for _, p in min_p], device=device).unsqueeze(1)
        part = scores[index]
        floor = part.max(dim=-1, keepdim=True).values + offsets
        scores[index] = part.masked_fill(part < floor, -math.inf)
    return scores


def _nucleus(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which of the descending probabilities [r, n] form the nucleus: those with less than
    ``top_p`` [r, 1] of the mass before them (so the first always)."""
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = before < top_p
    keep[:, 0] = True
    return keep


def _draw(scores: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """One token per row of tempered logits float32 [r, vocab]: int64 [r]."""
    scores = _truncate(scores, rows)
    probs = torch.softmax(scores, dim=-1)
    cdf = probs.cumsum(dim=-1)
    device = scores.device
    uniform = torch.empty(len(rows), device=device)
    unseeded = [i for i, row in enumerate(rows) if row.generator is None]
    if unseeded:
        uniform[unseeded] = torch.rand(len(unseeded), device=device)
    seeded = [i for i, row in enumerate(rows) if row.generator is not None]
    if seeded:
        uniform[seeded] = torch.cat(
            [torch.rand(1, generator=rows[i].generator, device=device) for i in seeded]
        )
    # the first token whose cumulative mass exceeds u * total: a token of probability 0
    # adds nothing to the sum, so it is never the first to exceed it
    targets = (uniform * cdf[:, -1]).unsqueeze(1)
    chosen = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    # u * total can round up to total itself; take the row's last token of mass > 0 then
    overflow = chosen >= scores.shape[1]
    if bool(overflow.any()):
        positive = probs[overflow] > 0
        last = scores.shape[1] - 1 - positive.flip(dims=[1]).int().argmax(dim=-1)
        chosen[overflow] = last
    return chosen


def _fill_logprobs(
    results: list[SampledToken],
    scores: torch.Tensor,
    chosen: torch.Tensor,
    rows: list[SamplingRow],
    positions: list[int],
) -> None:
    """Set ``logprob`` and ``top_logprobs`` of the rows that asked, from their processed
    logits float32 [r, vocab] and chosen tokens int64 [r]."""
    logprobs = torch.log_softmax(scores, dim=-1)
    picked: list[float] = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    width = max(row.params.top_logprobs for row in rows)
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    if width > 0:
        values, ids = torch.topk(logprobs, min(width, logprobs.shape[1]), dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    for j, (row, position) in enumerate(zip(rows, positions, strict=True)):
        result = results[position]
        result.logprob = picked[j]
        k = row.params.top_logprobs
        if k > 0:
            result.top_logprobs = list(zip(top_ids[j][:k], top_values[j][:k], strict=True))
