#!/usr/bin/env bash
# The GPU checks, as one prepared script for a lent GPU machine (Python 3.12 with torch; no
# registry): installs the wheels scripts/gpu_prepare.sh put in .gpu/whl, runs tests/gpu/ and
# benchmarks/gpu_serving.py from the source tree, and leaves the logs and results in $OUT
# (or ./gpu-out). About 11 minutes on one H200 (--quick serving benchmark, then generation).
#
#   device run:  bash scripts/gpu_check.sh      (carry: [".gpu"])
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -d .gpu/whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .gpu/whl/*.whl || exit 1
    export PYTHONPATH="$PWD/src:/tmp/site"
else
    export PYTHONPATH="$PWD/src"
fi
[ -d .gpu/model ] && export GPUSERVE_TEST_MODEL_DIR="$PWD/.gpu/model"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest tests/gpu -q -p no:randomly -p no:cacheprovider 2>&1 | tee "$OUT/tests_gpu.log"
timeout 420 python3 benchmarks/gpu_serving.py --quick \
    ${GPUSERVE_TEST_MODEL_DIR:+--text-model-dir "$GPUSERVE_TEST_MODEL_DIR"} 2>&1 \
    | tee "$OUT/gpu_serving.log"
# generation: the engine in-process, decode steps eager against CUDA graphs (and vLLM when
# its wheel is carried)
timeout 300 python3 benchmarks/generate_gpu.py --levels 1,8,32,64 2>&1 | tee "$OUT/generate_gpu.log"
cp benchmarks/results/generate-gpu-*.md benchmarks/results/generate-gpu-*.json "$OUT/" 2>/dev/null
cp benchmarks/results/gpu_serving-*.md benchmarks/results/gpu_serving-*.json "$OUT/" 2>/dev/null
exit 0
