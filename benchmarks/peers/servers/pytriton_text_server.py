#!/usr/bin/env python3
"""PyTriton serving raw text: the mixed-length benchmark's peer (benchmarks/mixed_length.py).

Model ``text_embedding``: TEXT BYTES [-1, 1] -> EMBEDDING FP32 [-1, 384], the same contract as
gpuserve's default repository, so both servers get the same V2 JSON bodies. Triton's dynamic
batcher (max_batch_size=BENCH_MAX_BATCH, max_queue_delay=BENCH_BATCH_WAIT_MS) groups requests
in arrival order, and the infer function embeds the batch with all-MiniLM-L6-v2.
BENCH_MAX_SEQ_LEN (default 256) truncates. BENCH_TEXT_ENCODER chooses the encoder:

* ``sentence-transformers`` (default): ``SentenceTransformer.encode`` of the model folder,
  what a PyTriton user serving this model writes: the batch is padded to its longest text.
* ``gpuserve``: gpuserve's own SentenceEmbedder (the code the benchmark's in-process limit
  measures, which runs batches of different lengths packed, without padding): PyTriton's
  serving in front of gpuserve's execution, i.e. the serving layers alone compared.

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


def load_encoder(kind, max_seq_len):
    """texts: list[str] -> float32 [len(texts), 384], L2-normalised mean-pooled embeddings."""
    if kind == "gpuserve":
        from gpuserve.models.sentence_embedding import SentenceEmbedder

        return SentenceEmbedder.load(max_seq_len=max_seq_len).encode
    if kind != "sentence-transformers":
        raise SystemExit(f"BENCH_TEXT_ENCODER must be sentence-transformers or gpuserve, got {kind!r}")
    from benchlib.model import model_dir
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_dir(), device="cpu")
    model.max_seq_length = max_seq_len

    def encode(texts):
        return model.encode(texts, batch_size=max(1, len(texts)), normalize_embeddings=True,
                            convert_to_numpy=True, show_progress_bar=False)

    return encode


def main():
    import torch

    torch.set_num_threads(TORCH_THREADS)
    encode = load_encoder(os.environ.get("BENCH_TEXT_ENCODER", "sentence-transformers"),
                          int(os.environ.get("BENCH_MAX_SEQ_LEN", "256")))
    encode(["PyTriton warms up the model."])

    @batch
    def infer_text(TEXT):
        texts = [row[0].decode("utf-8", "replace") if isinstance(row[0], bytes) else str(row[0]) for row in TEXT]
        return {"EMBEDDING": encode(texts).astype(np.float32)}

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
