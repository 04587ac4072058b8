#!/usr/bin/env python3
"""Precision at the hardware's speed: fp32, bf16 and int8 of the default text_embedding side
by side, served and in-process, with each one's accuracy on held-out sentences.

One run, for each precision (rounds interleaved: fp32, bf16, int8, fp32, ...):

* **accuracy** against fp32 on the built-in held-out sentences (``gpuserve models accuracy``);
* **served** req/s and real tokens/s of ``short`` sentences and ``chunks`` of 60-200 words
  (corpus.py: the standard library's docstrings) at closed-loop concurrency 1, 8, 32: one
  ``gpuserve serve`` per precision (its own repository: the default text_embedding with
  ``precision: P``), pinned to the server CPU, the load generator on the client CPU;
* **in-process** texts/s and tokens/s of the same model, same precision, same pinning, through
  the backend's own hooks on batches of 32 texts in arrival order (what the batcher hands an
  instance at c=32), so served / in-process says what serving costs;
* **peak**: a timed large matrix product in the datatype on one core (fp32 and bf16: torch
  ``mm`` 2048x1024 @ 1024x1024; int8: the same product as the int8 graph's own kernel, a one-node
  ``MatMul`` graph quantised like the model and run on ONNX Runtime), and each precision's
  tokens/s as a fraction of it at ~21.2 MFLOP per token (the encoder's weight products:
  2 x 6 layers x 384 x (1152 + 384 + 2 x 1536); attention's own products left out).

    python benchmarks/precision.py                       # ~6 min; writes results/precision-*.md
    python benchmarks/precision.py --quick               # ~2 min

Writes results/precision-<tag>-<date>.md/.json and prints the markdown.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import corpus  # noqa: E402
import mixed_length_servers as servers  # noqa: E402

from gpuserve.backends import cpu_features  # noqa: E402

PRECISIONS = ("fp32", "bf16", "int8")
FLOP_PER_TOKEN = 2 * 6 * 384 * (1152 + 384 + 2 * 1536)
MAX_SEQ_LEN = 256


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- in-process
def inprocess_main(precision: str, texts_path: Path, seconds: float, batch: int) -> None:
    """Child: the backend at ``precision`` on batches of ``batch`` texts; one JSON line."""
    import numpy as np
    import torch

    torch.set_num_threads(1)
    from gpuserve.bench.accuracy import load_at, text_model
    from gpuserve.config import default_model_repository

    model = text_model(default_model_repository() / "text_embedding")
    backend = load_at(model, precision)
    texts = corpus.read_lines(texts_path)
    tokenizer = servers_tokenizer()
    tokens = [len(e.ids) for e in tokenizer.encode_batch(texts)]
    batches = [list(range(i, min(i + batch, len(texts)))) for i in range(0, len(texts), batch)]

    def run(rows: list[int]) -> None:
        data = np.array([[texts[r].encode()] for r in rows], dtype=object)
        backend.postprocess(backend.forward(backend.preprocess({model.text_input: data})))

    run(batches[0])  # warm-up
    done_texts = done_tokens = 0
    start = time.perf_counter()
    k = 0
    while time.perf_counter() - start < seconds:
        rows = batches[k % len(batches)]
        run(rows)
        done_texts += len(rows)
        done_tokens += sum(tokens[r] for r in rows)
        k += 1
    elapsed = time.perf_counter() - start
    print(json.dumps({"texts_per_s": done_texts / elapsed, "tokens_per_s": done_tokens / elapsed}))


def servers_tokenizer():
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(servers.model_dir()) / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=MAX_SEQ_LEN)
    return tokenizer


def inprocess(precision: str, path: Path, args, layout) -> dict:
    cmd = [sys.executable, __file__, "--child-inprocess", precision, "--child-texts", str(path),
           "--child-seconds", str(args.inprocess_seconds)]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=servers.base_env(layout),
        preexec_fn=lambda: os.sched_setaffinity(0, layout.server_cpus),
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"in-process {precision} failed: {proc.stderr[-1500:]}")
    return json.loads(lines[-1])


def inprocess_table(precisions: list[str], mixes: dict, args, layout) -> int:
    """``--inprocess-only``: tokens/s of each precision, rounds interleaved, median and
    [min-max], and each round's ratio to fp32 of the same round; printed, not saved."""
    rows: dict[tuple[str, str], list[float]] = {}
    for rnd in range(args.rounds):
        for mix, (_texts, _tokens, path) in mixes.items():
            for p in precisions:
                tps = inprocess(p, path, args, layout)["tokens_per_s"]
                rows.setdefault((mix, p), []).append(tps)
                log(f"round {rnd} {mix} {p} in-process {tps:.0f} tokens/s")
    print("| mix | precision | tokens/s median [min-max] | x fp32 (same round) median [min-max] |")
    print("|---|---|---|---|")
    for (mix, p), values in rows.items():
        base = rows.get((mix, "fp32"), values)
        ratios = [v / b for v, b in zip(values, base, strict=True)]
        print(f"| {mix} | {p} | {statistics.median(values):.0f} [{min(values):.0f}-"
              f"{max(values):.0f}] | {statistics.median(ratios):.2f} [{min(ratios):.2f}-"
              f"{max(ratios):.2f}] |")  # fmt: skip
    return 0


