#!/usr/bin/env bash
# Regenerate the Python modules of the gRPC protocol from the .proto files in
# src/gpuserve/protocol/protos/ (the generated modules are checked in; run this after editing a
# .proto and commit the result).
#
# Needs grpcio-tools; the checked-in modules were made with grpcio-tools 1.75.1 (protoc 31.1),
# which sets the oldest runtime they accept: protobuf 6.31.1 and grpcio 1.75.1. A newer
# grpcio-tools raises those floors; update the pins in pyproject.toml to match.
#
#   pip install 'grpcio-tools==1.75.1' && scripts/gen_grpc.sh
#
# The modules register their descriptors in a private descriptor pool
# (gpuserve.protocol.protos._pool) instead of protobuf's default pool: tritonclient.grpc ships
# its own compiled copy of the same 'inference' package, and two different files defining
# 'inference.ModelInferRequest' in one pool make the second import fail.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
OUT=src/gpuserve/protocol/protos

"$PYTHON" -m grpc_tools.protoc -I src --python_out=src --pyi_out=src \
    "$OUT/model_config.proto" "$OUT/grpc_service.proto"
"$PYTHON" -m grpc_tools.protoc -I src --grpc_python_out=src "$OUT/grpc_service.proto"

for module in "$OUT/model_config_pb2.py" "$OUT/grpc_service_pb2.py"; do
    sed -i \
        -e 's/^from google.protobuf import descriptor_pool as _descriptor_pool$/from gpuserve.protocol.protos._pool import POOL as _POOL/' \
        -e 's/_descriptor_pool\.Default()/_POOL/' \
        "$module"
    if grep -q '_descriptor_pool' "$module"; then
        echo "gen_grpc.sh: $module still uses the default descriptor pool" >&2
        exit 1
    fi
done
echo "generated: $(ls "$OUT"/*_pb2*.py* | tr '\n' ' ')"
