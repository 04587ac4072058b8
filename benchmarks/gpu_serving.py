#!/usr/bin/env python3
"""GPU serving benchmark: raw in-process throughput vs served throughput on one GPU.

Models (random weights, nothing downloaded):
* resnet50: torchvision ResNet-50, FP32 [3, 224, 224] -> FP32 [1000]
* bert_base: transformers BERT-base (default BertConfig), INT64 input_ids [128] -> FP32 [768]
  (the [CLS] hidden state)

Also: the built-in text_embedding encoder (all-MiniLM-L6-v2) on texts of random length
(1-200 words), padded batches vs unpadded (packed, varlen attention) batches of 32 and 128.

For each model: (a) raw forward throughput in-process at batch sizes 1..128 (best is the limit);
(b) served throughput with `gpuserve bench` over gRPC with binary tensors at high concurrency,
for the variants fp32 / fp16 (or bf16), CUDA graphs off / on, 1 / 2 instances; (c) the
text_embedding model's accuracy at fp16 and bf16 on the device against fp32 on the held-out
sentences (what `gpuserve models accuracy --device` reports, and what the load-time
precision_check holds to its bounds). Writes
results/gpu_serving-<date>.md and .json. Budget: about 6-8 minutes on one H200.

Usage: python benchmarks/gpu_serving.py [--device cuda:0] [--quick]
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

RESNET = """
import torch
import torchvision


def create_model(context):
    torch.manual_seed(0)
    return torchvision.models.resnet50(weights=None)
"""

BERT = """
import torch
import transformers


class ClsEmbedding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        config = transformers.BertConfig(attn_implementation="sdpa")
        self.bert = transformers.BertModel(config, add_pooling_layer=False)

    def forward(self, input_ids):
        return self.bert(input_ids=input_ids).last_hidden_state[:, 0]


def create_model(context):
    return ClsEmbedding()
