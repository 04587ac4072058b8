#!/usr/bin/env python3
"""In-process forward throughput of all-MiniLM-L6-v2: gpuserve's BERT vs transformers' BertModel.

No server, no HTTP: the physical limit that a serving stack adds overhead to. Three rows per
batch size:

* ``gpuserve ids[B,32]``: gpuserve.models.bert encoder + mean pool + L2 norm on pre-tokenised
  ids (the workload of /work/shared/bench: one 32-token sentence, no padding).
* ``transformers ids[B,32]``: ``transformers.BertModel`` + the same pooling on the same ids
  (what the peer servers run).
* ``text_embedding text``: the default repository's whole model path, decode bytes +
  tokenise + encode + pool + numpy, for a typical 12-word sentence.

Also times ``import gpuserve.models.bert`` + ``load_bert`` in a fresh interpreter.

Usage:
    PYTHONPATH=src python benchmarks/raw_forward.py [--threads 1] [--seconds 2]
        [--batches 1,8,32,64] [--cpu N] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# 32 token ids of the shared benchmark's sentence (/work/shared/bench/workload/minilm_ids.json).
BENCH_IDS = [
    101, 1996, 4248, 2829, 4419, 14523, 2058, 1996, 13971, 3899, 2096, 1037, 6847, 10665, 5761,
    2129, 3435, 1037, 2235, 6251, 7861, 8270, 4667, 2944, 2064, 2022, 2366, 2058, 8299, 2006,
    2048, 102,
]  # fmt: skip
SENTENCE = "The new library makes serving sentence embeddings on a GPU fast and simple."


def measure(
    cases: dict[str, Callable[[], object]], seconds: float, sync: Callable[[], None]
) -> dict[str, dict]:
    """Per-call wall times of each case, interleaved in short rounds.

    Interleaving matters on a shared VM: throughput drifts by 2x within a minute, and timing
    the cases one after the other would compare the drift, not the code.
    """
    for fn in cases.values():
        for _ in range(2):
            fn()
    sync()
    times: dict[str, list[float]] = {name: [] for name in cases}
    deadline = time.perf_counter() + seconds * len(cases)
    while time.perf_counter() < deadline or min(len(t) for t in times.values()) < 5:
        for name, fn in cases.items():
            round_end = time.perf_counter() + 0.2
            while True:
                t0 = time.perf_counter()
                fn()
                sync()
                t1 = time.perf_counter()
                times[name].append(t1 - t0)
                if t1 >= round_end:
                    break
    result = {}
    for name, ts in times.items():
        ts.sort()
        result[name] = {"iters": len(ts), "total_s": sum(ts), "p50_s": ts[len(ts) // 2]}
    return result


def import_and_load_seconds() -> dict:
    code = (
        "import time; t0 = time.perf_counter();"
        "from gpuserve.models.bert import load_bert; t1 = time.perf_counter();"
        "from gpuserve.models.sentence_embedding import default_model_dir;"
        "load_bert(default_model_dir()); t2 = time.perf_counter();"
        "import json; print(json.dumps({'import_s': t1 - t0, 'load_s': t2 - t1}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--cpu", type=int, default=None, help="pin this process to one CPU")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})

    cold = import_and_load_seconds()

    import numpy as np
    import torch

    from gpuserve.models.bert import mean_pool_normalize
    from gpuserve.models.sentence_embedding import SentenceEmbedder, decode_texts

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    embedder = SentenceEmbedder.load(device=device)
    hf = None
    if not args.skip_transformers:
        from transformers import BertModel

        from gpuserve.models.sentence_embedding import default_model_dir

        hf = BertModel.from_pretrained(str(default_model_dir())).eval().to(device)

    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        ids = torch.tensor([BENCH_IDS] * batch, dtype=torch.int64, device=device)
        mask = torch.ones_like(ids)

        def ours(ids: torch.Tensor = ids, mask: torch.Tensor = mask) -> torch.Tensor:
            with torch.inference_mode():
                return mean_pool_normalize(embedder.encoder(ids, mask), mask)

        def theirs(ids: torch.Tensor = ids, mask: torch.Tensor = mask) -> torch.Tensor:
            assert hf is not None
            with torch.inference_mode():
                hidden = hf(input_ids=ids, attention_mask=mask).last_hidden_state
                return mean_pool_normalize(hidden, mask)

        texts = np.array([[SENTENCE.encode()]] * batch, dtype=object)

        def pipeline(texts: np.ndarray = texts) -> np.ndarray:
            return embedder.embed(embedder.tokenize(decode_texts(texts))).cpu().numpy()

        cases = {"gpuserve ids[B,32]": ours}
        if hf is not None:
            cases["transformers ids[B,32]"] = theirs
        cases["text_embedding text"] = pipeline
        for name, r in measure(cases, args.seconds, sync).items():
            rows.append(
                {
                    "case": name,
                    "batch": batch,
                    "sent_per_s": round(batch / r["p50_s"], 1),
                    "mean_sent_per_s": round(batch * r["iters"] / r["total_s"], 1),
                    "batch_ms_p50": round(1e3 * r["p50_s"], 3),
                    "iters": r["iters"],
                }
            )
            print(json.dumps(rows[-1]), flush=True)

    seq_len = embedder.tokenize([SENTENCE]).input_ids.shape[1]
    print(f"\n{args.device}, torch threads {torch.get_num_threads()}, text seq len {seq_len}")
    print(f"import gpuserve.models.bert {cold['import_s']:.2f} s, load_bert {cold['load_s']:.2f} s")
    print(f"{'case':<24}{'batch':>6}{'sent/s@p50':>12}{'sent/s mean':>12}{'p50 ms':>10}")
    for r in rows:
        print(
            f"{r['case']:<24}{r['batch']:>6}{r['sent_per_s']:>12.1f}"
            f"{r['mean_sent_per_s']:>12.1f}{r['batch_ms_p50']:>10.2f}"
        )


if __name__ == "__main__":
    main()
