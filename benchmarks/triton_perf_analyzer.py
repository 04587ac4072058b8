"""Triton's ``perf_analyzer`` against gpuserve: HTTP, gRPC, ``--async``, ``--streaming``,
``--shared-memory system`` and ``--collect-metrics``, on the Triton-named ``simple`` model.

``perf_analyzer`` is the binary of PyPI's ``perf-analyzer`` wheel (``perf_analyzer/bin/``). Its
2.60 build needs glibc >= 2.38; on an older system give ``--loader`` the ``ld-linux-x86-64.so.2``
of a newer glibc and ``--library-path`` its folder (e.g. Debian trixie's ``libc6``,
``libstdc++6`` and ``libgcc-s1`` unpacked with ``apt-get download`` + ``dpkg-deb -x``)::

    python benchmarks/triton_perf_analyzer.py --perf-analyzer /tmp/pa/perf_analyzer \\
        --loader /tmp/trixie/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 \\
        --library-path /tmp/trixie/usr/lib/x86_64-linux-gnu:/lib/x86_64-linux-gnu

Each run's summary lines (throughput, latency) are printed, and the whole outputs are written
to ``--out`` (default ``benchmarks/results/triton-perf-analyzer-<date>.md``).
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fixtures.triton_examples import write_triton_examples  # noqa: E402
from tests.helpers import SubprocessServer  # noqa: E402

RUNS = {
    "http": ["-i", "http"],
    "grpc": ["-i", "grpc"],
    "grpc --async": ["-i", "grpc", "--async"],
    "grpc --streaming": ["-i", "grpc", "--streaming"],
    "http --shared-memory system": ["-i", "http", "--shared-memory", "system"],
    "grpc --shared-memory system": ["-i", "grpc", "--shared-memory", "system"],
    "http --collect-metrics": ["-i", "http", "--collect-metrics", "--verbose-csv"],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--perf-analyzer", required=True, type=Path)
    parser.add_argument("--loader", type=Path, help="ld.so of a newer glibc (optional)")
    parser.add_argument("--library-path", help="its library folders (with --loader)")
    parser.add_argument("--concurrency", default="4")
    parser.add_argument("--interval-ms", default="3000")
    parser.add_argument(
        "--stability-percentage",
        dest="stability",
        default="50",
        help="perf_analyzer's -s (its default 10 rarely settles on a shared 2-core host)",
    )
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated run names")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    prefix = [str(args.perf_analyzer)]
    if args.loader is not None:
        prefix = [str(args.loader), "--library-path", args.library_path or "", *prefix]
    out = args.out or ROOT / "benchmarks" / "results" / (
        f"triton-perf-analyzer-{datetime.date.today().isoformat()}.md"
    )
    report = ["# perf_analyzer against gpuserve (model `simple`, INT32 2x[1,16])", ""]
    with tempfile.TemporaryDirectory() as tmp:
        repository = write_triton_examples(Path(tmp) / "models", with_classifier=False)
        server = SubprocessServer(
            "--model-repository",
            str(repository),
            "--allow-client-shm",
            "--log-level",
            "warning",
        )
        try:
            http = server.url.removeprefix("http://")
            for name in args.runs.split(","):
                extra = RUNS[name]
                url = server.grpc_url if "grpc" in extra else http
                command = [
                    *prefix,
                    "-m",
                    "simple",
                    "-u",
                    url,
                    "--concurrency-range",
                    args.concurrency,
                    "--measurement-interval",
                    args.interval_ms,
                    "--stability-percentage",
                    args.stability,
                    *extra,
                ]
                csv = Path(tmp) / "pa.csv"
                if "--collect-metrics" in extra:
                    command += ["--metrics-url", f"{http}/metrics", "-f", str(csv)]
                done = subprocess.run(command, capture_output=True, text=True, timeout=600)
                text = done.stdout + done.stderr
                summary = [
                    line.strip()
                    for line in text.splitlines()
                    if "Throughput" in line or "latency" in line.lower() or "rror" in line
                ]
                print(f"== {name}: exit {done.returncode}")
                print("\n".join(summary[-6:]))
                report += [f"## {name} (exit {done.returncode})", "", "```text", text.strip()]
                if csv.exists():
                    report += ["", "-- CSV (-f) --", csv.read_text().strip()]
                report += ["```", ""]
        finally:
            server.stop()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(report) + "\n")
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
