"""What an engine step costs, learnt from the steps run, and the prompt tokens a step may
carry while running streams wait for their next token.

A step computes every running sequence's next token and, within the token budget, chunks of
prompts (chunked prefill). On a GPU a 512-token chunk costs about what the decodes do; on a
CPU it costs many decode steps, so each step that carries one holds every running stream's
next token back by that much (head-of-line blocking, spread over the prompt's chunks). The
engine therefore cuts prefill chunks, while any sequence decodes, to what keeps a step within
``slowdown`` times a step of those decodes alone:

    prefill seconds  <=  (slowdown - 1) x decode step seconds (for this many decodes)

The costs, learnt as the steps run (:meth:`StepCost.observe`):

* **A decode-only step**, per number of decodes (a step of 2 decodes takes half what 8 do on
  a CPU): an exponentially weighted mean for each count seen. A count not seen yet takes the
  nearest smaller count's time (a cheaper step: a smaller allowance), else the nearest larger
  one's scaled down in proportion.
* **A prefill token**, as a line in its position, plus a cost per chunk: a token at
  position ``p`` attends over ``p`` keys, so on a CPU the 2,000th token of a prompt costs
  about twice the first; and a chunk of 16 tokens costs more per token than one of 200 (a
  call per layer, small matrices). The time of a step beyond its decodes, per prompt token,
  is fitted against the chunks' mean position and chunks per token by exponentially
  weighted least squares. Until the positions seen spread over a few hundred tokens the
  slope leans on a prior (:data:`PRIOR_DOUBLING_TOKENS`), so the later chunks of the first
  long prompt are not taken for as cheap as its first.

A chunk of ``n`` tokens from position ``p`` then costs ``c + n x (a + b x (p + (n - 1) / 2))``
seconds; :class:`PrefillAllowance` hands out what fits, chunk by chunk. Before a decode-only
step has been timed a step with decodes carries no prompt tokens (it times one); before a
prefill token has been timed, ``floor`` tokens. A step's prompt chunks never get fewer than
``floor`` tokens in all, so a prompt always progresses.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

#: Weight of the newest step in the decode-step means.
ALPHA = 0.2
#: Weight of the newest step in the per-token fit (slower: it must span a long prompt).
FIT_ALPHA = 0.1
#: Prefill tokens a step must carry for its time to teach the per-token cost.
MIN_PREFILL_SAMPLE = 8
#: Prior for the per-token cost's growth with position: a token at this position costs
#: twice one at position 0 (SmolLM2-135M on one CPU core measures about 1,700).
PRIOR_DOUBLING_TOKENS = 1024.0
#: Spread of positions (standard deviation, tokens) at which the data and the prior weigh
#: the same in the slope.
PRIOR_SPREAD_TOKENS = 256.0
#: Spread of chunks per token at which the data and the prior (no cost per chunk) weigh
#: the same.
PRIOR_SPREAD_CHUNKS_PER_TOKEN = 0.01
#: The intercept never falls below this share of the mean per-token cost (a fit through
#: noisy late chunks must not make early tokens free).
MIN_INTERCEPT_SHARE = 0.1


@dataclass(slots=True)
class PrefillAllowance:
    """The prompt tokens one step may still carry (:meth:`StepCost.allowance`).

    Attributes:
        seconds: Prefill time left in the step, seconds (inf: no limit).
        token_s: Cost of a prompt token at position 0, seconds.
        position_s: Growth of that cost per position, seconds per token per position.
        chunk_s: Cost of a chunk beside its tokens', seconds.
        floor: Tokens the step's first prompt chunk may always carry.
        granted: Prompt tokens spent so far in the step.
    """

    seconds: float
    token_s: float
    position_s: float
    chunk_s: float
    floor: int
    granted: int = 0

    def fit(self, start: int, wanted: int) -> int:
        """Tokens (<= ``wanted``) of a chunk from position ``start`` that fit what is left;
        at least ``floor`` for the step's first chunk."""
        n = self._fitting(start)
        if self.granted == 0:
            n = max(n, self.floor)
        return max(0, min(n, wanted))

    def spend(self, start: int, tokens: int) -> None:
        """Record a chunk of ``tokens`` from position ``start`` put in the step."""
        self.seconds -= self.cost(start, tokens)
        self.granted += tokens

    def cost(self, start: int, tokens: int) -> float:
        """Predicted seconds of a chunk of ``tokens`` from position ``start``."""
        if tokens <= 0:
            return 0.0
        per_token = self.token_s + self.position_s * (start + (tokens - 1) / 2)
        return self.chunk_s + tokens * per_token

    def _fitting(self, start: int) -> int:
        if self.seconds == math.inf:
            return 1 << 62
        seconds = self.seconds - self.chunk_s
        if seconds <= 0.0 or math.isinf(self.token_s):
            return 0
        # n x (beta + b n / 2) <= seconds, with beta = a + b (start - 1/2)
        b = self.position_s
        beta = self.token_s + b * (start - 0.5)
        if b <= 0.0:
            return int(seconds / beta)
        return int((-beta + math.sqrt(beta * beta + 2.0 * b * seconds)) / b)


