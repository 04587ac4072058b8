"""The generation engine: the step loop of one generative model version, on its instance thread.

Each turn of the loop takes the commands the event loop sent (new sequences, cancellations),
asks the pure :class:`~gpuserve.engine.generate.scheduler.GenerationScheduler` for one step
(the next token of every running sequence, then prefill chunks of new ones, within the token
budget), runs the model once over the whole step on the paged KV cache, samples one token for
each sequence whose known tokens were all computed, turns tokens into text (whole characters,
stop strings held back), decides which sequences end, and publishes every sequence's delta in
one call. With nothing to do it blocks on its inbox.

Failures stay where they belong: a step whose forward pass raises fails the sequences of that
step (each with the error) and frees their blocks; the loop goes on with the others.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpuserve.backends.causal_lm.backend import GenerationModel
from gpuserve.backends.causal_lm.detokenize import IncrementalDetokenizer, StopStrings
from gpuserve.backends.causal_lm.sampling import (
    SampledToken,
    Sampler,
    SamplingRow,
    make_generator,
)
from gpuserve.backends.causal_lm.step import ChunkInput, StepBatch
from gpuserve.engine.generate.blocks import BlockManager
from gpuserve.engine.generate.messages import (
    GenerationDelta,
    GenerationRequest,
    TokenLogprob,
    TopLogprob,
)
from gpuserve.engine.generate.scheduler import GenerationScheduler, StepPlan
from gpuserve.engine.generate.sequence import FinishReason, Sequence
from gpuserve.engine.generate.stats import GenerationStats
from gpuserve.engine.generate.step_cost import StepCost
from gpuserve.errors import BackendError, GpuserveError

logger = logging.getLogger(__name__)


class DeltaSink:
    """Where one sequence's deltas go (the runner's stream); called from the loop thread
    through :data:`Publish`, never from the engine thread directly."""

    def deliver(self, delta: GenerationDelta) -> None:  # pragma: no cover - interface
        raise NotImplementedError


#: Hands one step's deltas to the event loop (one call per step, from the engine thread).
Publish = Callable[[list[tuple[DeltaSink, GenerationDelta]]], None]


@dataclass(slots=True)
class _Submit:
    seq_id: int
    request: GenerationRequest
    sink: DeltaSink


@dataclass(slots=True)
class _Cancel:
    seq_id: int


class _Stop:
    pass


_Command = _Submit | _Cancel | _Stop


@dataclass(slots=True)
class _Active:
    """The engine's side of one sequence."""

    seq: Sequence
    request: GenerationRequest
    sink: DeltaSink
    detokenizer: IncrementalDetokenizer
    stops: StopStrings | None
    generator: torch.Generator | None
    last_token_s: float = 0.0
    completion_tokens: int = 0


