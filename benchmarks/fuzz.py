#!/usr/bin/env python3
"""Long fuzz run against a live gpuserve: schemathesis over the OpenAPI document, plus
near-valid tensors for the served models.

The test suite fuzzes for about 20 s (``tests/integration/test_fuzz_openapi.py``); this runs
the same kind of fuzzing for ``--duration-s`` seconds against ``gpuserve serve`` (the real
CLI, started on a copy of four well-behaved fixture models, management enabled), round after
round with new seeds:

* **schema**: every operation of ``GET /v2/openapi.json``, schema-valid (positive) and
  schema-violating (negative) requests from schemathesis, each checked for no 5xx and for
  conformance (documented status, content type, headers, body schema);
* **tensors**: inference requests for each model, valid or with one aspect broken (random
  datatypes, shapes with zero, negative, huge or wrong dimensions, data of random JSON types
  and lengths, random parameters, binary bodies with wrong sizes and header lengths), each
  checked for 200 or 400 (or 503 "timed out in the queue" when the request set a
  ``timeout`` parameter: microseconds, so a tiny one expires before its batch forms).

Every request has a timeout (a hang is a failure), and after each round the server must be
live. Reports requests and statuses per kind, failures (first examples of each), and the
server's resident memory at start and end. Writes results/fuzz-<date>.json and .md.

Usage: python benchmarks/fuzz.py --duration-s 600 [--url http://host:port]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

import hypothesis  # noqa: E402
import schemathesis  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from tests.integration.test_fuzz_openapi import (  # noqa: E402
    CHECKS,
    FUZZED_MODELS,
    focus_on_models,
    fuzz_repository,
)

REQUEST_TIMEOUT_S = 10.0
DATATYPES = [
    "FP32",
    "FP16",
    "FP64",
    "INT64",
    "INT32",
    "INT8",
    "UINT8",
    "BOOL",
    "BYTES",
    "BF16",
    "X",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


class Tally:
    """Statuses and failures by kind."""

    def __init__(self) -> None:
        self.statuses: dict[str, collections.Counter[int]] = collections.defaultdict(
            collections.Counter
        )
        self.failures: collections.Counter[str] = collections.Counter()
        self.examples: dict[str, list[str]] = collections.defaultdict(list)

    def status(self, kind: str, code: int) -> None:
        self.statuses[kind][code] += 1

    def fail(self, kind: str, detail: str) -> None:
        self.failures[kind] += 1
        if len(self.examples[kind]) < 5:
            self.examples[kind].append(detail[:2000])


def schema_test(
    url: str, operation: Any, mode: GenerationMode, seed: int, examples: int, tally: Tally
):
    """A hypothesis test sending ``examples`` cases of ``operation`` in ``mode``."""
    kind = f"schema {operation.label} ({mode.value})"

    @given(operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
        phases=[hypothesis.Phase.generate],
    )
    @hypothesis.seed(seed)
    def run(case: Any) -> None:
        try:
            response = case.call(base_url=url, timeout=REQUEST_TIMEOUT_S)
        except Exception as err:  # a timeout or a dropped connection
            tally.fail(kind, f"{type(err).__name__}: {err}")
            return
        tally.status(kind, response.status_code)
        try:
            case.validate_response(response, checks=CHECKS)
        except Exception as err:
            tally.fail(kind, f"{err}\n{case.as_curl_command()}")

    return run


def schema_round(url: str, seed: int, examples: int, tally: Tally, deadline: float) -> None:
    document = focus_on_models(httpx.get(f"{url}/v2/openapi.json", timeout=10).json())
    schema = schemathesis.openapi.from_dict(document)
    schema.config.update(request_timeout=REQUEST_TIMEOUT_S)
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if time.monotonic() > deadline:
                return
            # nothing to negate for an operation without parameters or body
            with contextlib.suppress(hypothesis.errors.Unsatisfiable):
                schema_test(url, operation, mode, seed, examples, tally)()


#: model -> (input name, datatype, numpy dtype, non-batch shape; -1 = free)
MODELS: dict[str, tuple[str, str, str, list[int]]] = {
    "double_fp32": ("INPUT0", "FP32", "<f4", [16]),
    "varlen_fp32": ("X", "FP32", "<f4", [-1]),
    "tokens_int64": ("input_ids", "INT64", "<i8", [-1]),
    "echo_bytes": ("TEXT", "BYTES", "", [1]),
}


def tensor_requests() -> st.SearchStrategy[tuple[str, bytes, dict[str, str]]]:
    """(model, body, headers): a valid request for one of the fuzzed models, JSON or binary,
    with one aspect broken half of the time (datatype, shape, data, name, parameters, binary
    sizes and header length)."""
    dims = st.one_of(
        st.integers(0, 20), st.integers(-3, -1), st.sampled_from([16, 2**31, 2**63, 10**20])
    )
    element = st.one_of(
        st.floats(allow_nan=False, width=64),
        st.integers(-(2**70), 2**70),
        st.booleans(),
        st.text(max_size=20),
        st.none(),
    )

    @st.composite
    def build(draw: Any) -> tuple[str, bytes, dict[str, str]]:
        import numpy as np

        model = draw(st.sampled_from(FUZZED_MODELS))
        name, datatype, dtype, dims_declared = MODELS[model]
        rows = draw(st.integers(1, 8))
        shape = [rows] + [d if d != -1 else draw(st.integers(0, 12)) for d in dims_declared]
        count = int(np.prod(shape))
        if datatype == "BYTES":
            values: list[Any] = draw(st.lists(st.text(max_size=30), min_size=count, max_size=count))
        elif datatype == "INT64":
            values = draw(
                st.lists(st.integers(-(2**63), 2**63 - 1), min_size=count, max_size=count)
            )
        else:
            values = draw(
                st.lists(
                    st.floats(width=32, allow_nan=False, allow_infinity=False),
                    min_size=count,
                    max_size=count,
                )
            )
        tensor: dict[str, Any] = {"name": name, "shape": shape, "datatype": datatype}
        request: dict[str, Any] = {"id": draw(st.text(max_size=8)), "inputs": [tensor]}
        broken = draw(
            st.sampled_from(
                [None, None, None, "datatype", "shape", "data", "name", "parameters", "binary"]
            )
        )
        if broken == "datatype":
            tensor["datatype"] = draw(st.sampled_from(DATATYPES))
        elif broken == "shape":
            tensor["shape"] = draw(st.lists(dims, max_size=4))
        elif broken == "data":
            values = draw(st.one_of(st.lists(element, max_size=40), element))
        elif broken == "name":
            tensor["name"] = draw(st.text(max_size=10))
        elif broken == "parameters":
            key = draw(st.sampled_from(["priority", "timeout", "binary_data_output", "x"]))
            request["parameters"] = {key: draw(element)}
        headers = {"content-type": "application/json"}
        if draw(st.booleans()) and isinstance(values, list):  # binary tensor extension
            try:
                if datatype == "BYTES":
                    raw = b"".join(
                        len(v.encode()).to_bytes(4, "little") + v.encode() for v in values
                    )
                else:
                    raw = np.array(values, dtype=dtype).tobytes()
            except (TypeError, ValueError, OverflowError, AttributeError):
                raw = draw(st.binary(max_size=256))
            size = len(raw)
            if broken == "binary":
                size = draw(st.sampled_from([0, size + 1, max(size - 1, 0), 2**40]))
            tensor["parameters"] = {"binary_data_size": size}
            header = json.dumps(request).encode()
            length = len(header)
            if broken == "binary" and draw(st.booleans()):
                length = draw(st.sampled_from([0, length + 3, length - 1, 10**12]))
            headers["inference-header-content-length"] = str(length)
            return model, header + raw, headers
        tensor["data"] = values
        return model, json.dumps(request).encode(), headers

    return build()


def tensor_round(url: str, seed: int, examples: int, tally: Tally, client: httpx.Client) -> None:
    @given(tensor_requests())
    @settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
        phases=[hypothesis.Phase.generate],
    )
    @hypothesis.seed(seed)
    def run(item: tuple[str, bytes, dict[str, str]]) -> None:
        model, body, headers = item
        kind = f"tensors {model}"
        try:
            response = client.post(f"{url}/v2/models/{model}/infer", content=body, headers=headers)
        except Exception as err:
            tally.fail(kind, f"{type(err).__name__}: {err}")
            return
        tally.status(kind, response.status_code)
        # a queue timeout the request itself asked for (microseconds: it may be tiny)
        own_timeout = (
            response.status_code == 503
            and b'"timeout"' in body
            and "timed out in the queue" in response.text
        )
        if response.status_code not in (200, 400) and not own_timeout:
            tally.fail(kind, f"{response.status_code} {response.text[:300]} for {body[:300]!r}")
        elif not response.headers.get("content-type", "").startswith(
            ("application/json", "application/octet-stream")
        ):
            tally.fail(kind, f"content type {response.headers.get('content-type')}")

    run()


def write_report(result: dict[str, Any], output: Path) -> None:
    output.mkdir(parents=True, exist_ok=True)
    stamp = dt.date.today().isoformat()
    (output / f"fuzz-{stamp}.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"# Fuzz run {stamp}",
        "",
        f"{result['duration_s']:.0f} s, {result['rounds']} rounds, {result['requests']} requests, "
        f"**{result['failures']} failures**, server alive at the end: {result['alive']}.",
        f"Resident memory: {result['rss_start_mib']} MiB at start, {result['rss_end_mib']} MiB "
        "at the end.",
        "",
        "| kind | requests | statuses |",
        "|---|---:|---|",
    ]
    for kind, statuses in sorted(result["statuses"].items()):
        shown = ", ".join(f"{code}: {n}" for code, n in sorted(statuses.items()))
        lines.append(f"| {kind} | {sum(statuses.values())} | {shown} |")
    if result["failure_examples"]:
        lines += ["", "## Failures", ""]
        for kind, examples in result["failure_examples"].items():
            lines.append(f"### {kind} ({result['failures_by_kind'][kind]})")
            lines += ["```", *examples, "```"]
    (output / f"fuzz-{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--url", help="fuzz this server instead of starting one")
    parser.add_argument(
        "--examples", type=int, default=50, help="per operation and mode, per round"
    )
    parser.add_argument("--output", type=Path, default=HERE / "results")
    args = parser.parse_args()

    server = None
    workdir = None
    url = args.url
    if url is None:
        workdir = Path(tempfile.mkdtemp(prefix="gpuserve-fuzz-"))
        repository = fuzz_repository(workdir / "repository")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpuserve",
                "serve",
                "--model-repository",
                str(repository),
                "--host",
                "127.0.0.1",
                "--http-port",
                str(port),
                "--grpc-port",
                "-1",
                "--metrics-port",
                "-1",
                "--enable-management",
                "--log-level",
                "warning",
            ],
            env=env,
            stdout=(workdir / "server.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        end = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > end:
                print((workdir / "server.log").read_text(), file=sys.stderr)
                return 2
            time.sleep(0.1)
    pid = server.pid if server is not None else None
    rss_start = rss_bytes(pid)
    tally = Tally()
    started = time.monotonic()
    deadline = started + args.duration_s
    rounds = 0
    alive = True
    try:
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            while time.monotonic() < deadline and alive:
                seed = rounds * 7919 + 1
                schema_round(url, seed, args.examples, tally, deadline)
                tensor_round(url, seed, args.examples * 10, tally, client)
                rounds += 1
                try:
                    alive = client.get(f"{url}/v2/health/live").status_code == 200
                except httpx.HTTPError:
                    alive = False
                done = sum(sum(c.values()) for c in tally.statuses.values())
                print(
                    f"round {rounds}: {done} requests, {sum(tally.failures.values())} failures, "
                    f"{time.monotonic() - started:.0f} s",
                    flush=True,
                )
        rss_end = rss_bytes(pid)
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    result = {
        "duration_s": time.monotonic() - started,
        "rounds": rounds,
        "requests": sum(sum(c.values()) for c in tally.statuses.values()),
        "failures": sum(tally.failures.values()),
        "failures_by_kind": dict(tally.failures),
        "failure_examples": dict(tally.examples),
        "statuses": {k: {str(code): n for code, n in v.items()} for k, v in tally.statuses.items()},
        "alive": alive,
        "rss_start_mib": round(rss_start / 2**20, 1) if rss_start else None,
        "rss_end_mib": round(rss_end / 2**20, 1) if rss_end else None,
    }
    write_report(result, args.output)
    return 0 if result["failures"] == 0 and alive else 1


if __name__ == "__main__":
    sys.exit(main())