@dataclass(slots=True)
class StepCost:
    """The learnt step costs and the allowance they give (module docstring).

    Args:
        slowdown: A step with decodes takes at most this many times a step of its decodes
            alone.
        floor: Prompt tokens a step with decodes may always carry, e.g. one KV block.

    Attributes:
        decode_step_s: Number of decodes -> mean time of a step of decodes alone, seconds.
    """

    slowdown: float = 2.0
    floor: int = 16
    decode_step_s: dict[int, float] = field(default_factory=dict)
    # exponentially weighted sums of the per-token fit y = a + b x + c u, with x the mean
    # position, u chunks per token, y seconds per token: weight, then sums of x, u, y, x^2,
    # x u, u^2, x y, u y
    _sums: list[float] = field(default_factory=lambda: [0.0] * 9)

    def observe(self, decodes: int, prefill: Iterable[tuple[int, int]], seconds: float) -> None:
        """Learn from one step that took ``seconds``: ``decodes`` one-token chunks and the
        prompt chunks ``prefill``, each (start position, tokens)."""
        if seconds <= 0.0:
            return
        chunks = [(start, n) for start, n in prefill if n > 0]
        tokens = sum(n for _, n in chunks)
        if tokens == 0:
            if decodes > 0:
                old = self.decode_step_s.get(decodes)
                self.decode_step_s[decodes] = (
                    seconds if old is None else old + ALPHA * (seconds - old)
                )
            return
        if tokens < MIN_PREFILL_SAMPLE:
            return
        base = 0.0
        if decodes:
            known = self.decode_s(decodes)
            if known is None:
                return
            base = known
        per_token = max(seconds - base, 0.0) / tokens
        x = sum(n * (start + (n - 1) / 2) for start, n in chunks) / tokens
        u = len(chunks) / tokens
        sums = self._sums
        keep = 1.0 - FIT_ALPHA if sums[0] else 0.0
        for i, term in enumerate((1.0, x, u, per_token, x * x, x * u, u * u, x * per_token)):
            sums[i] = keep * sums[i] + term
        sums[8] = keep * sums[8] + u * per_token

    def decode_s(self, decodes: int) -> float | None:
        """Estimated seconds of a step of ``decodes`` decodes alone; None before any."""
        known = self.decode_step_s
        if decodes in known:
            return known[decodes]
        below = [n for n in known if n < decodes]
        if below:
            return known[max(below)]
        above = [n for n in known if n > decodes]
        if above:
            nearest = min(above)
            return known[nearest] * decodes / nearest
        return None

    def token_costs(self) -> tuple[float, float, float] | None:
        """(seconds per prompt token at position 0, growth per position, seconds per chunk),
        None before any prefill was timed."""
        w, sx, su, sy, sxx, sxu, suu, sxy, suy = self._sums
        if w == 0.0:
            return None
        mx, mu, my = sx / w, su / w, sy / w
        # centred (co)variances; ridge terms pull the slope to the prior, the chunk cost to 0
        vxx = max(sxx / w - mx * mx, 0.0) + PRIOR_SPREAD_TOKENS**2
        vuu = max(suu / w - mu * mu, 0.0) + PRIOR_SPREAD_CHUNKS_PER_TOKEN**2
        vxu = sxu / w - mx * mu
        cxy = sxy / w - mx * my + PRIOR_SPREAD_TOKENS**2 * my / (PRIOR_DOUBLING_TOKENS + mx)
        cuy = suy / w - mu * my
        det = vxx * vuu - vxu * vxu
        slope = max((cxy * vuu - cuy * vxu) / det, 0.0)
        chunk = max((cuy * vxx - cxy * vxu) / det, 0.0)
        intercept = max(my - slope * mx - chunk * mu, MIN_INTERCEPT_SHARE * my)
        return intercept, slope, chunk

    def allowance(self, decodes: int) -> PrefillAllowance:
        """The prompt tokens a step with ``decodes`` decodes may carry (module docstring)."""
        decode = self.decode_s(decodes)
        if decode is None:  # time a decode-only step first
            return PrefillAllowance(0.0, math.inf, 0.0, 0.0, 0)
        costs = self.token_costs()
        if costs is None:
            return PrefillAllowance(0.0, math.inf, 0.0, 0.0, self.floor)
        return PrefillAllowance((self.slowdown - 1.0) * decode, *costs, self.floor)


__all__ = ["PrefillAllowance", "StepCost"]
