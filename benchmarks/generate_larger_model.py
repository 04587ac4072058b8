#!/usr/bin/env python3
"""A larger chat model for the generation benchmark, made here without a download.

SmolLM2-360M-Instruct's published architecture (llama: hidden 960, 32 layers, 15 attention
heads over 5 KV heads of 64, intermediate 2,560, vocabulary 49,152, RoPE theta 100,000, RMS
epsilon 1e-5, tied embeddings, context 8,192) with seeded random weights of a realistic scale
(normal, std 0.02; norms 1.0), written as a GGUF quantised like the embedded
SmolLM2-135M-Instruct file: Q4_1 for every matrix of a block, Q8_0 for the token embedding,
float32 for the norms. The tokenizer, chat template and every metadata key that is not part of
the architecture are copied from that file (``general.name`` and ``general.size_label`` say
what this one is). Random weights answer gibberish: the benchmark measures speed, greedy with
EOS ignored, so every answer is exactly ``max_tokens`` long whatever it says.

The GGUF is then converted once to a Hugging Face folder (``hf/`` beside it) for
``transformers serve``, with ``benchmarks/peers/gguf_to_hf.py``, as ``setup_generate.sh`` does
for the 135M model; ``generate.py --model-dir DIR/smollm2-360m-random.Q4_1.gguf`` then serves
the GGUF with gpuserve and llama.cpp and that folder with transformers.

    .venv/bin/python benchmarks/generate_larger_model.py            # ~1 min, ~260 MB + 1.5 GB
    .venv/bin/python benchmarks/generate_larger_model.py --check    # + one answer from each server
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import generate_peers  # noqa: E402

DEFAULT_OUT = generate_peers.peers_root() / "smollm2-360m-random"
CONVERT = HERE / "peers" / "gguf_to_hf.py"
ARCH = "llama"


@dataclass(frozen=True)
class LlamaShape:
    """The sizes of a llama-architecture model (the GGUF ``llama.*`` keys).

    Attributes:
        hidden: ``embedding_length``, the residual width.
        layers: ``block_count``.
        heads: Query heads; head_dim = hidden / heads.
        kv_heads: Key/value heads (grouped-query attention).
        intermediate: ``feed_forward_length``, the SwiGLU width.
        vocab: Rows of the token embedding (the tokenizer's size).
        context: ``context_length`` in tokens.
        rope_theta: ``rope.freq_base``.
        rms_eps: ``attention.layer_norm_rms_epsilon``.
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    context: int
    rope_theta: float
    rms_eps: float

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def parameters(self) -> int:
        """Weights, embedding included once (tied with the output)."""
        kv = self.kv_heads * self.head_dim
        block = 2 * self.hidden * self.hidden + 2 * self.hidden * kv
        block += 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.vocab * self.hidden + self.layers * block + self.hidden


#: SmolLM2-360M-Instruct's config.json, as published
SMOLLM2_360M = LlamaShape(
    hidden=960,
    layers=32,
    heads=15,
    kv_heads=5,
    intermediate=2560,
    vocab=49152,
    context=8192,
    rope_theta=100000.0,
    rms_eps=1e-5,
)


def architecture_keys(shape: LlamaShape) -> dict[str, tuple[object, str]]:
    """The ``llama.*`` metadata of ``shape``: key -> (value, GGUF value type name)."""
    return {
        f"{ARCH}.block_count": (shape.layers, "UINT32"),
        f"{ARCH}.context_length": (shape.context, "UINT32"),
        f"{ARCH}.embedding_length": (shape.hidden, "UINT32"),
        f"{ARCH}.feed_forward_length": (shape.intermediate, "UINT32"),
        f"{ARCH}.attention.head_count": (shape.heads, "UINT32"),
        f"{ARCH}.attention.head_count_kv": (shape.kv_heads, "UINT32"),
        f"{ARCH}.rope.freq_base": (shape.rope_theta, "FLOAT32"),
        f"{ARCH}.attention.layer_norm_rms_epsilon": (shape.rms_eps, "FLOAT32"),
        f"{ARCH}.vocab_size": (shape.vocab, "UINT32"),
        f"{ARCH}.rope.dimension_count": (shape.head_dim, "UINT32"),
    }


def tensor_plan(shape: LlamaShape) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, numpy shape ``[out_features, in_features]``, quant type) of every tensor,
    in the embedded file's order; no ``output.weight`` (tied to the embedding)."""
    kv = shape.kv_heads * shape.head_dim
    yield "token_embd.weight", (shape.vocab, shape.hidden), "Q8_0"
    for i in range(shape.layers):
        yield f"blk.{i}.attn_norm.weight", (shape.hidden,), "F32"
        yield f"blk.{i}.ffn_down.weight", (shape.hidden, shape.intermediate), "Q4_1"
        yield f"blk.{i}.ffn_gate.weight", (shape.intermediate, shape.hidden), "Q4_1"
        yield f"blk.{i}.ffn_up.weight", (shape.intermediate, shape.hidden), "Q4_1"
        yield f"blk.{i}.ffn_norm.weight", (shape.hidden,), "F32"
        yield f"blk.{i}.attn_k.weight", (kv, shape.hidden), "Q4_1"
        yield f"blk.{i}.attn_output.weight", (shape.hidden, shape.hidden), "Q4_1"
        yield f"blk.{i}.attn_q.weight", (shape.hidden, shape.hidden), "Q4_1"
        yield f"blk.{i}.attn_v.weight", (kv, shape.hidden), "Q4_1"
    yield "output_norm.weight", (shape.hidden,), "F32"


