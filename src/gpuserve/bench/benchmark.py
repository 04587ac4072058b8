"""One benchmark run from start to end: resolve the model, build requests, sweep, collect.

:func:`run_benchmark` is what ``gpuserve bench`` and ``gpuserve tune`` call::

    config = BenchConfig(url="http://127.0.0.1:8000", model="text_embedding",
                         mode="concurrency", levels=[1, 2, 4, 8])
    result = run_benchmark(config)          # blocking; runs its own event loop
    result.levels[0].p99_ms, result.as_dict()
"""

from __future__ import annotations

import datetime as dt
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from gpuserve.bench import server_info
from gpuserve.bench.inputs import ModelInfo, generate_samples, load_samples
from gpuserve.bench.lines import read_input_lines
from gpuserve.bench.loadgen import (
    LevelResult,
    LoadSettings,
    Mode,
    OnWindow,
    ServerProbe,
    StopRule,
    run_async,
    run_sweep,
)
from gpuserve.bench.targets import GrpcTarget, HttpTarget, Target
from gpuserve.bench.tokens import TokenCounts, count_tokens


@dataclass
class BenchConfig:
    """Everything one benchmark run needs.

    Attributes:
        url: HTTP base URL of the server (metadata, statistics, and the load over HTTP).
        model / version: Model under test; version None = the server's default.
        protocol: ``http`` or ``grpc``.
        grpc_url: ``host:port`` of the gRPC endpoint (gRPC mode).
        binary: Binary tensors (HTTP binary extension / gRPC raw contents) instead of JSON.
        mode / levels: ``concurrency`` workers or ``rate`` requests/s, one result per level.
        batch_size: Rows per request (models that batch).
        shapes: Non-batch dims of variable inputs, ``{name: [dims]}``.
        input_data: perf_analyzer-style JSON file of requests instead of generated data.
        input_lines: File of one request per line (a V2 JSON body or a text; see
            :mod:`gpuserve.bench.lines`), e.g. inputs of varied length.
        input_format: ``auto``, ``json`` or ``text`` for ``input_lines``.
        tokens: How requests are sized for tokens/s (:mod:`gpuserve.bench.tokens`):
            ``auto``, ``server``, ``words`` or a tokenizer path; None: ``auto`` with
            ``input_lines``, no sizing otherwise.
        max_seq_len: Truncation when ``tokens`` is a tokenizer path (None: its folder's).
        samples: Distinct generated requests to cycle through.
        metrics_url: Prometheus endpoint with GPU series; None = ``{url}/metrics``.
        token: The server's API bearer token, or None.
        ca_file: PEM file that signs the server's TLS certificate (``https://`` URLs and
            ``grpcs://`` gRPC addresses); None: the system's CAs.
        settings: Windows, warm-up, timeouts.
    """

    url: str = "http://127.0.0.1:8000"
    model: str | None = None
    version: str | None = None
    protocol: Literal["http", "grpc"] = "http"
    grpc_url: str = "127.0.0.1:8001"
    binary: bool = False
    mode: Mode = "concurrency"
    levels: list[float] = field(default_factory=lambda: [1.0])
    batch_size: int = 1
    shapes: dict[str, list[int]] = field(default_factory=dict)
    input_data: Path | None = None
    input_lines: Path | None = None
    input_format: str = "auto"
    tokens: str | None = None
    max_seq_len: int | None = None
    samples: int = 16
    metrics_url: str | None = None
    token: str | None = None
    ca_file: Path | None = None
    settings: LoadSettings = field(default_factory=LoadSettings)


@dataclass
class BenchResult:
    """A finished run: the configuration, the model, one result per level, and how the
    requests were sized in tokens (None: not sized)."""

    config: BenchConfig
    model: ModelInfo
    target: str
    levels: list[LevelResult]
    started: str
    host: str = field(default_factory=platform.node)
    token_counts: TokenCounts | None = None

    def best(self, p99_budget_ms: float | None = None) -> LevelResult | None:
        """The level with the highest throughput (with p99 within the budget, if given) and
        no errors, or None."""
        fits = [
            r
            for r in self.levels
            if not r.summary.errors
            and r.summary.ok
            and (p99_budget_ms is None or r.p99_ms <= p99_budget_ms)
        ]
        return max(fits, key=lambda r: r.throughput) if fits else None

    def as_dict(self) -> dict[str, Any]:
        config = asdict(self.config)
        config["input_data"] = str(self.config.input_data) if self.config.input_data else None
        config["input_lines"] = str(self.config.input_lines) if self.config.input_lines else None
        counts = self.token_counts
        return {
            "tool": "gpuserve bench",
            "started": self.started,
            "host": self.host,
            "model": self.model.name,
            "version": self.model.version,
            "target": self.target,
            "config": config,
            "tokens": None
            if counts is None
            else {"source": counts.source, "unit": counts.unit, "detail": counts.detail},
            "levels": [r.as_dict() for r in self.levels],
        }


