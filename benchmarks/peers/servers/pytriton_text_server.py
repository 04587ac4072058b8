#!/usr/bin/env python3
"""PyTriton serving raw text: the mixed-length benchmark's peer (benchmarks/mixed_length.py).

Model ``text_embedding``: TEXT BYTES [-1, 1] -> EMBEDDING FP32 [-1, 384], the same contract as
gpuserve's default repository, so both servers get the same V2 JSON bodies. Triton's dynamic
batcher (max_batch_size=BENCH_MAX_BATCH, max_queue_delay=BENCH_BATCH_WAIT_MS) groups requests
in arrival order; the infer function tokenises the batch (padding to its longest text) and
runs all-MiniLM-L6-v2 with gpuserve's SentenceEmbedder, i.e. the very code the in-process
limit of the benchmark measures. BENCH_MAX_SEQ_LEN (default 256) truncates.

The libpython fix of pytriton_server.py (the python-backend stub must load the running
interpreter's libpython) is applied by importing that module.
"""

import os
import sys

import _common  # noqa: F401  (sys.path)
import numpy as np
import pytriton_server  # noqa: F401  (LD_LIBRARY_PATH fix at import)
from benchlib.config import BATCH_WAIT_MS, EMBED_DIM, HOST, MAX_BATCH, PORT, TORCH_THREADS
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig


def main():
    import torch

    from gpuserve.models.sentence_embedding import SentenceEmbedder, decode_texts

    torch.set_num_threads(TORCH_THREADS)
    embedder = SentenceEmbedder.load(max_seq_len=int(os.environ.get("BENCH_MAX_SEQ_LEN", "256")))
    embedder.encode(["PyTriton warms up the model."])

    @batch
    def infer_text(TEXT):
        return {"EMBEDDING": embedder.encode(decode_texts(TEXT)).astype(np.float32)}

    cfg = TritonConfig(http_address=HOST, http_port=PORT,
                       grpc_address=HOST, grpc_port=int(os.environ.get("BENCH_PORT2", PORT + 1)),
                       allow_metrics=False, log_verbose=0, exit_timeout_secs=5)
    mcfg = ModelConfig(max_batch_size=MAX_BATCH, batcher=DynamicBatcher(
        max_queue_delay_microseconds=int(BATCH_WAIT_MS * 1000)))
    with Triton(config=cfg) as triton:
        triton.bind(model_name="text_embedding", infer_func=infer_text,
                    inputs=[Tensor(name="TEXT", dtype=bytes, shape=(1,))],
                    outputs=[Tensor(name="EMBEDDING", dtype=np.float32, shape=(EMBED_DIM,))],
                    config=mcfg, strict=False)
        print("pytriton: serving text_embedding", file=sys.stderr, flush=True)
        triton.serve()


if __name__ == "__main__":
    main()