#: metadata this file sets itself: the writer adds the architecture; name and size say what
#: this model is
OWN_KEYS = ("general.architecture", "general.name", "general.size_label")


def copied_fields(source: Path) -> Iterator[tuple[str, object, object, object]]:
    """(key, value, GGUF value type, array element type or None) of every metadata key of
    ``source`` to copy: all but the architecture's own (``llama.*``), the header's
    (``GGUF.*``) and :data:`OWN_KEYS`."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", f"{ARCH}.")) or key in OWN_KEYS:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        yield key, field.contents(), vtype, sub


def write_gguf(source: Path, out: Path, shape: LlamaShape, seed: int, std: float) -> None:
    """Write the random model to ``out``: ``shape``'s tensors drawn from N(0, ``std``) (norms
    1.0) with ``seed``, quantised as :func:`tensor_plan` says, with ``source``'s tokenizer
    and metadata."""
    import gguf

    writer = gguf.GGUFWriter(str(out), ARCH)
    for key, value, vtype, sub in copied_fields(source):
        writer.add_key_value(key, value, vtype, sub_type=sub)
    writer.add_string("general.name", f"SmolLM2 360M architecture, random weights (seed {seed})")
    writer.add_string("general.size_label", "360M")
    for key, (value, vtype) in architecture_keys(shape).items():
        writer.add_key_value(key, value, gguf.GGUFValueType[vtype])
    rng = np.random.default_rng(seed)
    for name, dims, quant in tensor_plan(shape):
        if quant == "F32":
            writer.add_tensor(name, np.ones(dims, dtype=np.float32))
            continue
        weights = rng.standard_normal(dims, dtype=np.float32) * np.float32(std)
        qtype = gguf.GGMLQuantizationType[quant]
        writer.add_tensor(name, gguf.quants.quantize(weights, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def convert_to_hf(gguf_file: Path, folder: Path) -> None:
    """``gguf_file`` -> ``folder`` with the transformers venv's Python (as setup_generate.sh)."""
    python = generate_peers.peers_root() / "transformers" / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{python} is missing: run benchmarks/peers/setup_generate.sh first")
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("VIRTUAL_ENV", None)
    subprocess.run([str(python), str(CONVERT), str(gguf_file), str(tmp)], check=True, env=env)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def ask(base_url: str, model: str, max_tokens: int = 8) -> str:
    """One greedy chat completion's text."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    request = urllib.request.Request(
        f"{base_url}/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return str(json.load(response)["choices"][0]["message"]["content"])


def check(gguf_file: Path, cores: str | None) -> None:
    """Start gpuserve, llama.cpp and transformers on the model in turn; print one answer each."""
    import generate

    with generate.gpuserve_server(gguf_file, "fp32", cores, 4, None) as url:
        print(f"gpuserve: {ask(url, 'chat')!r}")
    for name in generate_peers.PEER_NAMES:
        with generate_peers.start_peer(name, generate.free_port(), cores, model=gguf_file) as peer:
            print(f"{name}: {ask(peer.base_url, peer.model)!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=360)
    parser.add_argument("--std", type=float, default=0.02, help="of the random weights")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers folder")
    parser.add_argument(
        "--check", action="store_true", help="one answer from gpuserve, llama.cpp, transformers"
    )
    parser.add_argument("--server-cores", default=None, help="taskset list for --check")
    args = parser.parse_args(argv)
    shape = SMOLLM2_360M
    args.out_dir.mkdir(parents=True, exist_ok=True)
    gguf_file = args.out_dir / "smollm2-360m-random.Q4_1.gguf"
    source = generate_peers.gguf_path()
    started = time.monotonic()
    write_gguf(source, gguf_file, shape, args.seed, args.std)
    print(
        f"{gguf_file}: {shape.parameters() / 1e6:.1f} M parameters, "
        f"{gguf_file.stat().st_size / 1e6:.0f} MB ({time.monotonic() - started:.0f} s)"
    )
    if not args.no_hf:
        started = time.monotonic()
        convert_to_hf(gguf_file, args.out_dir / "hf")
        print(f"{args.out_dir / 'hf'}: converted in {time.monotonic() - started:.0f} s")
    if args.check:
        check(gguf_file, args.server_cores)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
