"""The causal LM forward pass over a paged KV cache, against transformers on tiny random models.

Each family (Llama with grouped-query attention, Mistral, Qwen2, Qwen3, GPT-2) is built with
transformers at test time (hidden 64, 2 layers, vocab 256), saved as a folder and loaded with
``load_causal_lm``; the logits and the greedy tokens must be transformers' own.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from gpuserve.backends.causal_lm import (
    ChunkInput,
    LoadedCausalLM,
    StepBatch,
    load_causal_lm,
)
from gpuserve.backends.causal_lm.architectures import RopeSpec
from gpuserve.errors import ConfigError

transformers = pytest.importorskip("transformers")

VOCAB = 256
BLOCK = 4


def _llama() -> Any:
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        initializer_range=0.2,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )
    return transformers.LlamaForCausalLM(config)


def _llama3_rope() -> Any:
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        initializer_range=0.2,
        tie_word_embeddings=True,
        attention_bias=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    return transformers.LlamaForCausalLM(config)


def _mistral() -> Any:
    config = transformers.MistralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        sliding_window=None,
        initializer_range=0.2,
    )
    return transformers.MistralForCausalLM(config)


def _qwen2() -> Any:
    config = transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        initializer_range=0.2,
    )
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():  # biases start at zero; make them count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def _qwen3() -> Any:
    config = transformers.Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        initializer_range=0.2,
        tie_word_embeddings=True,
    )
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():  # the q/k norm scales start at one; make them count
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return model


def _gpt2() -> Any:
    config = transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=128, initializer_range=0.2
    )
    return transformers.GPT2LMHeadModel(config)


FAMILIES: dict[str, Callable[[], Any]] = {
    "llama": _llama,
    "llama3-rope-tied-bias": _llama3_rope,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gpt2": _gpt2,
}


@dataclass
class Tiny:
    reference: Any  # the transformers model
    loaded: LoadedCausalLM


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    torch.manual_seed(1234)
    reference = FAMILIES[request.param]().eval()
    folder = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(folder)
    return Tiny(reference, load_causal_lm(folder, torch.float32, "cpu", load_tokenizer=False))


def _reference_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_logits_at_every_chunk_end_equal_transformers(tiny: Tiny) -> None:
    model = tiny.loaded.model
    model.allocate_cache(num_blocks=24, block_size=BLOCK)
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (17, 9)]
    tables = [[20, 3, 11, 7, 0], [5, 14, 9]]
    splits = [[1, 3, 5, 2, 6], [4, 1, 4]]  # odd chunk sizes, including one-token chunks
    got: list[list[torch.Tensor]] = [[], []]
    ends: list[list[int]] = [[], []]
    starts = [0, 0]
    for step in range(max(len(s) for s in splits)):
        chunks, owners = [], []
        for seq, split in enumerate(splits):
            if step >= len(split):
                continue
            length = split[step]
            start = starts[seq]
            chunks.append(
                ChunkInput(prompts[seq][start : start + length], start, tables[seq], sample=True)
            )
            owners.append(seq)
            starts[seq] += length
            ends[seq].append(starts[seq] - 1)
        logits = model.forward(StepBatch.build(chunks, BLOCK))
        assert logits.shape == (len(chunks), VOCAB)
        assert logits.dtype == torch.float32
        for row, seq in enumerate(owners):
            got[seq].append(logits[row])
    for seq, prompt in enumerate(prompts):
        reference = _reference_logits(tiny.reference, prompt)
        for position, logits in zip(ends[seq], got[seq], strict=True):
            torch.testing.assert_close(logits, reference[position], atol=1e-4, rtol=1e-4)


@dataclass
class _Sequence:
    prompt: list[int]
    splits: list[int]
    begin_step: int
    table: list[int]
    done_prefill: int = 0
    generated: list[int] = field(default_factory=list)


def _greedy_paged(
    loaded: LoadedCausalLM, prompts: list[list[int]], new_tokens: int
) -> list[list[int]]:
    """Greedy decoding of ``prompts`` together, as an engine would schedule them: prompts
    prefilled in odd-sized chunks while others decode, sequences joining at different steps,
    blocks handed out shuffled."""
    model = loaded.model
    model.allocate_cache(num_blocks=64, block_size=BLOCK)
    free = list(range(64))
    random.Random(7).shuffle(free)
    split_plans = [[3, 5, 1, 7, 2, 9], [1, 1, 4], [2, 6, 3, 3]]
    seqs = []
    for i, prompt in enumerate(prompts):
        plan, splits, left = split_plans[i % len(split_plans)], [], len(prompt)
        for size in plan * 10:
            if left == 0:
                break
            splits.append(min(size, left))
            left -= splits[-1]
        blocks = -(-(len(prompt) + new_tokens) // BLOCK)
        table, free = free[:blocks], free[blocks:]
        seqs.append(_Sequence(prompt, splits, begin_step=i, table=table))
    step = 0
    while any(len(s.generated) < new_tokens for s in seqs):
        chunks, owners = [], []
        # rotate the order of the sequences from step to step
        active = [s for s in seqs if s.begin_step <= step and len(s.generated) < new_tokens]
        active = active[step % max(len(active), 1) :] + active[: step % max(len(active), 1)]
        for seq in active:
            if seq.done_prefill < len(seq.prompt):
                size = seq.splits.pop(0)
                start = seq.done_prefill
                seq.done_prefill += size
                sample = seq.done_prefill == len(seq.prompt)
                tokens = seq.prompt[start : start + size]
            else:
                start = len(seq.prompt) + len(seq.generated) - 1
                tokens, sample = [seq.generated[-1]], True
            chunks.append(ChunkInput(tokens, start, seq.table, sample))
            if sample:
                owners.append(seq)
        step += 1
        if not chunks:
            continue
        logits = model.forward(StepBatch.build(chunks, BLOCK))
        assert logits.shape[0] == len(owners)
        for row, seq in enumerate(owners):
            seq.generated.append(int(logits[row].argmax()))
    return [s.generated for s in seqs]


def test_greedy_decode_through_the_paged_cache_equals_generate(tiny: Tiny) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (13, 1, 6, 22)]
    new_tokens = 9
    got = _greedy_paged(tiny.loaded, prompts, new_tokens)
    for prompt, tokens in zip(prompts, got, strict=True):
        with torch.no_grad():
            out = tiny.reference.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert tokens == out[0, len(prompt) :].tolist()


def test_info_and_cache_shapes(tiny: Tiny) -> None:
    model, config = tiny.loaded.model, tiny.reference.config
    info = model.info
    assert info.vocab_size == VOCAB
    assert info.num_layers == 2
    assert info.dtype == torch.float32
    assert info.architecture == config.architectures[0]
    cache = model.allocate_cache(num_blocks=5, block_size=8)
    assert len(cache.keys) == len(cache.values) == 2
    shape = (5, 8, info.num_kv_heads, info.head_dim)
    assert all(t.shape == shape and t.dtype == torch.float32 for t in cache.keys + cache.values)
    per_block = 2 * 2 * 8 * info.num_kv_heads * info.head_dim * 4
    assert model.cache_bytes_per_block(8) == per_block
    assert model.attention_name == "sdpa"
    assert tiny.loaded.context_length == 128
    assert tiny.loaded.tokenizer is None


def test_bfloat16_runs_close_to_float32(tmp_path: Path) -> None:
    torch.manual_seed(0)
    reference = _llama().eval()
    reference.save_pretrained(tmp_path)
    loaded = load_causal_lm(tmp_path, torch.bfloat16, "cpu", load_tokenizer=False)
    model = loaded.model
    cache = model.allocate_cache(num_blocks=8, block_size=BLOCK)
    assert cache.keys[0].dtype == torch.bfloat16
    assert model.cache_bytes_per_block(BLOCK) == 2 * 2 * BLOCK * 2 * 16 * 2
    prompt = list(range(10, 30))
    logits = model.forward(StepBatch.build([ChunkInput(prompt, 0, list(range(8)), True)], BLOCK))
    assert logits.dtype == torch.float32
    expected = _reference_logits(reference, prompt)[-1]
    assert (logits[0] - expected).abs().max() < 0.1 * expected.abs().max()


def test_pytorch_model_bin_folder(tmp_path: Path) -> None:
    torch.manual_seed(0)
    reference = _gpt2().eval()
    reference.config.save_pretrained(tmp_path)
    torch.save(reference.state_dict(), tmp_path / "pytorch_model.bin")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    loaded = load_causal_lm(tmp_path, torch.float32, "cpu", load_tokenizer=False)
    assert loaded.eos_token_ids == (7, 9)
    assert loaded.name == tmp_path.name
    model = loaded.model
    model.allocate_cache(num_blocks=8, block_size=BLOCK)
    prompt = [5, 17, 99, 3, 250, 8]
    logits = model.forward(StepBatch.build([ChunkInput(prompt, 0, [4, 2], True)], BLOCK))
    torch.testing.assert_close(
        logits[0], _reference_logits(reference, prompt)[-1], atol=1e-4, rtol=1e-4
    )


def test_step_batch_layout() -> None:
    batch = StepBatch.build(
        [
            ChunkInput([1, 2, 3], 0, [7, 2], sample=False),
            ChunkInput([4], 5, [3, 9], sample=True),
            ChunkInput([5, 6], 3, [6, 1], sample=True),
        ],
        block_size=4,
    )
    assert batch.token_ids.tolist() == [1, 2, 3, 4, 5, 6]
    assert batch.positions.tolist() == [0, 1, 2, 5, 3, 4]
    assert batch.slot_mapping.tolist() == [28, 29, 30, 37, 27, 4]
    assert batch.logits_rows.tolist() == [3, 5]
    assert batch.query_starts == [0, 3, 4]
    assert batch.context_lens == [3, 6, 5]
    assert batch.decode is not None
    assert batch.decode.rows.tolist() == [3]
    assert batch.decode.key_mask.shape == (1, 1, 1, 8)
    assert batch.decode.key_mask.sum().item() == 6
    assert [p.mask is None for p in batch.prefills] == [True, False]
    second = batch.prefills[1]
    assert second.mask is not None
    assert second.mask.tolist() == [[True] * 4 + [False], [True] * 5]


def test_decodes_of_far_apart_contexts_attend_in_buckets() -> None:
    """A decode at 100 keys beside decodes at 3 to 9 keys gets a bucket of its own, so the
    short ones are not padded to 100 keys; contexts close together stay in one call."""
    long_table = list(range(10, 35))  # 25 blocks of 4
    batch = StepBatch.build(
        [
            ChunkInput([1], 2, [0], sample=True),
            ChunkInput([2], 99, long_table, sample=True),
            ChunkInput([3], 8, [1, 2, 3], sample=True),
        ],
        block_size=4,
    )
    decode = batch.decode
    assert decode is not None and decode.block_tables.shape == (3, 25)  # the whole group
    assert [b.index.tolist() for b in decode.buckets] == [[0, 2], [1]]
    short, long = decode.buckets
    assert short.block_tables.tolist() == [[0, 0, 0], [1, 2, 3]]
    assert short.key_mask.shape == (2, 1, 1, 12)
    assert short.key_mask.sum(dim=-1).flatten().tolist() == [3, 9]
    assert long.block_tables.tolist() == [long_table] and long.key_mask.all()
    close = StepBatch.build(
        [ChunkInput([1], 2, [0], sample=True), ChunkInput([2], 60, long_table, sample=True)],
        block_size=4,
    )
    assert close.decode is not None and close.decode.buckets == ()  # 16 blocks apart


def test_bucketed_decodes_give_the_logits_of_each_decode_alone(tiny: Tiny) -> None:
    model = tiny.loaded.model
    model.allocate_cache(num_blocks=40, block_size=BLOCK)
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 100, 7)]
    tables = [[0, 1], list(range(2, 28)), [28, 29, 30]]
    for prompt, table in zip(prompts, tables, strict=True):
        model.forward(StepBatch.build([ChunkInput(prompt, 0, table, False)], BLOCK))
    decodes = [
        ChunkInput([rng.randrange(VOCAB)], len(prompt), table, True)
        for prompt, table in zip(prompts, tables, strict=True)
    ]
    batch = StepBatch.build(decodes, BLOCK)
    assert batch.decode is not None and len(batch.decode.buckets) == 2
    together = model.forward(batch)
    for row, chunk in enumerate(decodes):  # the same K/V written again: same logits
        alone = model.forward(StepBatch.build([chunk], BLOCK))
        torch.testing.assert_close(together[row], alone[0], rtol=1e-5, atol=1e-5)


def test_step_batch_refuses_a_short_block_table() -> None:
    with pytest.raises(ValueError, match="cannot hold 9 positions"):
        StepBatch.build([ChunkInput([1, 2], 7, [0, 1], sample=True)], block_size=4)
    with pytest.raises(ValueError, match="at least one chunk"):
        StepBatch.build([], block_size=4)


def test_forward_needs_a_cache(tmp_path: Path) -> None:
    _llama().save_pretrained(tmp_path)
    model = load_causal_lm(tmp_path, load_tokenizer=False).model
    batch = StepBatch.build([ChunkInput([1], 0, [0], True)], block_size=4)
    with pytest.raises(RuntimeError, match="allocate_cache"):
        model.forward(batch)
    model.allocate_cache(4, 8)
    with pytest.raises(RuntimeError, match="blocks of 4 tokens"):
        model.forward(batch)


def _write_config(folder: Path, **changes: Any) -> None:
    _llama().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_unknown_architecture_is_a_config_error(tmp_path: Path) -> None:
    _write_config(tmp_path, architectures=["FalconForCausalLM"])
    with pytest.raises(ConfigError, match=r"FalconForCausalLM.*supported: LlamaForCausalLM"):
        load_causal_lm(tmp_path, load_tokenizer=False)


def test_unknown_rope_scaling_is_a_config_error(tmp_path: Path) -> None:
    _write_config(tmp_path, rope_parameters={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ConfigError, match="rope type 'yarn' is not supported"):
        load_causal_lm(tmp_path, load_tokenizer=False)


def test_missing_tensor_is_a_config_error(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    _llama().save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_causal_lm(tmp_path, load_tokenizer=False)


def test_not_a_model_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no config\.json"):
        load_causal_lm(tmp_path, load_tokenizer=False)
    with pytest.raises(ConfigError, match=r"folder or a \.gguf file"):
        load_causal_lm(tmp_path / "absent.bin", load_tokenizer=False)


def test_linear_rope_scaling_slows_the_angles() -> None:
    plain = RopeSpec(theta=10000.0, dim=8).inv_freq()
    linear = RopeSpec(theta=10000.0, dim=8, rope_type="linear", factor=2.0).inv_freq()
    torch.testing.assert_close(linear, plain / 2)