def resolve_model(
    url: str,
    model: str | None,
    version: str | None,
    token: str | None = None,
    ca_file: Path | None = None,
) -> ModelInfo:
    """Metadata of ``model``; with no model named, the server's only ready model.

    Raises:
        server_info.ServerError: unreachable server, unknown model, or several models and
            none named.
    """
    if model is None:
        names = server_info.list_models(url, token, ca_file)
        if len(names) != 1:
            listed = ", ".join(names) or "none found"
            raise server_info.ServerError(f"name the model with --model (models: {listed})")
        model = names[0]
    return server_info.fetch_model_info(url, model, version, token, ca_file)


def build_target(config: BenchConfig, info: ModelInfo) -> Target:
    """The HTTP or gRPC target with the run's requests pre-encoded."""
    return prepare_target(config, info)[0]


def prepare_target(config: BenchConfig, info: ModelInfo) -> tuple[Target, TokenCounts | None]:
    """The target (requests pre-encoded) and, when sized, each request's tokens (also set as
    the target's ``sample_tokens``).

    Raises:
        ValueError: bad input data, or a tokenizer path that does not load.
        server_info.ServerError: ``tokens="server"`` and the server cannot count.
    """
    texts: list[list[str]] = []
    if config.input_lines is not None:
        lines = read_input_lines(
            config.input_lines, info, config.batch_size if info.batching else 1, config.input_format
        )
        samples, texts = lines.samples, lines.texts
    elif config.input_data is not None:
        samples = load_samples(config.input_data, info, config.batch_size)
    else:
        samples = generate_samples(info, config.batch_size, config.shapes, config.samples)
    spec = config.tokens or ("auto" if config.input_lines is not None else None)
    counts = None
    if spec is not None:
        if not texts:
            texts = [_sample_texts(info, sample) for sample in samples]
        url = _base(config.url)
        counts = count_tokens(
            texts, spec, url, info.name, config.token, config.ca_file, config.max_seq_len
        )
    target = _make_target(config, info, samples)
    if counts is not None:
        target.sample_tokens = counts.per_sample  # type: ignore[union-attr]
    return target, counts


def _sample_texts(info: ModelInfo, sample: dict[str, np.ndarray]) -> list[str]:
    """The strings of a request's BYTES inputs (generated or perf_analyzer-file samples)."""
    out: list[str] = []
    for tensor in info.inputs:
        if tensor.datatype == "BYTES" and tensor.name in sample:
            out.extend(v.decode("utf-8", "replace") for v in sample[tensor.name].ravel())
    return out


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url if "://" in url else "http://" + url


def _make_target(
    config: BenchConfig, info: ModelInfo, samples: list[dict[str, np.ndarray]]
) -> HttpTarget | GrpcTarget:
    timeout = config.settings.timeout_s
    if config.protocol == "grpc":
        return GrpcTarget(
            config.grpc_url,
            info,
            samples,
            config.binary,
            timeout,
            token=config.token,
            ca_file=config.ca_file,
        )
    return HttpTarget(
        config.url,
        info,
        samples,
        config.binary,
        timeout,
        token=config.token,
        ca_file=config.ca_file,
    )


def run_benchmark(
    config: BenchConfig,
    on_window: OnWindow | None = None,
    on_level: Callable[[LevelResult], None] | None = None,
    stop: StopRule | None = None,
    info: ModelInfo | None = None,
) -> BenchResult:
    """Run the whole sweep (blocking).

    Raises:
        server_info.ServerError: the model could not be resolved.
        ValueError: bad input data or shapes.
    """
    url = _base(config.url)
    info = info or resolve_model(url, config.model, config.version, config.token, config.ca_file)
    target, counts = prepare_target(config, info)
    probe = ServerProbe(
        url,
        info.name,
        info.version,
        config.metrics_url or f"{url}/metrics",
        config.token,
        config.ca_file,
    )
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    batch_size = config.batch_size if info.batching else 1

    async def main() -> list[LevelResult]:
        try:
            return await run_sweep(
                target,
                config.mode,
                config.levels,
                config.settings,
                probe,
                batch_size,
                on_window,
                on_level,
                stop,
            )
        finally:
            await target.close()

    levels = run_async(main())
    return BenchResult(config, info, target.description, levels, started, token_counts=counts)
