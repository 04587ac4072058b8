"""GPU checks of the causal LM forward over the paged KV cache (skipped without CUDA): the same
random-weight Llama folder (written here with torch and safetensors only: the GPU machine has
no transformers) gives the same logits on CUDA as on the CPU for a step mixing prefill chunks
and decodes, in float32 (SDPA), and close ones in bfloat16 (FlashAttention's paged kernels
when ``flash_attn`` is installed, else SDPA)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpuserve.backends.causal_lm import ChunkInput, StepBatch, load_causal_lm

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB, FFN = 128, 2, 4, 2, 512, 256


def write_llama(folder: Path) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "eos_token_id": 2,
        "bos_token_id": 1,
        "tie_word_embeddings": False,
    }
    (folder / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(0)
    head = HIDDEN // HEADS

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.1

    tensors = {
        "model.embed_tokens.weight": rand(VOCAB, HIDDEN),
        "model.norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": rand(VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(HEADS * head, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * head, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * head, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * head),
            p + "mlp.gate_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.up_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, FFN),
            p + "input_layernorm.weight": torch.ones(HIDDEN),
            p + "post_attention_layernorm.weight": torch.ones(HIDDEN),
        }
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def step_logits(folder: Path, device: str, dtype: torch.dtype, block: int) -> torch.Tensor:
    """Two sequences prefilled (one in two chunks), then a step of two decodes and a third
    sequence's whole prefill: the logits of that last step, float32 on the CPU."""
    loaded = load_causal_lm(folder, dtype, device, load_tokenizer=False)
    model = loaded.model
    model.allocate_cache(64, block)
    a, b, c = list(range(3, 300)), list(range(7, 90)), list(range(11, 40))
    tables = [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [20, 21, 22, 23], [40, 41]]
    if block < 64:
        tables = [list(range(0, 20)), list(range(20, 28)), list(range(40, 44))]

    def run(chunks: list[ChunkInput]) -> torch.Tensor:
        with torch.inference_mode():
            return model.forward(StepBatch.build(chunks, block, device))

    run([ChunkInput(a[:150], 0, tables[0], False), ChunkInput(b, 0, tables[1], True)])
    run([ChunkInput(a[150:], 150, tables[0], True)])
    logits = run(
        [
            ChunkInput([5], len(a), tables[0], True),
            ChunkInput([6], len(b), tables[1], True),
            ChunkInput(c, 0, tables[2], True),
        ]
    )
    return logits.float().cpu()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama(tmp_path_factory.mktemp("llama") / "tiny")


def test_float32_on_cuda_equals_the_cpu(folder: Path) -> None:
    cpu = step_logits(folder, "cpu", torch.float32, 16)
    cuda = step_logits(folder, "cuda", torch.float32, 16)
    torch.testing.assert_close(cuda, cpu, atol=2e-3, rtol=2e-3)
    assert torch.equal(cuda.argmax(-1), cpu.argmax(-1))


def test_bfloat16_on_cuda_is_close_to_the_cpu(folder: Path) -> None:
    cpu = step_logits(folder, "cpu", torch.float32, 256)
    cuda = step_logits(folder, "cuda", torch.bfloat16, 256)  # 256: FlashAttention's blocks
    assert (cuda - cpu).abs().max() < 0.15
    assert (cuda.argmax(-1) == cpu.argmax(-1)).float().mean() >= 2 / 3


def test_decode_steps_replayed_from_cuda_graphs_equal_eager_ones(folder: Path) -> None:
    """Record the decode graphs (FlashAttention, bfloat16, blocks of 256), then replay steps
    of 1, 3 and 5 decodes (buckets 1, 4 and 8): the logits equal the eager step's."""
    pytest.importorskip("flash_attn")
    from gpuserve.backends.causal_lm.graphs import DecodeGraphs

    block, blocks = 256, 16
    loaded = load_causal_lm(folder, torch.bfloat16, "cuda", load_tokenizer=False)
    model = loaded.model
    model.allocate_cache(blocks + 1, block)
    assert model.attention_name == "flash_attn"
    graphs = DecodeGraphs(
        model.forward, torch.device("cuda"), block, 4, blocks, max_batch=8, capture=True
    )
    graphs.capture_all()
    prompts = [list(range(3 + i, 40 + 37 * i)) for i in range(5)]
    tables = [[2 * i, 2 * i + 1] for i in range(5)]
    with torch.inference_mode():
        for prompt, table in zip(prompts, tables, strict=True):
            model.forward(StepBatch.build([ChunkInput(prompt, 0, table, True)], block, "cuda"))
        for n in (1, 3, 5):
            chunks = [ChunkInput([9 + i], len(prompts[i]), tables[i], True) for i in range(n)]
            batch = StepBatch.build(chunks, block, "cuda")
            assert graphs.takes(batch)
            eager = model.forward(batch).float()
            replayed = graphs.run(batch).float()
            torch.testing.assert_close(replayed, eager, atol=2e-2, rtol=2e-2)