# ----------------------------------------------------------------------------- peaks
def peak_main(dtype: str, seconds: float) -> None:
    """Child: GFLOP/s of a 2048x1024 @ 1024x1024 product in ``dtype`` on one thread."""
    import numpy as np
    import torch

    torch.set_num_threads(1)
    m, k, n = 2048, 1024, 1024
    if dtype in ("fp32", "bf16"):
        kind = torch.float32 if dtype == "fp32" else torch.bfloat16
        a, b = torch.randn(m, k, dtype=kind), torch.randn(k, n, dtype=kind)

        def step() -> None:
            torch.mm(a, b)

    else:
        step = _int8_matmul(m, k, n, np)
    step()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        step()
        count += 1
    elapsed = time.perf_counter() - start
    print(json.dumps({"dtype": dtype, "gflops": 2 * m * k * n * count / elapsed / 1e9}))


def _int8_matmul(m: int, k: int, n: int, np):
    """A one-node MatMul graph, quantised as the model's int8 graph is, on ONNX Runtime."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from gpuserve.models.bert_onnx_int8 import quantize_file

    folder = Path(tempfile.mkdtemp(prefix="peak-int8-"))
    weight = numpy_helper.from_array(np.random.randn(k, n).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(folder / "fp32.onnx"))
    quantize_file(folder / "fp32.onnx", folder / "int8.onnx", "blockwise")
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(
        str(folder / "int8.onnx"), options, providers=["CPUExecutionProvider"]
    )
    x = np.random.randn(m, k).astype(np.float32)
    return lambda: session.run(None, {"x": x})


def peak(dtype: str, layout, seconds: float) -> float:
    cmd = [sys.executable, __file__, "--child-peak", dtype, "--child-seconds", str(seconds)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=servers.base_env(layout),
        preexec_fn=lambda: os.sched_setaffinity(0, layout.server_cpus),
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"peak {dtype} failed: {proc.stderr[-1500:]}")
    return float(json.loads(lines[-1])["gflops"])


# ----------------------------------------------------------------------------- served
def spec_for(precision: str, repo: Path, port: int) -> servers.ServerSpec:
    src = str(HERE.parent / "src")
    cmd = [sys.executable, "-c", servers._GPUSERVE_LAUNCHER, src, "serve",
           "--model-repository", str(repo), "--host", "127.0.0.1", "--http-port", str(port),
           "--grpc-port", "-1", "--metrics-port", "-1", "--log-level", "warning",
           "--model-control-mode", "explicit", "--load-model", "text_embedding"]  # fmt: skip
    return servers.ServerSpec(
        f"gpuserve-{precision}",
        f"gpuserve serve, text_embedding precision {precision}",
        cmd,
        port,
        f"http://127.0.0.1:{port}/v2/models/text_embedding/infer",
        "v2",
    )


def repository(precision: str, work: Path) -> Path:
    from gpuserve.config import default_model_repository

    repo = work / f"repo-{precision}"
    shutil.copytree(default_model_repository() / "text_embedding", repo / "text_embedding",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    path = repo / "text_embedding" / "config.yaml"
    text = path.read_text()
    path.write_text(text.replace("precision: fp32", f"precision: {precision}"))
    return repo


def measure(spec, texts: list[str], tokens: list[int], c: int, seconds: float) -> dict:
    from gpuserve.bench.loadgen import LoadSettings, run_async, run_level
    from gpuserve.bench.raw_target import RawHttpTarget

    target = RawHttpTarget(spec.url, [servers.body(spec, t) for t in texts], timeout_s=60.0,
                           tokens=tokens)  # fmt: skip
    settings = LoadSettings(warmup_s=0.5, window_s=seconds / 2, stable_windows=2,
                            tolerance=0.15, max_windows=2, timeout_s=60.0)  # fmt: skip

    async def one():
        try:
            return await run_level(target, "concurrency", float(c), settings)
        finally:
            await target.close()

    level = run_async(one())
    s = level.summary
    return {"rps": s.throughput, "tokens_per_s": s.tokens_per_s or 0.0,
            "p99_ms": s.latency_ms[99], "errors": sum(s.errors.values())}  # fmt: skip


# ----------------------------------------------------------------------------- report
def render(doc: dict) -> str:
    out = [f"# Precision benchmark ({doc['info']['date']})", "",
           f"Command: `{doc['info']['command']}` · server CPU {doc['info']['server_cpus']}, "
           f"client CPU {doc['info']['client_cpus']} · load average "
           f"{doc['info']['loadavg_start'][0]:.2f} -> {doc['info']['loadavg_end'][0]:.2f} · "
           f"{doc['info']['rounds']} interleaved rounds, median shown, [min-max] after", ""]  # fmt: skip
    for p, why in doc["info"].get("left_out", {}).items():
        out += [f"Not run: {p} ({why}).", ""]
    out += ["## Accuracy against fp32 (held-out sentences)", "",
            "| precision | cosine min | cosine mean | max abs error | recall@10 |",
            "|---|---|---|---|---|"]  # fmt: skip
    for p, a in doc["accuracy"].items():
        out.append(f"| {p} | {a['cosine_min']:.4f} | {a['cosine_mean']:.4f} | "
                   f"{a['max_abs_error']:.4f} | {a['recall_at_k']:.3f} |")  # fmt: skip
    out += ["", "## Served req/s (x fp32 of the same round)", ""]
    for mix in doc["mixes"]:
        out += [f"### {mix}", "", "| precision | " + " | ".join(f"c={c}" for c in doc["conc"])
                + f" | x fp32 at c={max(doc['conc'])} |", "|---|" + "---|" * (len(doc["conc"]) + 1)]  # fmt: skip
        for p in doc["precisions"]:
            cells = []
            for c in doc["conc"]:
                runs = [r["rps"] for r in doc["served"] if r["precision"] == p
                        and r["mix"] == mix and r["c"] == c]  # fmt: skip
                cells.append(f"{statistics.median(runs):.1f} [{min(runs):.0f}-{max(runs):.0f}]")
            ratios = doc["ratios"][mix][p]
            cells.append(f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]")
            out.append(f"| {p} | " + " | ".join(cells) + " |")
        out.append("")
    out += ["## Tokens/s against the core's peak, served against in-process", "",
            "Peak: a timed 2048x1024 @ 1024x1024 product in the datatype on the server core "
            "(int8: the model's own int8 kernel, MatMulNBits). Fraction of peak = tokens/s x "
            f"{FLOP_PER_TOKEN / 1e6:.1f} MFLOP / peak.", "",
            "| precision | mix | peak GFLOP/s | in-process tokens/s (batch 32) | of peak | "
            f"served tokens/s c={max(doc['conc'])} | of peak | served / in-process |",
            "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in doc["efficiency"]:
        out.append(f"| {row['precision']} | {row['mix']} | {row['peak_gflops']:.0f} | "
                   f"{row['inprocess_tokens_per_s']:.0f} | {row['inprocess_of_peak']:.2f} | "
                   f"{row['served_tokens_per_s']:.0f} | {row['served_of_peak']:.2f} | "
                   f"{row['served_over_inprocess']:.2f} |")  # fmt: skip
    out += ["", "## Verdict", "", *[f"- {line}" for line in doc["verdict"]], ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--conc", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0, help="per served point")
    ap.add_argument("--inprocess-seconds", type=float, default=4.0)
    ap.add_argument("--short-count", type=int, default=400)
    ap.add_argument("--chunk-count", type=int, default=80)
    ap.add_argument("--server-cpus", default="1")
    ap.add_argument("--client-cpus", default="0")
    ap.add_argument("--base-port", type=int, default=8261)
    ap.add_argument("--quick", action="store_true", help="2 rounds, 2 s points")
    ap.add_argument("--inprocess-only", action="store_true",
                    help="only in-process tokens/s per precision and mix")  # fmt: skip
    ap.add_argument("--tag", default="")
    ap.add_argument("--out-dir", type=Path, default=HERE / "results")
    ap.add_argument("--child-inprocess", help=argparse.SUPPRESS)
    ap.add_argument("--child-peak", help=argparse.SUPPRESS)
    ap.add_argument("--child-texts", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--child-seconds", type=float, default=3.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_inprocess:
        inprocess_main(args.child_inprocess, args.child_texts, args.child_seconds, 32)
        return 0
    if args.child_peak:
        peak_main(args.child_peak, args.child_seconds)
        return 0
    if args.quick:
        args.rounds, args.seconds, args.inprocess_seconds = 2, 2.0, 2.0
    precisions = [p for p in args.precisions.split(",") if p]
    left_out: dict[str, str] = {}
    if "bf16" in precisions and (refusal := cpu_features.bf16_refusal()) is not None:
        log(f"bf16 left out: {refusal}")  # the server would refuse to load it
        precisions.remove("bf16")
        left_out["bf16"] = refusal
    conc = [int(c) for c in args.conc.split(",")]
    layout = servers.Layout({int(c) for c in args.server_cpus.split(",")},
                            {int(c) for c in args.client_cpus.split(",")})  # fmt: skip
    stamp = dt.datetime.now()
    work = Path(tempfile.mkdtemp(prefix="precision-bench-"))
    info = {"date": stamp.isoformat(timespec="seconds"), "command": " ".join(sys.argv),
            "left_out": left_out,
            "loadavg_start": os.getloadavg(), "server_cpus": args.server_cpus,
            "client_cpus": args.client_cpus, "rounds": args.rounds}  # fmt: skip
    tokenizer = servers_tokenizer()
    mixes = {}
    for name, count in (("short", args.short_count), ("chunks", args.chunk_count)):
        built = corpus.build(name, count)
        path = work / f"{name}.txt"
        corpus.write_lines(built, path)
        texts = list(built.texts)
        mixes[name] = (texts, [len(e.ids) for e in tokenizer.encode_batch(texts)], path)
        log("corpus", corpus.describe(built))

    if args.inprocess_only:
        return inprocess_table(precisions, mixes, args, layout)

    from gpuserve.bench.accuracy import heldout_texts, measure_accuracy
    from gpuserve.config import default_model_repository

    lower = [p for p in precisions if p != "fp32"]
    reports = measure_accuracy(default_model_repository() / "text_embedding", lower,
                               heldout_texts())  # fmt: skip
    accuracy = {r.precision: r.as_dict() for r in reports}
    for r in reports:
        log("accuracy", r.line())
    peaks = {p: peak(p, layout, 3.0) for p in precisions}
    log("peaks GFLOP/s", peaks)
    os.sched_setaffinity(0, layout.client_cpus)
    specs = {p: spec_for(p, repository(p, work), args.base_port + i)
             for i, p in enumerate(precisions)}  # fmt: skip
    procs = {}
    served: list[dict] = []
    inproc: dict[str, dict[str, list[float]]] = {}
    try:
        for p, spec in specs.items():
            procs[p] = servers.start(spec, layout, work / f"{spec.name}.log")
        for p, spec in specs.items():
            ready_s, _ = servers.wait_ready(procs[p], spec, servers.body(spec, "warm up"))
            log(f"{spec.name} ready after {ready_s:.1f} s")
        for rnd in range(args.rounds):
            for mix, (texts, tokens, path) in mixes.items():
                for p in precisions:  # in-process figure, same round
                    row = inprocess(p, path, args, layout)
                    inproc.setdefault(mix, {}).setdefault(p, []).append(row["tokens_per_s"])
                    log(f"round {rnd} {mix} {p} in-process {row['tokens_per_s']:.0f} tokens/s")
                for c in conc:
                    for p in precisions:
                        point = measure(specs[p], texts, tokens, c, args.seconds)
                        served.append({"round": rnd, "mix": mix, "c": c, "precision": p, **point})
                        log(f"round {rnd} {mix} c={c} {p}: {point['rps']:.1f} req/s "
                            f"{point['tokens_per_s']:.0f} tokens/s errors {point['errors']}")  # fmt: skip
    finally:
        for p, proc in procs.items():
            servers.stop(proc, specs[p])
    info["loadavg_end"] = os.getloadavg()

    def point(p: str, mix: str, c: int, rnd: int, key: str = "rps") -> float:
        return next(r[key] for r in served
                    if (r["precision"], r["mix"], r["c"], r["round"]) == (p, mix, c, rnd))  # fmt: skip

    top = max(conc)
    ratios = {mix: {p: [point(p, mix, top, r) / max(point("fp32", mix, top, r), 1e-9)
                        for r in range(args.rounds)] for p in precisions} for mix in mixes}  # fmt: skip
    efficiency = []
    for mix in mixes:
        for p in precisions:
            served_tps = statistics.median(point(p, mix, top, r, "tokens_per_s")
                                           for r in range(args.rounds))  # fmt: skip
            in_tps = statistics.median(inproc[mix][p])
            flops = 1e9 * peaks[p]
            efficiency.append({"precision": p, "mix": mix, "peak_gflops": peaks[p],
                               "inprocess_tokens_per_s": in_tps,
                               "inprocess_of_peak": in_tps * FLOP_PER_TOKEN / flops,
                               "served_tokens_per_s": served_tps,
                               "served_of_peak": served_tps * FLOP_PER_TOKEN / flops,
                               "served_over_inprocess": served_tps / in_tps})  # fmt: skip
    verdict = []
    within = [p for p in lower if accuracy[p]["cosine_min"] >= 0.99
              and accuracy[p]["recall_at_k"] >= 0.95]  # fmt: skip
    for mix in mixes:
        # fp32 is the reference and always within: a lower precision wins only by being faster
        best = max(["fp32", *within], key=lambda p: statistics.median(ratios[mix][p]))
        line = (f"{mix}: fastest within min cosine >= 0.99 and recall@10 >= 0.95 is {best}, "
                f"{statistics.median(ratios[mix][best]):.2f}x fp32 at c={top}")  # fmt: skip
        if best == "fp32" and within:
            line += "; no lower precision within the bounds is faster (" + ", ".join(
                f"{p} {statistics.median(ratios[mix][p]):.2f}x" for p in within) + ")"  # fmt: skip
        verdict.append(line)
    doc = {"info": info, "precisions": precisions, "conc": conc, "mixes": list(mixes),
           "accuracy": accuracy, "peaks_gflops": peaks, "served": served, "inprocess": inproc,
           "ratios": ratios, "efficiency": efficiency, "verdict": verdict}  # fmt: skip
    text = render(doc)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    base = (
        args.out_dir
        / f"precision-{args.tag or ('quick' if args.quick else 'full')}-{stamp:%Y-%m-%d}"
    )
    base.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str))
    base.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
