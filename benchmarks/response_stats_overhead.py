"""What counting decoupled responses (``response_stats``, ``gpuserve_responses_total``) costs.

Serves ``tests/fixtures/response_stats`` in process and reads streams of ``--responses``
responses from the ``steps`` generator over HTTP server-sent events (httpx) and over a gRPC
stream (tritonclient), alternating rounds with the per-response counting on and off (off:
``DecoupledExecutor._counted`` replaced by a no-op in this process, the only part that
differs). Prints responses/s per arm and the ratio::

    .venv/bin/python benchmarks/response_stats_overhead.py --responses 2000 --rounds 5
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers import InProcessServer  # noqa: E402

from gpuserve.engine.streaming.executor import DecoupledExecutor  # noqa: E402


def sse_rate(server: InProcessServer, responses: int) -> float:
    body = {"COUNT": responses, "FAIL_AT": -1}
    start = time.perf_counter()
    seen = 0
    with (
        httpx.Client(base_url=server.url, timeout=60) as client,
        client.stream("POST", "/v2/models/steps/generate_stream", json=body) as reply,
    ):
        for line in reply.iter_lines():
            seen += line.startswith("data: ")
    assert seen == responses, seen
    return responses / (time.perf_counter() - start)


def grpc_rate(server: InProcessServer, responses: int) -> float:
    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put(error))
    inputs = []
    for name, value in (("COUNT", responses), ("FAIL_AT", -1)):
        tensor = grpcclient.InferInput(name, [1], "INT32")
        tensor.set_data_from_numpy(np.array([value], dtype=np.int32))
        inputs.append(tensor)
    start = time.perf_counter()
    client.async_stream_infer("steps", inputs)
    for _ in range(responses):
        assert results.get(timeout=60) is None
    elapsed = time.perf_counter() - start
    client.stop_stream()
    client.close()
    return responses / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--responses", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    counted = DecoupledExecutor._counted
    server = InProcessServer(ROOT / "tests" / "fixtures" / "response_stats")
    try:
        sse_rate(server, args.responses)  # warm-up: imports, connections, first stream
        grpc_rate(server, args.responses)
        rates: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            for arm in ("on", "off"):
                DecoupledExecutor._counted = (  # type: ignore[method-assign]
                    counted if arm == "on" else (lambda self, job, item: None)
                )
                for front, measure in (("sse", sse_rate), ("grpc", grpc_rate)):
                    rates.setdefault((front, arm), []).append(measure(server, args.responses))
    finally:
        DecoupledExecutor._counted = counted  # type: ignore[method-assign]
        server.stop()
    for front in ("sse", "grpc"):
        on = statistics.median(rates[(front, "on")])
        off = statistics.median(rates[(front, "off")])
        rounds = ", ".join(
            f"{a:.0f}/{b:.0f}"
            for a, b in zip(rates[(front, "on")], rates[(front, "off")], strict=True)
        )
        print(
            f"{front}: counting on {on:.0f} responses/s, off {off:.0f} "
            f"(on/off {on / off:.3f}; rounds on/off {rounds})"
        )


if __name__ == "__main__":
    main()
