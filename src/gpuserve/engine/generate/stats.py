"""Statistics of one generative model version, kept by its engine and read by ``metrics/``.

The engine thread writes; the metrics collector reads at scrape time. Counters only grow;
gauges are the engine's state after its last step; latency samples are drained by the reader
(each observed once). Plain attribute writes of ints and floats are atomic under the GIL,
and the sample lists are swapped whole, so no lock is needed on the step path.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class GenerationStats:
    """Counters, gauges and latency samples of one version's generation engine.

    Attributes:
        prompt_tokens: Prompt tokens of finished and running sequences, total.
        generation_tokens: Tokens generated, total.
        prefix_query_tokens: Prompt tokens looked up in the prefix cache, total.
        prefix_hit_tokens: Of those, tokens found (their KV reused), total.
        preemptions: Sequences preempted (their KV freed, recomputed later), total.
        finished: Sequences ended, by reason (``stop``, ``length``, ``abort``, ``timeout``,
            ``error``).
        steps: Engine steps run, total.
        step_tokens: Tokens computed by those steps, total.
        running: Sequences in the running batch after the last step.
        waiting: Sequences waiting for a slot after the last step.
        kv_usage: Fraction of KV cache blocks held by sequences, 0..1.
        kv_blocks: Blocks of the KV cache.
        block_size: Tokens per block.
        kv_empty_slots: Token slots in held blocks that hold no computed token.
        ttft_s: Time-to-first-token samples since the last drain, seconds.
        itl_s: Inter-token latency samples since the last drain, seconds.
        e2e_s: End-to-end latency samples of finished sequences since the last drain, s.
        prompt_lengths: Prompt token counts of finished sequences since the last drain.
        output_lengths: Generated token counts of finished sequences since the last drain.
    """

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    step_tokens: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    kv_blocks: int = 0
    block_size: int = 0
    kv_empty_slots: int = 0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    prompt_lengths: list[int] = field(default_factory=list)
    output_lengths: list[int] = field(default_factory=list)

    def drain(self) -> LatencySamples:
        """Take the latency samples gathered since the last call (each is read once)."""
        taken = LatencySamples(
            self.ttft_s, self.itl_s, self.e2e_s, self.prompt_lengths, self.output_lengths
        )
        self.ttft_s, self.itl_s, self.e2e_s = [], [], []
        self.prompt_lengths, self.output_lengths = [], []
        return taken


@dataclass(slots=True)
class LatencySamples:
    """Samples taken by :meth:`GenerationStats.drain` (seconds, and token counts)."""

    ttft_s: list[float]
    itl_s: list[float]
    e2e_s: list[float]
    prompt_lengths: list[int]
    output_lengths: list[int]


__all__ = ["GenerationStats", "LatencySamples"]
