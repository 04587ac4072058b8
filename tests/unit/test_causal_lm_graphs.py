"""Decode steps on the static buffers of CUDA graphs (gpuserve.backends.causal_lm.graphs).

On a CPU the static step runs without capture: it must give the logits of the eager step,
whatever the padding (rows past the step's decodes, block tables past each sequence, keys
past each context), so that replaying a recorded graph is the same computation. The
capture itself is checked on CUDA by tests/gpu/test_generate_gpu.py.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from gpuserve.backends.causal_lm import ChunkInput, StepBatch, load_causal_lm
from gpuserve.backends.causal_lm.graphs import DecodeGraphs, bucket_sizes, width_buckets

transformers = pytest.importorskip("transformers")

VOCAB, BLOCK, CONTEXT = 256, 4, 64
NUM_BLOCKS = 40  # the sequences' blocks; block 40 is the scratch block


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    torch.manual_seed(7)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=CONTEXT,
        initializer_range=0.2,
    )
    folder: Path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).eval().save_pretrained(folder)
    loaded = load_causal_lm(folder, torch.float32, "cpu", load_tokenizer=False)
    loaded.model.allocate_cache(NUM_BLOCKS + 1, BLOCK)
    return loaded.model


def graphs_of(model, max_batch: int = 8) -> DecodeGraphs:
    return DecodeGraphs(
        model.forward,
        torch.device("cpu"),
        BLOCK,
        max_blocks=CONTEXT // BLOCK,
        scratch_block=NUM_BLOCKS,
        max_batch=max_batch,
        capture=False,
    )


def prefilled(model, lengths: list[int], seed: int) -> list[tuple[list[int], list[int]]]:
    """Sequences of ``lengths`` tokens, prefilled into disjoint blocks: (tokens, table)."""
    rng = random.Random(seed)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    sequences = []
    for length in lengths:
        table = [free.pop() for _ in range(-(-(length + 8) // BLOCK))]
        tokens = [rng.randrange(VOCAB) for _ in range(length)]
        model.forward(StepBatch.build([ChunkInput(tokens, 0, table, sample=True)], BLOCK))
        sequences.append((tokens, table))
    return sequences


def decode_step(sequences, next_tokens: list[int]) -> StepBatch:
    return StepBatch.build(
        [
            ChunkInput([token], len(tokens), table, sample=True)
            for (tokens, table), token in zip(sequences, next_tokens, strict=True)
        ],
        BLOCK,
    )


def test_bucket_sizes() -> None:
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(6) == (1, 2, 4, 6)
    assert bucket_sizes(32) == (1, 2, 4, 8, 16, 24, 32)
    assert bucket_sizes(20) == (1, 2, 4, 8, 16, 20)
    with pytest.raises(ValueError, match="max_batch"):
        bucket_sizes(0)
    assert width_buckets(16, in_place=False) == (1, 2, 4, 8, 16)
    assert width_buckets(12, in_place=False) == (1, 2, 4, 8, 12)
    assert width_buckets(12, in_place=True) == (12,)


@pytest.mark.parametrize("lengths", [[5], [3, 17, 9], [1, 2, 30, 7, 12]])
def test_the_padded_static_step_gives_the_eager_logits(model, lengths: list[int]) -> None:
    sequences = prefilled(model, lengths, seed=len(lengths))
    graphs = graphs_of(model)
    rng = random.Random(3)
    widths = set()
    for _ in range(3):  # several steps: each writes its K/V where the eager step would
        tokens = [rng.randrange(VOCAB) for _ in sequences]
        batch = decode_step(sequences, tokens)
        assert graphs.takes(batch)
        widths.add(graphs.width(int(batch.decode.block_tables.shape[1])))
        cache = [k.clone() for k in model.cache.keys]
        eager = model.forward(batch)
        after_eager = [k.clone() for k in model.cache.keys]
        for layer, saved in zip(model.cache.keys, cache, strict=True):
            layer.copy_(saved)  # the static step writes the same slots again
        static = graphs.run(batch)
        assert static.shape == eager.shape == (len(sequences), VOCAB)
        torch.testing.assert_close(static, eager, atol=1e-5, rtol=1e-5)
        for layer, expected in zip(model.cache.keys, after_eager, strict=True):
            owned = layer[:NUM_BLOCKS]  # padding touches the scratch block only
            torch.testing.assert_close(owned, expected[:NUM_BLOCKS])
        for seq, token in zip(sequences, tokens, strict=True):
            seq[0].append(token)
    assert graphs.replays == 3
    assert widths <= set(graphs.widths)


def test_steps_a_graph_does_not_take(model) -> None:
    graphs = graphs_of(model, max_batch=2)
    sequences = prefilled(model, [4, 6, 8], seed=9)
    assert not graphs.takes(decode_step(sequences, [1, 2, 3]))  # past the largest bucket
    prefill = StepBatch.build(
        [
            ChunkInput([1, 2, 3], 0, sequences[0][1], sample=True),
            ChunkInput([5], len(sequences[1][0]), sequences[1][1], sample=True),
        ],
        BLOCK,
    )
    assert not graphs.takes(prefill)  # a prefill chunk runs eagerly
    unsampled = StepBatch.build(
        [ChunkInput([5], len(sequences[1][0]), sequences[1][1], sample=False)], BLOCK
    )
    assert not graphs.takes(unsampled)


def test_capture_needs_cuda(model) -> None:
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(model.forward, torch.device("cpu"), BLOCK, 4, NUM_BLOCKS, 4, capture=True)
