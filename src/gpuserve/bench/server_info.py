"""Control-plane reads of the server under test: metadata, statistics, Prometheus metrics.

These calls are few (before and after each measurement, and one metrics scrape a second), so
they use blocking ``urllib``; the load generator runs them in a worker thread.
"""

from __future__ import annotations

import json
import math
import re
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuserve.bench.inputs import ModelInfo


class ServerError(Exception):
    """The server could not be reached or refused a control-plane call."""


def auth_headers(token: str | None) -> dict[str, str]:
    """``Authorization: Bearer <token>`` for a server with an API token; empty without."""
    return {"authorization": f"Bearer {token}"} if token else {}


def get_json(
    url: str,
    timeout_s: float = 10.0,
    method: str = "GET",
    token: str | None = None,
    ca_file: str | Path | None = None,
) -> Any:
    """GET (or POST with an empty body) ``url`` and parse its JSON; ``token`` is sent as a
    bearer token when given; an https URL is verified against ``ca_file`` (PEM) when given,
    else the system's CAs.

    Raises:
        ServerError: not reachable, a non-200 answer (its error text is quoted), or not JSON.
    """
    data = b"" if method == "POST" else None
    request = urllib.request.Request(url, data=data, method=method, headers=auth_headers(token))
    try:
        context = ssl.create_default_context(cafile=str(ca_file)) if ca_file else None
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:
        detail = err.read()[:300].decode("utf-8", "replace")
        raise ServerError(f"{method} {url}: HTTP {err.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as err:
        raise ServerError(f"{method} {url}: {getattr(err, 'reason', err)}") from None
    except json.JSONDecodeError:
        raise ServerError(f"{method} {url}: the answer is not JSON") from None


def get_text(url: str, timeout_s: float = 5.0, ca_file: str | Path | None = None) -> str | None:
    """The body of ``url`` as text, or None when it is unreachable or not 200."""
    context = ssl.create_default_context(cafile=str(ca_file)) if ca_file else None
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as response:
            return response.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError):
        return None


def model_path(base_url: str, model: str, version: str | None) -> str:
    path = f"{base_url}/v2/models/{model}"
    return f"{path}/versions/{version}" if version else path


def fetch_model_info(
    base_url: str,
    model: str,
    version: str | None = None,
    token: str | None = None,
    ca_file: str | Path | None = None,
) -> ModelInfo:
    """Metadata (and config, when the server has the extension) of the model under test.

    Raises:
        ServerError: the model is unknown or not ready, or the server is unreachable.
    """
    path = model_path(base_url, model, version)
    metadata = get_json(path, token=token, ca_file=ca_file)
    try:
        config = get_json(f"{path}/config", token=token, ca_file=ca_file)
    except ServerError:
        config = None
    if isinstance(config, dict) and "config" in config:  # Triton wraps it
        config = config["config"]
    return ModelInfo.from_metadata(metadata, config if isinstance(config, dict) else None, version)


def list_models(
    base_url: str, token: str | None = None, ca_file: str | Path | None = None
) -> list[str]:
    """Names of the server's ready models (repository index extension), or [] if absent."""
    try:
        index = get_json(
            f"{base_url}/v2/repository/index", method="POST", token=token, ca_file=ca_file
        )
    except ServerError:
        return []
    names = [
        m.get("name") for m in index if isinstance(m, dict) and m.get("state", "READY") == "READY"
    ]
    return sorted({n for n in names if n})


@dataclass(slots=True)
class StatsSnapshot:
    """Cumulative counters of the statistics extension for one model (all versions)."""

    success_count: int = 0
    queue_ns: int = 0
    queue_count: int = 0
    compute_ns: int = 0
    compute_count: int = 0
    execution_count: int = 0
    inference_count: int = 0


def fetch_stats(
    base_url: str,
    model: str,
    version: str | None,
    token: str | None = None,
    ca_file: str | Path | None = None,
) -> StatsSnapshot | None:
    """The statistics extension's counters, or None when the server has no such endpoint."""
    try:
        body = get_json(
            f"{model_path(base_url, model, version)}/stats", token=token, ca_file=ca_file
        )
    except ServerError:
        return None
    snap = StatsSnapshot()
    for entry in body.get("model_stats", []):
        stats = entry.get("inference_stats", {})
        snap.success_count += int(stats.get("success", {}).get("count", 0))
        snap.queue_ns += int(stats.get("queue", {}).get("ns", 0))
        snap.queue_count += int(stats.get("queue", {}).get("count", 0))
        infer = stats.get("compute_infer", {})
        snap.compute_count += int(infer.get("count", 0))
        for stage in ("compute_input", "compute_infer", "compute_output"):
            snap.compute_ns += int(stats.get(stage, {}).get("ns", 0))
        snap.execution_count += int(entry.get("execution_count", 0))
        snap.inference_count += int(entry.get("inference_count", 0))
    return snap


def stats_split(
    before: StatsSnapshot | None, after: StatsSnapshot | None
) -> dict[str, float] | None:
    """Server-side split between two snapshots: mean queue and compute ms per request (or
    per batch for compute, as the statistics extension counts it), rows per execution."""
    if before is None or after is None:
        return None
    queue_count = after.queue_count - before.queue_count
    compute_count = after.compute_count - before.compute_count
    executions = after.execution_count - before.execution_count
    if queue_count <= 0 or compute_count <= 0:
        return None
    split = {
        "queue_ms": (after.queue_ns - before.queue_ns) / queue_count / 1e6,
        "compute_ms": (after.compute_ns - before.compute_ns) / compute_count / 1e6,
    }
    if executions > 0:
        split["rows_per_batch"] = (after.inference_count - before.inference_count) / executions
    return split


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
GPU_PREFIXES = ("gpuserve_gpu_", "nv_gpu_")


def parse_gpu_metrics(text: str) -> dict[str, float]:
    """GPU series of a Prometheus exposition: ``name{labels}`` -> value.

    Reads gpuserve's ``gpuserve_gpu_*`` series and Triton's ``nv_gpu_*``; other series and
    comments are ignored.
    """
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(GPU_PREFIXES):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        if not math.isnan(value):
            values[match.group(1) + (match.group(2) or "")] = value
    return values


@dataclass(slots=True)
class GpuSampler:
    """Averages of the GPU series over the scrapes taken in one measurement."""

    sums: dict[str, float] = field(default_factory=dict)
    count: int = 0

    def add(self, values: dict[str, float]) -> None:
        if not values:
            return
        self.count += 1
        for key, value in values.items():
            self.sums[key] = self.sums.get(key, 0.0) + value

    def means(self) -> dict[str, float]:
        return {k: v / self.count for k, v in sorted(self.sums.items())} if self.count else {}


def gpu_summary(means: dict[str, float]) -> dict[str, float]:
    """Utilisation (mean over GPUs, as exported) and memory used (sum over GPUs, bytes)."""
    util = [v for k, v in means.items() if "util" in k.split("{")[0]]
    memory = [v for k, v in means.items() if "memory_used" in k.split("{")[0]]
    summary: dict[str, float] = {}
    if util:
        summary["gpu_utilization"] = sum(util) / len(util)
    if memory:
        summary["gpu_memory_used_bytes"] = sum(memory)
    return summary
