#!/usr/bin/env python3
"""gpuserve in the peer benchmark: writes a model repository for the benchmark's two models
from the BENCH_* environment (max batch, batch wait, torch threads), then runs `gpuserve serve`
on it in this process.

minilm:   input_ids INT64 [-1, 32] -> embedding FP32 [-1, 384] (BERT encoder with an all-ones
          mask, mean pooling, L2 norm: what benchlib.model computes)
identity: x FP32 [-1, 16] -> y FP32 [-1, 16]

--src DIR runs gpuserve from another source tree (DIR holds the `gpuserve` package, e.g. an
exported base commit's src/) instead of the bench venv's install of this checkout: DIR goes
first on sys.path and on PYTHONPATH (for anything the server starts). The script prints
`BENCHINFO gpuserve imported from ...` (run.py copies it into the report) and stops if the
package did not come from DIR.
"""

import _common  # noqa: F401  (sys.path)

import argparse
import os
import sys
import tempfile
from pathlib import Path

from benchlib.config import BATCH_WAIT_MS, HOST, MAX_BATCH, PORT, TORCH_THREADS

MODELS = os.environ.get("BENCH_MODELS", "minilm,identity").split(",")

MINILM_MODEL = '''
import torch
from gpuserve import PythonModel
from gpuserve.models.bert import load_bert, mean_pool_normalize
from gpuserve.models.sentence_embedding import default_model_dir


class Model(PythonModel):
    def load(self, context):
        torch.set_num_threads(int(context.parameters["torch_threads"]))
        self.encoder = load_bert(default_model_dir(), device=context.device)

    def warmup(self):
        self.forward(torch.full((1, 8), 101, dtype=torch.int64))

    def preprocess(self, inputs):
        return torch.from_numpy(inputs["input_ids"])

    def forward(self, ids):
        with torch.inference_mode():
            return mean_pool_normalize(self.encoder(ids, None), None)

    def postprocess(self, embedding):
        return {"embedding": embedding.numpy()}
'''

IDENTITY_MODEL = '''
from gpuserve import PythonModel


class Model(PythonModel):
    def forward(self, batch):
        return {"y": batch["x"]}
'''


def write_model(root: Path, name: str, inputs: str, outputs: str, source: str) -> None:
    folder = root / name
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(source)
    (folder / "config.yaml").write_text(
        f"backend: python\n"
        f"max_batch_size: {MAX_BATCH}\n"
        f"inputs:\n  - {inputs}\n"
        f"outputs:\n  - {outputs}\n"
        f"dynamic_batching:\n  max_queue_delay_us: {int(BATCH_WAIT_MS * 1000)}\n"
        f"instance_group:\n  - {{count: 1, kind: cpu}}\n"
        f"parameters:\n  torch_threads: {TORCH_THREADS}\n"
    )


def import_gpuserve(src: str | None) -> None:
    """Import gpuserve (from `src` when given) and say where from."""
    if src:
        src = os.path.abspath(src)
        if not os.path.isfile(os.path.join(src, "gpuserve", "__init__.py")):
            sys.exit(f"--src {src}: no gpuserve/__init__.py there")
        sys.path.insert(0, src)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))
    import gpuserve

    where = os.path.abspath(gpuserve.__file__)
    print(f"BENCHINFO gpuserve imported from {where}", flush=True)
    if src and not where.startswith(src + os.sep):
        sys.exit(f"gpuserve came from {where}, not from --src {src}")


def main() -> int:
    ap = argparse.ArgumentParser(description="gpuserve for the peer benchmark (env: BENCH_*)")
    ap.add_argument("--src", help="source tree holding the gpuserve package (default: the installed one)")
    import_gpuserve(ap.parse_args().src)
    root = Path(tempfile.mkdtemp(prefix="gpuserve-bench-"))
    if "minilm" in MODELS:
        write_model(root, "minilm", "{name: input_ids, datatype: INT64, shape: [-1]}",
                    "{name: embedding, datatype: FP32, shape: [384]}", MINILM_MODEL)
    if "identity" in MODELS:
        write_model(root, "identity", "{name: x, datatype: FP32, shape: [16]}",
                    "{name: y, datatype: FP32, shape: [16]}", IDENTITY_MODEL)
    from gpuserve.cli.main import main as gpuserve_main

    # gRPC and the metrics listener keep gpuserve's default ports unless BENCH_GRPC_PORT /
    # BENCH_METRICS_PORT move them (another server on this machine holding 8001/8002)
    ports = [("--grpc-port", "BENCH_GRPC_PORT"), ("--metrics-port", "BENCH_METRICS_PORT")]
    extra = [arg for flag, env in ports if env in os.environ for arg in (flag, os.environ[env])]
    return gpuserve_main(["serve", "--model-repository", str(root), "--host", HOST,
                          "--http-port", str(PORT), "--log-level", "warning", *extra])


if __name__ == "__main__":
    sys.exit(main())
