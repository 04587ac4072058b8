"""Iteration-level (continuous) batching for generative models: a pure state machine.

One engine loop drives it, one model step at a time, on an injected monotonic clock::

    scheduler.add(seq)                        # queue a new sequence (or raise if it never fits)
    plan = scheduler.schedule()               # None: nothing to run or report
    #   report plan.expired / plan.aborted (finished, blocks freed) to their clients
    #   run the model on plan.chunks; sample one token for every chunk with samples=True
    scheduler.complete(plan, {seq_id: token}) # KV computed, tokens appended
    scheduler.finish(seq_id, "stop")          # the engine's stop decision (stop / length)

Policy of :meth:`GenerationScheduler.schedule` (vLLM v1 style, no separate prefill phase):

* **Running first, oldest first**: every RUNNING sequence gets its next chunk within the token
  budget ``max_tokens_per_step``: one token when it is decoding, else the next piece of its
  prompt (chunked prefill). Decodes therefore keep flowing while a long prompt is prefilled.
  While any sequence decodes, prompt chunks (running and admitted together) take what the
  engine's :class:`PrefillLimit` allows for that many decodes, when it gives one
  (:mod:`~gpuserve.engine.generate.step_cost`: a step then takes a bounded multiple of a
  decode-only step, so long prompts arriving never stall the running streams; a chunk deep
  in a long prompt gets fewer tokens than one at its start, as each costs more).
* **Then admission**, FIFO: WAITING sequences start (up to ``max_running``) with a first chunk
  of the budget left; a prompt's cached prefix (:mod:`~gpuserve.engine.generate.blocks`) is
  not recomputed. A sequence that finds no blocks waits, and so do those behind it.
* **Preemption by recompute**: when a running sequence's chunk finds no free block, the newest
  running sequence gives up its blocks and goes back to the front of the waiting queue, keeping
  its outputs; readmitted, it recomputes prompt + outputs (much of it from the prefix cache).
  No sequence is admitted in a step that preempted. A sequence is never lost and no step runs
  out of memory: :meth:`GenerationScheduler.add` refuses one that cannot fit the cache alone.
* **Bulk sequences** (``Sequence.bulk``) wait behind every interactive one, are the first
  preempted when blocks run out, and an interactive sequence that finds every running slot
  taken preempts the newest running bulk one: bulk work only fills what interactive traffic
  leaves, and never holds an interactive sequence back by more than one step.
* **Cancellation and deadlines** take effect at the start of :meth:`schedule`, never mid-step.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from gpuserve.engine.generate.blocks import BlockManager
from gpuserve.engine.generate.sequence import FinishReason, Sequence, SequenceStatus
from gpuserve.engine.generate.step_cost import PrefillAllowance
from gpuserve.errors import InvalidInputError

__all__ = ["GenerationScheduler", "PrefillLimit", "ScheduledChunk", "SchedulerStats", "StepPlan"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledChunk:
    """Tokens of one sequence to run through the model in this step.

    Attributes:
        seq: The sequence.
        start: Position of the first token computed (``seq.num_computed`` when scheduled).
        token_ids: The tokens to compute: ``seq.all_ids[start:start + len(token_ids)]``.
            Their KV goes to ``seq.block_table`` (position ``p`` -> block
            ``p // block_size``, offset ``p % block_size``); positions before ``start`` are
            already in the cache.
        samples: True when the chunk reaches the end of the known tokens, so the engine
            samples the next token from its last logit; False for a non-final prefill chunk.
    """

    seq: Sequence
    start: int
    token_ids: list[int]
    samples: bool


@dataclass(slots=True)
class StepPlan:
    """One engine step (:meth:`GenerationScheduler.schedule`).

    Attributes:
        chunks: What to compute, running sequences first (oldest first), then admissions.
        expired: Sequences whose deadline passed: finished ("timeout"), blocks freed.
        aborted: Cancelled sequences finished ("abort") since the last plan, blocks freed.
        preempted: Sequences preempted this step: back in the waiting queue, blocks freed.
        made_room: Bulk sequences preempted this step to give their slot to an interactive
            one (back in the waiting queue, blocks freed; admission went on).
        num_tokens: Tokens in ``chunks`` (<= ``max_tokens_per_step``).
    """

    chunks: list[ScheduledChunk] = field(default_factory=list)
    expired: list[Sequence] = field(default_factory=list)
    aborted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    made_room: list[Sequence] = field(default_factory=list)
    num_tokens: int = 0


@dataclass(slots=True)
class SchedulerStats:
    """A snapshot for metrics (:meth:`GenerationScheduler.stats`).

    Attributes:
        num_running: Sequences RUNNING (holding blocks).
        num_waiting: Sequences WAITING (new or preempted).
        num_preemptions: Preemptions since creation (counter).
        kv_cache_usage: Fraction of KV-cache blocks held, 0..1.
        prefix_queries_tokens: Tokens looked up in the prefix cache (counter).
        prefix_hit_tokens: Tokens found there and not recomputed (counter).
    """

    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_cache_usage: float
    prefix_queries_tokens: int
    prefix_hit_tokens: int


class PrefillLimit(Protocol):
    """What holds prompt chunks back while sequences decode (the engine's
    :class:`~gpuserve.engine.generate.step_cost.StepCost`)."""

    def allowance(self, decodes: int) -> PrefillAllowance:
        """The prompt tokens a step with ``decodes`` (>= 1) decodes may carry; asked once
        per :meth:`GenerationScheduler.schedule` that has decodes, before any chunk."""
        ...


def _age(seq: Sequence) -> tuple[float, int]:
    """Sort key: oldest arrival first, then lowest id."""
    return (seq.arrival_s, seq.seq_id)


class GenerationScheduler:
    """Decides, step by step, which tokens of which sequences the model computes.

    Not thread-safe: one loop calls every method. Times are seconds on ``clock``.

    Args:
        blocks: The KV-cache block manager (shared with the engine, which reads
            ``block_size``).
        max_running: Most sequences RUNNING at once (>= 1): the model's batch size cap.
        max_tokens_per_step: Token budget of one step, prefill and decode together (>= 1).
        clock: Monotonic clock, seconds; read for deadlines and ``first_token_s``.
    """

    def __init__(
        self,
        blocks: BlockManager,
        max_running: int,
        max_tokens_per_step: int,
        clock: Callable[[], float],
    ) -> None:
        if max_running < 1 or max_tokens_per_step < 1:
            raise ValueError(
                "max_running and max_tokens_per_step must be >= 1, got "
                f"{max_running} and {max_tokens_per_step}"
            )
        self.blocks = blocks
        self.max_running = max_running
        self.max_tokens_per_step = max_tokens_per_step
        self.clock = clock
        self.num_preemptions = 0
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # oldest first (by _age)
        self._by_id: dict[int, Sequence] = {}  # every sequence not FINISHED
        self._cancel_running: set[int] = set()
        self._aborted: list[Sequence] = []  # finished since the last plan

    # -- read-only state -------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        """Sequences RUNNING."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Sequences WAITING."""
        return len(self._waiting)

    @property
    def running(self) -> list[Sequence]:
        """The RUNNING sequences, oldest first (a copy)."""
        return list(self._running)

    @property
    def waiting(self) -> list[Sequence]:
        """The WAITING sequences, next to admit first (a copy)."""
        return list(self._waiting)

    def get(self, seq_id: int) -> Sequence | None:
        """The unfinished sequence ``seq_id``, or None."""
        return self._by_id.get(seq_id)

    def has_work(self) -> bool:
        """Whether :meth:`schedule` may return a plan (something queued, running or to report)."""
        return bool(self._by_id or self._aborted)

    def stats(self) -> SchedulerStats:
        """A snapshot of the counts and counters, for metrics."""
        return SchedulerStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_preemptions=self.num_preemptions,
            kv_cache_usage=self.blocks.usage,
            prefix_queries_tokens=self.blocks.prefix_queries_tokens,
            prefix_hit_tokens=self.blocks.prefix_hit_tokens,
        )

    # -- lifecycle -------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the back of the waiting queue.

        Raises:
            InvalidInputError: Its prompt is empty, ``max_tokens`` < 1, or its whole context
                (prompt + ``max_tokens``) can never fit the KV cache.
            ValueError: Its id is already in use, or it is not a fresh WAITING sequence.
        """
        if not seq.prompt_ids:
            raise InvalidInputError("the prompt is empty: at least one token is needed")
        if seq.max_tokens < 1:
            raise InvalidInputError(f"max_tokens must be >= 1, got {seq.max_tokens}")
        context = len(seq.prompt_ids) + seq.max_tokens
        if self.blocks.blocks_for(context) > self.blocks.num_blocks:
            raise InvalidInputError(
                f"the sequence needs {context} tokens of KV cache (prompt "
                f"{len(seq.prompt_ids)} + max_tokens {seq.max_tokens}), more than the cache "
                f"holds: {self.blocks.capacity_tokens} tokens"
            )
        if seq.seq_id in self._by_id:
            raise ValueError(f"sequence id {seq.seq_id} is already in use")
        if seq.status is not SequenceStatus.WAITING or seq.block_table or seq.output_ids:
            raise ValueError(f"sequence {seq.seq_id} is not a new sequence")
        self._by_id[seq.seq_id] = seq
        if seq.bulk:
            self._waiting.append(seq)
        else:
            self._queue_bulk_first(seq)  # ahead of every waiting bulk sequence

    def cancel(self, seq_id: int) -> bool:
        """Cancel a sequence (finish reason "abort"); it shows in the next plan's ``aborted``.

        A waiting sequence leaves the queue at once; a running one is freed at the start of the
        next :meth:`schedule`, so a step in flight keeps its blocks.

        Returns:
            False when ``seq_id`` is unknown or already finished.
        """
        seq = self._by_id.get(seq_id)
        if seq is None:
            return False
        if seq.status is SequenceStatus.WAITING:
            self._waiting.remove(seq)
            self._finish(seq, "abort")
            self._aborted.append(seq)
        else:
            self._cancel_running.add(seq_id)
        return True

    def finish(self, seq_id: int, reason: FinishReason) -> Sequence | None:
        """Finish a sequence (the engine's stop decision): status FINISHED, blocks freed.

        Call after :meth:`complete`, never between :meth:`schedule` and :meth:`complete` of a
        plan that holds the sequence.

        Returns:
            The sequence, or None when ``seq_id`` is unknown or already finished.
        """
        seq = self._by_id.get(seq_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            self._waiting.remove(seq)
        else:
            self._running.remove(seq)
        self._finish(seq, reason)
        return seq

    # -- one step --------------------------------------------------------------------------

    def schedule(self, prefill_limit: PrefillLimit | None = None) -> StepPlan | None:
        """Plan the next model step (see the module docstring for the policy).

        Args:
            prefill_limit: What the step's prompt chunks may take while a sequence decodes
                (None: the whole token budget).

        Returns:
            The plan, or None when there is nothing to compute and nothing to report.
        """
        plan = StepPlan(aborted=self._aborted)
        self._aborted = []
        self._drop_cancelled_and_expired(plan)
        budget = self.max_tokens_per_step
        allowance: PrefillAllowance | None = None
        if prefill_limit is not None:
            decodes = sum(1 for s in self._running if s.num_uncomputed == 1)
            if decodes:
                allowance = prefill_limit.allowance(decodes)

        index = 0
        while index < len(self._running) and budget > 0:
            seq = self._running[index]
            n = min(seq.num_uncomputed, budget)
            prompt = n > 1
            if prompt and allowance is not None:
                n = allowance.fit(seq.num_computed, n)
            if n == 0:  # the engine neither sampled nor finished it (or no prefill is left)
                index += 1
                continue
            while not self.blocks.append_slots(seq, n):
                victim = self._victim()
                self._preempt(victim, plan)
                if victim is seq:
                    break
            else:
                plan.chunks.append(self._chunk(seq, n))
                budget -= n
                if prompt and allowance is not None:
                    allowance.spend(seq.num_computed, n)
                index += 1

        if (  # an interactive sequence waits and bulk ones hold every slot: one makes room
            self._waiting
            and not self._waiting[0].bulk
            and len(self._running) >= self.max_running
            and not plan.preempted
        ):
            bulk = [seq for seq in self._running if seq.bulk]
            if bulk:
                victim = bulk[-1]
                budget += sum(len(c.token_ids) for c in plan.chunks if c.seq is victim)
                plan.chunks = [c for c in plan.chunks if c.seq is not victim]
                self._preempt(victim, plan)
                plan.preempted.remove(victim)  # admission goes on this step
                plan.made_room.append(victim)
                self._waiting.remove(victim)  # behind the interactive ones, first of the bulk
                self._queue_bulk_first(victim)

        while (
            self._waiting
            and len(self._running) < self.max_running
            and budget > 0
            and not plan.preempted
        ):
            seq = self._waiting[0]
            match = self.blocks.match_prefix(seq.all_ids)
            n = min(seq.num_tokens - match.num_tokens, budget)
            if allowance is not None and n > 1:
                n = allowance.fit(match.num_tokens, n)
            if n == 0 or not self.blocks.allocate(seq, match, n):
                break
            self._waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self._running, seq, key=_age)
            plan.chunks.append(self._chunk(seq, n))
            budget -= n
            if allowance is not None and n > 1:
                allowance.spend(match.num_tokens, n)

        plan.num_tokens = self.max_tokens_per_step - budget
        if not (plan.chunks or plan.expired or plan.aborted or plan.preempted):
            return None
        return plan

    def complete(self, plan: StepPlan, sampled: Mapping[int, int]) -> None:
        """Record a step the model ran: KV computed, and the tokens sampled.

        Every chunk's sequence advances ``num_computed`` by the chunk's length and its newly
        full blocks enter the prefix cache. Each ``sampled`` token is appended to its
        sequence's ``output_ids`` (``first_token_s`` is set on the first). Sequences finished
        meanwhile are skipped. Stop decisions are the engine's: it calls :meth:`finish`.

        Args:
            plan: The plan from the latest :meth:`schedule`.
            sampled: Sequence id -> token sampled from its chunk's last logit, for chunks
                with ``samples`` True.

        Raises:
            ValueError: A sampled id has no chunk with ``samples`` True in ``plan``.
        """
        sampling: set[int] = set()
        for chunk in plan.chunks:
            seq = chunk.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed = chunk.start + len(chunk.token_ids)
            self.blocks.register_computed(seq)
            if chunk.samples:
                sampling.add(seq.seq_id)
        now: float | None = None
        for seq_id, token in sampled.items():
            if seq_id not in sampling:
                if seq_id in self._by_id:
                    raise ValueError(f"sequence {seq_id} had no sampling chunk in this step")
                continue  # finished between schedule and complete
            seq = self._by_id[seq_id]
            seq.output_ids.append(token)
            if seq.first_token_s is None:
                now = self.clock() if now is None else now
                seq.first_token_s = now

    # -- internals -------------------------------------------------------------------------

    def _chunk(self, seq: Sequence, n: int) -> ScheduledChunk:
        start = seq.num_computed
        return ScheduledChunk(
            seq=seq,
            start=start,
            token_ids=seq.token_slice(start, start + n),
            samples=start + n == seq.num_tokens,
        )

    def _queue_bulk_first(self, seq: Sequence) -> None:
        """Put ``seq`` in the waiting queue just before its first bulk sequence."""
        index = next((i for i, other in enumerate(self._waiting) if other.bulk), None)
        if index is None:
            self._waiting.append(seq)
        else:
            self._waiting.insert(index, seq)

    def _victim(self) -> Sequence:
        """The running sequence to preempt: the newest bulk one, else the newest."""
        for seq in reversed(self._running):
            if seq.bulk:
                return seq
        return self._running[-1]

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Drop ``seq``'s KV and put it at the front of the waiting queue."""
        self._running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed = 0
        seq.status = SequenceStatus.WAITING
        seq.preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(seq)
        plan.preempted.append(seq)
        logger.debug(
            "preempted sequence %s (%s tokens) for lack of KV-cache blocks",
            seq.seq_id,
            seq.num_tokens,
        )

    def _drop_cancelled_and_expired(self, plan: StepPlan) -> None:
        for seq_id in sorted(self._cancel_running):
            seq = self.finish(seq_id, "abort")
            if seq is not None:
                plan.aborted.append(seq)
        self._cancel_running.clear()
        now = self.clock()
        expired = [
            s for s in self._by_id.values() if s.deadline_s is not None and now >= s.deadline_s
        ]
        for seq in expired:
            self.finish(seq.seq_id, "timeout")
            plan.expired.append(seq)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.blocks.free(seq)
        self._by_id.pop(seq.seq_id, None)
        self._cancel_running.discard(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
