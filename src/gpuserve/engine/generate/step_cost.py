"""What an engine step costs, learnt from the steps run, and the prefill chunk that keeps
running streams flowing.

A step computes every running sequence's next token and, within the token budget, chunks of
prompts (chunked prefill). On a GPU a 512-token chunk costs about what the decodes do; on a
CPU it costs many decode steps, so each step that carries one holds every running stream's
next token back by that much (head-of-line blocking, spread over the prompt's chunks). The
engine therefore cuts prefill chunks, while any sequence decodes, to what keeps a step within
``slowdown`` times a step of decodes alone:

    prefill tokens  <=  (slowdown - 1) x decode step time / time per prefill token

Both times are exponentially weighted means of the measured steps (a decode-only step's
time; a step with prefill's time beyond the decode step, per prefill token). Until both
have been seen there is no cap. A cap never falls below ``floor`` tokens, so a prompt
always progresses.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Weight of the newest step in the means.
ALPHA = 0.2
#: Prefill tokens a step must carry for its time to teach the per-token cost.
MIN_PREFILL_SAMPLE = 8


@dataclass(slots=True)
class StepCost:
    """The learnt step costs (module docstring).

    Attributes:
        decode_step_s: Mean time of a step of decodes alone, seconds (0: none seen yet).
        prefill_token_s: Mean time per prefill token beyond the decodes, seconds (0: none).
    """

    decode_step_s: float = 0.0
    prefill_token_s: float = 0.0

    def observe(self, decodes: int, prefill_tokens: int, seconds: float) -> None:
        """Learn from one step of ``decodes`` one-token chunks and ``prefill_tokens`` tokens
        of prompt chunks that took ``seconds``."""
        if seconds <= 0.0:
            return
        if prefill_tokens == 0:
            if decodes > 0:
                self.decode_step_s = _mean(self.decode_step_s, seconds)
            return
        if prefill_tokens < MIN_PREFILL_SAMPLE or self.decode_step_s == 0.0:
            return
        base = self.decode_step_s if decodes else 0.0
        per_token = max(seconds - base, 0.0) / prefill_tokens
        if per_token > 0.0:
            self.prefill_token_s = _mean(self.prefill_token_s, per_token)

    def prefill_cap(self, slowdown: float, floor: int) -> int | None:
        """Most prefill tokens a step with decodes may carry to take at most ``slowdown``
        times a decode-only step; None while the costs are unknown."""
        if self.decode_step_s == 0.0 or self.prefill_token_s == 0.0:
            return None
        allowed = (slowdown - 1.0) * self.decode_step_s / self.prefill_token_s
        return max(floor, int(allowed))


def _mean(old: float, new: float) -> float:
    return new if old == 0.0 else old + ALPHA * (new - old)


__all__ = ["StepCost"]