"""

MODELS = {
    "resnet50": {
        "source": RESNET,
        "input": "{name: INPUT, datatype: FP32, shape: [3, 224, 224]}",
        "output": "{name: OUTPUT, datatype: FP32, shape: [1000]}",
        "max_batch": 64,
    },
    "bert_base": {
        "source": BERT,
        "input": "{name: input_ids, datatype: INT64, shape: [128]}",
        "output": "{name: OUTPUT, datatype: FP32, shape: [768]}",
        "max_batch": 64,
    },
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def write_repository(root: Path, name: str, precision: str, graphs: bool, instances: int) -> None:
    spec = MODELS[name]
    folder = root / name
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(spec["source"])
    (folder / "config.yaml").write_text(
        f"backend: torch\nmax_batch_size: {spec['max_batch']}\n"
        f"inputs:\n  - {spec['input']}\noutputs:\n  - {spec['output']}\n"
        f"dynamic_batching:\n  max_queue_delay_us: 500\n"
        f"instance_group:\n  - {{count: {instances}, kind: gpu, gpus: [0]}}\n"
        f"precision: {precision}\n"
        f"optimization:\n  cuda_graphs: {str(graphs).lower()}\n"
    )


def raw_throughput(name: str, device: str, precision: str, seconds: float) -> dict[int, float]:
    import torch

    namespace: dict = {}
    exec(MODELS[name]["source"], namespace)  # the benchmark's own model source
    module = namespace["create_model"](None).to(device).eval()
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    module = module.to(dtype)
    results = {}
    for batch in (1, 8, 32, 64, 128):
        if name == "resnet50":
            x = torch.randn(batch, 3, 224, 224, device=device, dtype=dtype)
        else:
            x = torch.randint(1000, 20000, (batch, 128), device=device)
        with torch.inference_mode():
            for _ in range(3):
                module(x)
            torch.cuda.synchronize()
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                module(x)
                n += 1
            torch.cuda.synchronize()
        results[batch] = n * batch / (time.perf_counter() - t0)
    del module
    torch.cuda.empty_cache()
    return results


def served_throughput(
    name: str, precision: str, graphs: bool, instances: int, concurrency: int, window_s: float
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "repo"
        write_repository(root, name, precision, graphs, instances)
        http, grpc_port = free_port(), free_port()
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpuserve",
                "serve",
                "--model-repository",
                str(root),
                "--host",
                "127.0.0.1",
                "--http-port",
                str(http),
                "--grpc-port",
                str(grpc_port),
                "--metrics-port",
                "-1",
                "--log-level",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            import urllib.request

            for _ in range(600):
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready") as r:
                        if r.status == 200:
                            break
                except OSError:
                    time.sleep(0.5)
            out = Path(tmp) / "bench"
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "gpuserve",
                    "bench",
                    "--url",
                    f"http://127.0.0.1:{http}",
                    "-m",
                    name,
                    "--protocol",
                    "grpc",
                    "--grpc-url",
                    f"127.0.0.1:{grpc_port}",
                    "--tensor-format",
                    "binary",
                    "--concurrency",
                    str(concurrency),
                    "--warmup-s",
                    "2",
                    "--window-s",
                    str(window_s),
                    "--stable-windows",
                    "2",
                    "--max-windows",
                    "3",
                    "--output-dir",
                    str(out),
                    "--no-plot",
                    "--quiet",
                ],
                check=True,
                capture_output=True,
                timeout=300,
            )
            with open(out / "bench.csv") as f:
                row = next(csv.DictReader(f))
            return {
                "rows_per_s": float(row["throughput_rows_per_s"]),
                "p99_ms": float(row["p99_ms"]),
                "errors": row["errors"],
            }
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()


def unpadded_throughput(
    device: str, precision: str, seconds: float, model_dir: str | None
) -> dict[str, float]:
    """Texts/s of the text_embedding encoder, padded vs packed, by batch size."""
    import random

    import torch

    from gpuserve.models.bert import Packing, mean_pool_packed
    from gpuserve.models.sentence_embedding import SentenceEmbedder, TokenizedBatch

    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    embedder = SentenceEmbedder.load(model_dir, device=device, dtype=dtype)
    rng = random.Random(0)
    words = ["a", "model", "server", "batches", "requests", "of", "varied", "length"]
    result: dict[str, float] = {}
    for size in (32, 128):
        texts = [
            " ".join(rng.choice(words) for _ in range(rng.randint(1, 200))) for _ in range(size)
        ]
        batch = embedder.tokenize(texts)
        lengths = batch.attention_mask.sum(dim=1).tolist()
        ids = batch.input_ids[batch.attention_mask.bool()].to(device)
        packing = Packing.of(lengths, device)

        def padded(batch: TokenizedBatch = batch) -> object:
            return embedder.embed(batch)

        def packed(ids: torch.Tensor = ids, packing: Packing = packing) -> object:
            with torch.inference_mode():
                return mean_pool_packed(embedder.encoder.forward_packed(ids, packing), packing)

        for label, run in (("padded", padded), ("unpadded", packed)):
            run()
            torch.cuda.synchronize()
            count, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                run()
                count += 1
            torch.cuda.synchronize()
            result[f"{label}@{size}"] = count * size / (time.perf_counter() - start)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="fewer variants, shorter windows")
    parser.add_argument(
        "--text-model-dir",
        default=None,
        help="all-MiniLM-L6-v2 folder for the text_embedding part (default: the PyPI package)",
    )
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU", file=sys.stderr)
        return 2
    half = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    seconds = 1.0 if args.quick else 2.0
    window = 3.0 if args.quick else 5.0
    variants = [("fp32", False, 1), (half, False, 1), (half, True, 1), (half, True, 2)]
    if args.quick:
        variants = variants[1:3]
    report: dict = {
        "date": dt.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(0),
        "models": {},
    }
    lines = [f"# gpu_serving {report['date']} on {report['gpu']}", ""]
    for name in MODELS:
        entry: dict = {"raw": {}, "served": []}
        for precision in ("fp32", half):
            entry["raw"][precision] = raw_throughput(name, args.device, precision, seconds)
        lines += [
            f"## {name}",
            "",
            "| precision | raw rows/s by batch (1/8/32/64/128) | best |",
            "|---|---|---|",
        ]
        for precision, by_batch in entry["raw"].items():
            values = " / ".join(f"{v:.0f}" for v in by_batch.values())
            lines.append(f"| {precision} | {values} | {max(by_batch.values()):.0f} |")
        lines += [
            "",
            f"| served variant (gRPC binary, c={args.concurrency}) | rows/s | "
            "of raw best | p99 ms | errors |",
            "|---|---|---|---|---|",
        ]
        for precision, graphs, instances in variants:
            started = time.monotonic()
            try:
                served = served_throughput(
                    name, precision, graphs, instances, args.concurrency, window
                )
            except Exception as err:  # report and go on: one variant must not sink the run
                served = {"rows_per_s": 0.0, "p99_ms": 0.0, "errors": f"failed: {err}"}
            best = max(entry["raw"][precision].values())
            served.update(
                precision=precision,
                cuda_graphs=graphs,
                instances=instances,
                ratio=served["rows_per_s"] / best if best else 0.0,
                seconds=round(time.monotonic() - started, 1),
            )
            entry["served"].append(served)
            label = f"{precision}, graphs {'on' if graphs else 'off'}, {instances} instance(s)"
            lines.append(
                f"| {label} | {served['rows_per_s']:.0f} | {served['ratio']:.2f} | "
                f"{served['p99_ms']:.1f} | {served['errors'] or 0} |"
            )
            print(lines[-1], flush=True)
        lines.append("")
        report["models"][name] = entry
    for precision in ("fp32", half):
        by_kind = unpadded_throughput(args.device, precision, seconds, args.text_model_dir)
        report.setdefault("text_embedding_unpadded", {})[precision] = by_kind
        lines += [
            f"## text_embedding, random lengths, {precision}: texts/s",
            "",
            "| batch | padded | unpadded | ratio |",
            "|---|---|---|---|",
        ]
        for size in (32, 128):
            pad, unpad = by_kind[f"padded@{size}"], by_kind[f"unpadded@{size}"]
            lines.append(f"| {size} | {pad:.0f} | {unpad:.0f} | {unpad / pad:.2f} |")
        lines.append("")
    lines += accuracy_section(args.device, report)
    out = HERE / "results" / f"gpu_serving-{report['date']}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def accuracy_section(device: str, report: dict) -> list[str]:
    """(c): text_embedding at fp16 and bf16 on ``device`` against fp32 on the same device."""
    from gpuserve.bench.accuracy import heldout_texts, measure_accuracy
    from gpuserve.config import default_model_repository

    lines = [
        f"## text_embedding accuracy on {device} against fp32 (held-out sentences)",
        "",
        "| precision | cosine min | cosine mean | max abs error | recall@10 |",
        "|---|---|---|---|---|",
    ]
    try:
        reports = measure_accuracy(
            default_model_repository() / "text_embedding", ["fp16", "bf16"], heldout_texts(), device
        )
    except Exception as err:  # report and go on, as the served variants do
        return [*lines, f"| failed: {err} | | | | |", ""]
    report["text_embedding_accuracy"] = [r.as_dict() for r in reports]
    for r in reports:
        lines.append(
            f"| {r.precision} | {r.cosine_min:.4f} | {r.cosine_mean:.4f} | "
            f"{r.max_abs_error:.4f} | {r.recall_at_k:.3f} |"
        )
    return [*lines, ""]


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
