"""The generation engine's step loop on tiny random Llama, Qwen2 and GPT-2 models, against
transformers' greedy output.

32 concurrent sequences of mixed prompt lengths go through one engine: the token ids of every
greedy sequence must be transformers' own, with the prefill chunked (a small token budget),
with prefix caching on and off, and with a KV cache small enough that sequences are preempted
and recomputed. Seeded sampling must repeat, and a cancelled sequence must free its blocks.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from gpuserve.backends.causal_lm import load_causal_lm
from gpuserve.backends.causal_lm.backend import GenerationModel
from gpuserve.backends.causal_lm.params import SamplingParams
from gpuserve.engine.generate.engine import DeltaSink, GenerationEngine
from gpuserve.engine.generate.messages import GenerationDelta, GenerationRequest
from tests.fixtures.chat_models import write_tiny_chat

transformers = pytest.importorskip("transformers")

BLOCK = 4


FAMILIES = ("llama", "qwen2", "gpt2")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat")
    return {f: write_tiny_chat(root / f, max_positions=2048, family=f) for f in FAMILIES}


@pytest.fixture(scope="module")
def references(folders: dict[str, Path]) -> dict[str, Any]:
    return {
        family: transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), local_files_only=True
        ).eval()
        for family, folder in folders.items()
    }


@pytest.fixture(scope="module")
def folder(folders: dict[str, Path]) -> Path:
    return folders["llama"]


@pytest.fixture(scope="module")
def reference(references: dict[str, Any]) -> Any:
    return references["llama"]


def _greedy(reference: Any, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = reference.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def _model(folder: Path, num_blocks: int) -> GenerationModel:
    loaded = load_causal_lm(folder)
    loaded.model.allocate_cache(num_blocks, BLOCK)
    return GenerationModel(
        loaded=loaded,
        device="cpu",
        num_blocks=num_blocks,
        block_size=BLOCK,
        context_length=2048,
        eos_token_ids=loaded.eos_token_ids,
        chat_template=loaded.chat_template,
    )


class _Collect(DeltaSink):
    def __init__(self) -> None:
        self.deltas: list[GenerationDelta] = []
        self.done = threading.Event()

    def deliver(self, delta: GenerationDelta) -> None:
        self.deltas.append(delta)
        if delta.finished:
            self.done.set()

    @property
    def token_ids(self) -> list[int]:
        return [t for d in self.deltas for t in d.token_ids]


class _Harness:
    """An engine on its own thread whose publish delivers straight to the sinks."""

    def __init__(self, model: GenerationModel, budget: int, prefix: bool, running: int = 64):
        self.engine = GenerationEngine(model, running, budget, prefix, self._publish)
        self.thread = threading.Thread(target=self.engine.run, daemon=True)
        self.thread.start()

    @staticmethod
    def _publish(deltas: list[tuple[DeltaSink, GenerationDelta]]) -> None:
        for sink, delta in deltas:
            sink.deliver(delta)

    def submit(self, prompt: list[int], params: SamplingParams) -> tuple[int, _Collect]:
        sink = _Collect()
        return self.engine.submit(GenerationRequest("r", prompt, params), sink), sink

    def close(self) -> None:
        self.engine.stop()
        self.thread.join(30)


def _prompts(
    count: int, seed: int, shared: list[int] | None = None, longest: int = 40
) -> list[list[int]]:
    """``count`` prompts of 5 to ``longest`` tokens (one of them ``longest`` long)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        length = longest if i == count // 2 else rng.randrange(5, max(6, longest // 4))
        body = [rng.randrange(3, 380) for _ in range(length)]
        out.append([*(shared or []), *body])
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    ("budget", "prefix", "num_blocks"),
    [
        (61, False, 2048),  # chunked prefill: the 1,500-token prompt in 25 chunks (the
        # short prompts fit one chunk: prefilled whole)
        (64, True, 2048),  # prefix caching, chunked
        (256, True, 420),  # too few blocks for everyone: preemption by recompute
    ],
    ids=["chunked", "prefix", "preempt"],
)
def test_32_concurrent_greedy_sequences_equal_transformers(
    folders: dict[str, Path],
    references: dict[str, Any],
    family: str,
    budget: int,
    prefix: bool,
    num_blocks: int,
) -> None:
    folder, reference = folders[family], references[family]
    shared = list(range(10, 30)) if prefix else None
    prompts = _prompts(32, seed=budget, shared=shared, longest=1500)
    lengths = [random.Random(i).randrange(1, 12) for i in range(32)]
    harness = _Harness(_model(folder, num_blocks), budget, prefix)
    try:
        sinks = [
            harness.submit(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[1]
            for p, n in zip(prompts, lengths, strict=True)
        ]
        for sink in sinks:
            assert sink.done.wait(60)
    finally:
        harness.close()
    for prompt, n, sink in zip(prompts, lengths, sinks, strict=True):
        assert sink.token_ids == _greedy(reference, prompt, n)
        final = sink.deltas[-1]
        assert final.finish_reason == "length"
        assert (final.prompt_tokens, final.completion_tokens) == (len(prompt), n)
    stats = harness.engine.stats
    assert harness.engine.blocks.num_free == num_blocks  # every block back
    if prefix:
        assert harness.engine.blocks.prefix_hit_tokens > 0
        assert any(s.deltas[-1].cached_tokens > 0 for s in sinks)
    if num_blocks == 420:
        assert stats.preemptions > 0


def test_seeded_sampling_repeats_whatever_runs_beside_it(folder: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    harness = _Harness(_model(folder, 256), 64, False)
    try:
        _, alone = harness.submit(prompt, params)
        assert alone.done.wait(30)
        others = [harness.submit(p, SamplingParams(max_tokens=12))[1] for p in _prompts(6, 1)]
        _, crowded = harness.submit(prompt, params)
        assert crowded.done.wait(30)
        for sink in others:
            assert sink.done.wait(30)
    finally:
        harness.close()
    assert crowded.token_ids == alone.token_ids


def test_a_cancelled_sequence_ends_with_abort_and_frees_its_blocks(folder: Path) -> None:
    harness = _Harness(_model(folder, 256), 64, False)
    try:
        seq_id, sink = harness.submit([5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True))
        while not sink.deltas:
            threading.Event().wait(0.005)
        harness.engine.cancel(seq_id)
        assert sink.done.wait(30)
    finally:
        harness.close()
    final = sink.deltas[-1]
    assert final.finish_reason == "abort"
    assert 0 < final.completion_tokens < 400
    assert harness.engine.blocks.num_free == 256


def test_a_stop_token_id_ends_the_sequence_with_stop_and_is_left_out(
    folder: Path, reference: Any
) -> None:
    prompt = [5, 6, 7, 8]
    expected = _greedy(reference, prompt, 12)
    cut = next(i for i in range(1, 12) if expected[i] not in expected[:i])
    harness = _Harness(_model(folder, 256), 64, False)
    tokenizer = harness.engine.model.tokenizer
    try:
        _, sink = harness.submit(
            prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(expected[cut],))
        )
        assert sink.done.wait(30)
    finally:
        harness.close()
    assert sink.deltas[-1].finish_reason == "stop"
    assert sink.deltas[-1].completion_tokens == cut + 1
    text = "".join(d.text for d in sink.deltas)
    assert text == tokenizer.decode(expected[:cut], skip_special_tokens=True)


def test_long_prompts_are_cut_so_decodes_keep_their_pace(folder: Path) -> None:
    """With ``decode_slowdown`` 2, once the engine has timed decode-only steps and a prefill
    (a clock the model advances by 10 ms a step plus 1 ms a token), every step carrying a
    prompt chunk while sequences decode takes about twice a step of its decodes alone (its
    prompt tokens about (2 - 1) x decode step / token cost, 12 to 14), and the long prompts
    still complete."""
    model = _model(folder, 512)
    now = [0.0]
    steps: list[tuple[int, int]] = []  # (decodes, prompt tokens) of each step
    forward = model.loaded.model.forward

    def timed(batch: Any) -> Any:
        decodes = 0 if batch.decode is None else int(batch.decode.rows.shape[0])
        steps.append((decodes, batch.num_tokens - decodes))
        now[0] += 0.010 + 0.001 * batch.num_tokens
        return forward(batch)

    model.loaded.model.forward = timed  # type: ignore[method-assign]
    engine = GenerationEngine(
        model,
        8,
        256,
        False,
        lambda deltas: [s.deliver(d) for s, d in deltas],
        clock=lambda: now[0],
        decode_slowdown=2.0,
    )
    thread = threading.Thread(target=engine.run, daemon=True)
    thread.start()
    try:
        params = SamplingParams(max_tokens=120, ignore_eos=True)
        short = [_Collect(), _Collect()]
        for prompt, sink in zip(([5, 6, 7], [8, 9, 10, 11]), short, strict=True):
            engine.submit(GenerationRequest("s", prompt, params), sink)
        while sum(len(s.deltas) for s in short) < 20:  # decoding, decode steps timed
            threading.Event().wait(0.005)
        first = len(steps)
        engine.submit(GenerationRequest("l", list(range(3, 203)), params), long := _Collect())
        engine.submit(GenerationRequest("l2", list(range(3, 203)), params), late := _Collect())
        assert all(s.done.wait(60) for s in (*short, long, late))
    finally:
        engine.stop()
        thread.join(30)
    mixed = [prompt for decodes, prompt in steps[first:] if decodes and prompt]
    assert mixed, "the prompts were prefilled while the short sequences decoded"
    # the first may precede the per-token cost being learnt; the prior for its growth with
    # position lets a chunk at position 0 a few tokens more than flat costs would
    for decodes, prompt in [(d, p) for d, p in steps[first:] if d and p][1:]:
        alone = 0.010 + 0.001 * decodes
        assert alone + 0.001 * prompt <= 2.1 * alone or prompt <= BLOCK
    assert long.deltas[-1].completion_tokens == 120 and late.deltas[-1].completion_tokens == 120
