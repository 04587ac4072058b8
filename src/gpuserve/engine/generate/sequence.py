"""One generated sequence's state, as the scheduler and the block manager see it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["FinishReason", "Sequence", "SequenceStatus"]

#: Why a sequence finished: a stop token or string ("stop"), ``max_tokens`` outputs
#: ("length"), cancelled by its client ("abort"), its deadline passed ("timeout"), the model
#: step it was in failed ("error").
FinishReason = Literal["stop", "length", "abort", "timeout", "error"]


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    #: Queued; holds no KV-cache blocks (new, or preempted and waiting to be recomputed).
    WAITING = "waiting"
    #: Admitted; holds blocks and gets a chunk in every step while the token budget lasts.
    RUNNING = "running"
    #: Done (any :data:`FinishReason`); its blocks are freed.
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One sequence being generated: its tokens, its place in the KV cache and its timing.

    The scheduler and the block manager own every field after :meth:`GenerationScheduler.add
    <gpuserve.engine.generate.scheduler.GenerationScheduler.add>`; the engine reads them.

    Attributes:
        seq_id: Unique id of this sequence within its scheduler.
        request_id: Id of the request it belongs to (a request may have several sequences).
        prompt_ids: The prompt's token ids (at least one).
        max_tokens: Cap on output tokens (at least one).
        arrival_s: When it arrived, seconds on the scheduler's monotonic clock; orders the
            waiting queue and picks preemption victims (the newest goes first).
        deadline_s: When it expires (finish reason "timeout"), seconds on the same clock;
            None for never.
        output_ids: Tokens sampled so far, in order. Kept across preemption.
        num_computed: Leading tokens of :attr:`all_ids` whose KV is in the cache (tokens).
        block_table: KV-cache block ids; the token at position ``p`` lives in block
            ``block_table[p // block_size]`` at offset ``p % block_size``.
        block_hashes: Chained hashes of the leading full blocks of ``block_table`` that are
            computed and were offered to the prefix cache (block manager bookkeeping).
        num_cached_prompt: Tokens of its context found in the prefix cache at its latest
            admission (the prompt, or prompt + outputs when readmitted after preemption).
        status: WAITING, RUNNING or FINISHED.
        finish_reason: Why it finished; None until then.
        preemptions: Times it was preempted (its KV dropped, to be recomputed).
        first_token_s: When its first output token was recorded, seconds; None until then.
        bulk: It is bulk work: it waits behind interactive sequences, and gives up its slot
            and blocks first (see the scheduler).
    """

    seq_id: int
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    arrival_s: float
    deadline_s: float | None = None
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_cached_prompt: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    preemptions: int = 0
    first_token_s: float | None = None
    bulk: bool = False

    @property
    def all_ids(self) -> list[int]:
        """Prompt then outputs: every known token of the sequence (a new list)."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt plus outputs."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Known tokens whose KV is not in the cache yet (the rest of the prefill, or 1)."""
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        """Whether it is FINISHED."""
        return self.status is SequenceStatus.FINISHED

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens ``all_ids[start:stop]`` without building :attr:`all_ids`.

        Args:
            start: First position (0 <= start <= stop).
            stop: One past the last position (<= :attr:`num_tokens`).

        Returns:
            The token ids, a new list.
        """
        n_prompt = len(self.prompt_ids)
        if stop <= n_prompt:
            return self.prompt_ids[start:stop]
        if start >= n_prompt:
            return self.output_ids[start - n_prompt : stop - n_prompt]
        return self.prompt_ids[start:] + self.output_ids[: stop - n_prompt]