class GenerationEngine:
    """The step loop of one version (module docstring). Thread-safe entry points:
    :meth:`submit`, :meth:`cancel`, :meth:`stop`; :meth:`run` is the loop itself.

    Args:
        model: The loaded model, its tokenizer and KV cache.
        max_running: Most sequences in the running batch.
        max_tokens_per_step: Token budget of one step.
        prefix_caching: Share the KV blocks of equal prompt prefixes.
        publish: Hands each step's deltas to the event loop.
        clock: Monotonic clock, seconds.
        decode_slowdown: While sequences decode, prompt chunks are cut so that a step takes
            at most this many times a decode-only step (learnt from the steps run,
            :mod:`~gpuserve.engine.generate.step_cost`); None: the whole token budget.
    """

    def __init__(
        self,
        model: GenerationModel,
        max_running: int,
        max_tokens_per_step: int,
        prefix_caching: bool,
        publish: Publish,
        clock: Callable[[], float] = time.monotonic,
        decode_slowdown: float | None = None,
    ) -> None:
        self.model = model
        self.clock = clock
        self.publish = publish
        self.blocks = BlockManager(model.num_blocks, model.block_size, prefix_caching)
        self.scheduler = GenerationScheduler(self.blocks, max_running, max_tokens_per_step, clock)
        #: Steps carrying prompt chunks while sequences decode take at most this many times a
        #: decode-only step (None: the whole token budget; see step_cost.py).
        self.decode_slowdown = decode_slowdown
        self.step_cost = StepCost(decode_slowdown or 2.0, model.block_size)
        self.sampler = Sampler(eos_token_ids=model.eos_token_ids)
        self.stats = GenerationStats(kv_blocks=model.num_blocks, block_size=model.block_size)
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._active: dict[int, _Active] = {}
        self._next_id = 0

    # -- thread-safe entries ---------------------------------------------------------------

    def submit(self, request: GenerationRequest, sink: DeltaSink) -> int:
        """Queue one sequence; its deltas go to ``sink``. Returns its id (for cancel)."""
        self._next_id += 1  # only the event loop thread submits
        self._inbox.put(_Submit(self._next_id, request, sink))
        return self._next_id

    def cancel(self, seq_id: int) -> None:
        """End sequence ``seq_id`` (``abort``): freed at the next step, never mid-step."""
        self._inbox.put(_Cancel(seq_id))

    def stop(self) -> None:
        """End the loop after the current step (what is left gets ``abort``)."""
        self._inbox.put(_Stop())

    # -- the loop --------------------------------------------------------------------------

    def run(self) -> None:
        """The loop (module docstring); returns after :meth:`stop`."""
        while True:
            idle = not self._active
            if not self._take_commands(block=idle):
                break
            cap = self.step_cost if self.decode_slowdown is not None else None
            plan = self.scheduler.schedule(cap)
            if plan is None:
                continue
            out: list[tuple[DeltaSink, GenerationDelta]] = []
            self._ended(plan, out)
            if plan.chunks:
                self._step(plan, out)
            self._gauges()
            if out:
                self.publish(out)
        self._abort_all()

    def _take_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one when ``block``); False after a stop."""
        try:
            command = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Submit):
                self._admit(command)
            elif command.seq_id in self._active:
                self.scheduler.cancel(command.seq_id)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _admit(self, command: _Submit) -> None:
        request = command.request
        params = request.params
        seq = Sequence(
            seq_id=command.seq_id,
            request_id=request.request_id,
            prompt_ids=list(request.prompt_ids),
            arrival_s=request.arrival_s or self.clock(),
            deadline_s=request.deadline_s,
            max_tokens=params.max_tokens,
            bulk=request.bulk,
        )
        try:
            self.scheduler.add(seq)
        except GpuserveError as err:
            self.publish([(command.sink, _failed(len(request.prompt_ids), 0, err))])
            return
        generator = make_generator(params, self.model.device)
        self._active[seq.seq_id] = _Active(
            seq,
            request,
            command.sink,
            IncrementalDetokenizer(
                self.model.tokenizer, request.prompt_ids, params.skip_special_tokens
            ),
            StopStrings(params.stop, params.include_stop_str_in_output) if params.stop else None,
            generator,
        )
        self.stats.prompt_tokens += len(request.prompt_ids)

    def _ended(self, plan: StepPlan, out: list[tuple[DeltaSink, GenerationDelta]]) -> None:
        """Deltas of the sequences the scheduler ended before running (cancelled, expired)."""
        for seq in [*plan.aborted, *plan.expired]:
            active = self._active.pop(seq.seq_id, None)
            if active is not None:
                reason = seq.finish_reason or "abort"
                out.append((active.sink, self._final(active, "", [], None, reason)))

    def _step(self, plan: StepPlan, out: list[tuple[DeltaSink, GenerationDelta]]) -> None:
        chunks = plan.chunks
        inputs = [ChunkInput(c.token_ids, c.start, c.seq.block_table, c.samples) for c in chunks]
        sampling = [c for c in chunks if c.samples]
        started = self.clock()
        try:
            batch = StepBatch.build(inputs, self.model.block_size, self.model.device)
            logits = self.model.forward(batch)
            rows = []
            for chunk in sampling:
                active = self._active[chunk.seq.seq_id]
                rows.append(
                    SamplingRow(
                        active.request.params,
                        chunk.seq.prompt_ids,
                        chunk.seq.output_ids,
                        active.generator,
                    )
                )
            sampled = self.sampler(logits, rows) if rows else []
        except Exception as err:  # the step's sequences fail; the others go on
            logger.exception("generation step of %d sequence(s) failed", len(chunks))
            error = BackendError(f"generation failed: {type(err).__name__}: {err}")
            self.scheduler.complete(plan, {})
            for chunk in chunks:
                self._fail(chunk.seq, error, out)
            return
        self.scheduler.complete(
            plan, {c.seq.seq_id: token.token_id for c, token in zip(sampling, sampled, strict=True)}
        )
        self.stats.steps += 1
        self.stats.step_tokens += plan.num_tokens
        now = self.clock()
        prefill = [(c.start, len(c.token_ids)) for c in chunks if len(c.token_ids) > 1]
        self.step_cost.observe(len(chunks) - len(prefill), prefill, now - started)
        for chunk, token in zip(sampling, sampled, strict=True):
            owner = self._active.get(chunk.seq.seq_id)
            if owner is not None:
                self._advance(owner, token, now, out)

    def _advance(
        self,
        active: _Active,
        token: SampledToken,
        now: float,
        out: list[tuple[DeltaSink, GenerationDelta]],
    ) -> None:
        """One sampled token: text, stop conditions, the delta."""
        seq, params = active.seq, active.request.params
        stats = self.stats
        if active.completion_tokens == 0:
            stats.ttft_s.append(now - seq.arrival_s)
        else:
            stats.itl_s.append(now - active.last_token_s)
        active.last_token_s = now
        active.completion_tokens += 1
        stats.generation_tokens += 1
        token_id = token.token_id
        reason: FinishReason | None = None
        emit_token = True
        if not params.ignore_eos and token_id in self.model.eos_token_ids:
            reason, emit_token = "stop", False
        elif token_id in params.stop_token_ids:
            reason, emit_token = "stop", params.include_stop_str_in_output
        text = active.detokenizer.add(token_id) if emit_token else ""
        if active.stops is not None and text:
            text, hit = active.stops.feed(text)
            if hit:
                reason = "stop"
        if reason is None and (
            active.completion_tokens >= params.max_tokens
            or seq.num_tokens >= self.model.context_length
        ):
            reason = "length"
        logprobs = self._logprobs(token) if params.logprobs else None
        if reason is None:
            delta = GenerationDelta(
                text,
                [token_id],
                logprobs,
                False,
                None,
                len(seq.prompt_ids),
                active.completion_tokens,
                seq.num_cached_prompt,
            )
            out.append((active.sink, delta))
            return
        self.scheduler.finish(seq.seq_id, reason)
        del self._active[seq.seq_id]
        out.append((active.sink, self._final(active, text, [token_id], logprobs, reason)))

    def _final(
        self,
        active: _Active,
        text: str,
        token_ids: list[int],
        logprobs: list[TokenLogprob] | None,
        reason: FinishReason,
    ) -> GenerationDelta:
        """The last delta of a sequence: what its detokenizer and stop strings still held."""
        if reason != "stop" or active.stops is None or not active.stops.stopped:
            tail = active.detokenizer.flush()
            if active.stops is not None and not active.stops.stopped:
                kept, _ = active.stops.feed(tail) if tail else ("", False)
                tail = kept + (active.stops.flush() if not active.stops.stopped else "")
            text += tail
        stats = self.stats
        stats.finished[reason] = stats.finished.get(reason, 0) + 1
        seq = active.seq
        stats.e2e_s.append(self.clock() - seq.arrival_s)
        stats.prompt_lengths.append(len(seq.prompt_ids))
        stats.output_lengths.append(active.completion_tokens)
        return GenerationDelta(
            text,
            token_ids,
            logprobs,
            True,
            reason,
            len(seq.prompt_ids),
            active.completion_tokens,
            seq.num_cached_prompt,
        )

    def _fail(
        self, seq: Sequence, error: GpuserveError, out: list[tuple[DeltaSink, GenerationDelta]]
    ) -> None:
        active = self._active.pop(seq.seq_id, None)
        self.scheduler.finish(seq.seq_id, "error")
        if active is not None:
            stats = self.stats
            stats.finished["error"] = stats.finished.get("error", 0) + 1
            delta = _failed(len(seq.prompt_ids), active.completion_tokens, error)
            out.append((active.sink, delta))

    def _logprobs(self, token: SampledToken) -> list[TokenLogprob]:
        decode = self.model.token_text
        top = [TopLogprob(t, decode(t), lp) for t, lp in token.top_logprobs or ()]
        logprob = token.logprob if token.logprob is not None else 0.0
        return [TokenLogprob(token.token_id, decode(token.token_id), logprob, top)]

    def _gauges(self) -> None:
        stats, scheduler = self.stats, self.scheduler
        stats.running = scheduler.num_running
        stats.waiting = scheduler.num_waiting
        stats.kv_usage = self.blocks.usage
        stats.kv_empty_slots = self.blocks.empty_slots
        stats.preemptions = scheduler.num_preemptions
        stats.prefix_query_tokens = self.blocks.prefix_queries_tokens
        stats.prefix_hit_tokens = self.blocks.prefix_hit_tokens

    def _abort_all(self) -> None:
        """At stop: every sequence still here ends with ``abort``."""
        out = []
        for active in list(self._active.values()):
            self.scheduler.finish(active.seq.seq_id, "abort")
            out.append((active.sink, self._final(active, "", [], None, "abort")))
        self._active.clear()
        while True:  # submissions that arrived after the stop
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Submit):
                delta = GenerationDelta(
                    "", [], None, True, "abort", len(command.request.prompt_ids), 0
                )
                out.append((command.sink, delta))
        self._gauges()
        if out:
            self.publish(out)


def _failed(prompt_tokens: int, completion_tokens: int, error: GpuserveError) -> GenerationDelta:
    return GenerationDelta("", [], None, True, "error", prompt_tokens, completion_tokens, 0, error)


__all__ = ["DeltaSink", "GenerationEngine", "Publish"]
