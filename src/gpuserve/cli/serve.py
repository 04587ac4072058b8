"""``gpuserve serve``: run the server on a model repository.

Each flag can also be set through the environment (``GPUSERVE_MODEL_REPOSITORY``,
``GPUSERVE_HOST``, ``GPUSERVE_HTTP_PORT``, ``GPUSERVE_LOG_LEVEL``, ...); a flag wins over the
environment. With no flags the embedded default repository is served on port 8000.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

#: flag destination -> ServerConfig field (same names); None values are not overrides.
SERVE_FIELDS = ["model_repository", "host", "http_port", "log_level", "shutdown_timeout_s"]
SERVE_FIELDS += ["metrics_port", "log_format", "access_log"]  # observability (metrics, logs)
SERVE_FIELDS += ["grpc_port"]  # gRPC front end
SERVE_FIELDS += ["trace_dir", "trace_config"]  # profiler traces; request traces
SERVE_FIELDS += [  # model lifecycle
    "model_control_mode",
    "load_model",
    "repository_poll_interval_s",
    "unload_timeout_s",
    "strict_readiness",
    "disable_management",
    "management_token",
]
SERVE_FIELDS += [  # many models on few devices: load on demand, limits, idle unload
    "load_on_demand",
    "max_loaded_models",
    "loaded_models_memory_bytes",
    "idle_unload_s",
    "model_load_timeout_s",
]
SERVE_FIELDS += [  # security and limits
    "enable_management",
    "allow_model_upload_code",
    "api_token",
    "tls_cert_file",
    "tls_key_file",
    "max_header_bytes",
    "max_tensor_elements",
    "max_bytes_element_bytes",
    "max_inputs_per_call",
    "http_keep_alive_timeout_s",
]
SERVE_FIELDS += ["allow_client_shm"]  # Triton's shared-memory extension
SERVE_FIELDS += ["disable_auto_complete_config"]  # Triton's auto-complete switch
SERVE_FIELDS += [  # models' admission steps
    "admission_workers",
    "admission_queue",
    "admission_inline_bytes",
]
SERVE_FIELDS += ["malloc_arena_max", "malloc_mmap_threshold_bytes", "memory_trim_interval_s"]
SERVE_FIELDS += [  # the Batch API: its state directory and limits
    "state_dir",
    "batch_max_file_bytes",
    "batch_max_lines",
    "batch_concurrent_lines",
    "batch_file_ttl_s",
    "batch_max_storage_bytes",
]


def _boolean(text: str) -> bool:
    """Triton's boolean flag values: true/false, 1/0, yes/no, on/off (any case)."""
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def register(sub: Any) -> None:
    serve = sub.add_parser("serve", help="serve a model repository over KServe V2")
    serve.add_argument(
        "--model-repository",
        type=Path,
        help="model repository folder "
        "(default: the embedded repository with text_embedding and simple)",
    )
    serve.add_argument("--host", help="bind address (default 0.0.0.0)")
    serve.add_argument("--http-port", type=int, help="HTTP port (default 8000)")
    serve.add_argument(
        "--grpc-port",
        type=int,
        help="gRPC port (default 8001; 0 = a free port; -1 = no gRPC listener)",
    )
    serve.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        help="least severe log messages shown (default info)",
    )
    serve.add_argument(
        "--log-format", choices=["text", "json"], help="text lines (default) or JSON objects"
    )
    serve.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="log one line per HTTP request (logger gpuserve.access; default off)",
    )
    serve.add_argument(
        "--trace-dir",
        type=Path,
        help="where on-demand torch.profiler traces are written (default $TMPDIR/gpuserve-traces)",
    )
    serve.add_argument(
        "--trace-config",
        action="append",
        metavar="[MODE,]SETTING=VALUE",
        help="request tracing, Triton's syntax (repeatable): rate=N, level=TIMESTAMPS, "
        "count=N, mode=triton|opentelemetry, triton,file=NAME, triton,log-frequency=N, "
        "opentelemetry,url=URL, opentelemetry,resource=KEY=VALUE, opentelemetry,bsp_*=N "
        "(opentelemetry needs pip install 'gpuserve[tracing]')",
    )
    serve.add_argument(
        "--metrics-port",
        type=int,
        help="port of a separate Prometheus /metrics listener (default 8002; 0 = a free "
        "port; -1 = none: /metrics only on the HTTP port)",
    )
    serve.add_argument(
        "--shutdown-timeout-s",
        type=float,
        help="seconds in-flight requests may take to finish on SIGTERM (default 30)",
    )
    _lifecycle_flags(serve)
    _residency_flags(serve)
    _security_flags(serve)
    _memory_flags(serve)
    _admission_flags(serve)
    _batch_flags(serve)
    serve.set_defaults(func=run)


def _batch_flags(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--state-dir",
        type=Path,
        help="where the Batch API keeps its files and job store, so jobs resume after a "
        "restart (default: .gpuserve-state beside the model repository, or "
        "~/.local/share/gpuserve/state when that folder is not writable)",
    )
    serve.add_argument(
        "--batch-max-file-bytes",
        type=int,
        help="largest file POST /v1/files accepts, bytes (413 beyond; default 209715200)",
    )
    serve.add_argument(
        "--batch-max-lines",
        type=int,
        help="most lines (requests) in one batch file (413 beyond; default 50000)",
    )
    serve.add_argument(
        "--batch-concurrent-lines",
        type=int,
        help="batch lines in flight at once, all batches together (default 8)",
    )
    serve.add_argument(
        "--batch-file-ttl-s",
        type=float,
        help="seconds a stored file is kept before it expires (default 2592000: 30 days)",
    )
    serve.add_argument(
        "--batch-max-storage-bytes",
        type=int,
        help="most bytes the Batch API's files may hold; uploads past it get 413 "
        "(default 0: no limit but expiry)",
    )


def _admission_flags(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--admission-workers",
        type=int,
        help="threads running models' admission steps (text models count tokens and cut "
        "long texts there, before batching; default: the CPU count, 1 to 4)",
    )
    serve.add_argument(
        "--admission-queue",
        type=int,
        help="most requests waiting for an admission step at once; beyond it 429 (default 1024)",
    )
    serve.add_argument(
        "--admission-inline-bytes",
        type=int,
        help="requests whose inputs hold at most this many bytes run their admission step on "
        "the event loop, at once (default 2048; 0: always the admission threads)",
    )


def _memory_flags(serve: argparse.ArgumentParser) -> None:
    # flat resident memory under varied shapes (gpuserve.server.memory; README "Memory")
    serve.add_argument(
        "--malloc-arena-max",
        type=int,
        help="most glibc malloc arenas (default 0: glibc's default, 8 per core)",
    )
    serve.add_argument(
        "--malloc-mmap-threshold-bytes",
        type=int,
        help="malloc blocks this large or larger are mapped and unmapped at free (default 0: "
        "glibc's dynamic threshold; 1048576 keeps memory flatter at some cost in speed)",
    )
    serve.add_argument(
        "--memory-trim-interval-s",
        type=float,
        help="malloc_trim when the server goes quiet, and at most this often while busy, "
        "seconds (default 5; 0: never)",
    )


def _security_flags(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--api-token",
        help="bearer token every endpoint but health, /metrics and /v2/openapi.json requires "
        "(or GPUSERVE_API_TOKEN; default none)",
    )
    serve.add_argument(
        "--tls-cert-file",
        type=Path,
        help="PEM certificate: serve HTTPS and gRPC over TLS (needs --tls-key-file)",
    )
    serve.add_argument("--tls-key-file", type=Path, help="PEM private key of --tls-cert-file")
    serve.add_argument(
        "--allow-client-shm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve Triton's system/CUDA shared-memory extension: tensors through regions "
        "clients register (or GPUSERVE_ALLOW_CLIENT_SHM; default off)",
    )
    serve.add_argument(
        "--disable-auto-complete-config",
        action="store_true",
        default=None,
        help="fill in nothing at load (Triton's flag): no Python model completion hook "
        "(auto_complete_config, Model.complete_config), no tensors read from model files; "
        "every config declares its inputs and outputs (or GPUSERVE_DISABLE_AUTO_COMPLETE_CONFIG)",
    )
    serve.add_argument(
        "--strict-model-config",
        type=_boolean,
        metavar="BOOL",
        help="Triton's older spelling: true is --disable-auto-complete-config, false leaves "
        "auto-complete on (default false)",
    )
    serve.add_argument(
        "--max-header-bytes",
        type=int,
        help="longest request line + headers (431 beyond) and gRPC metadata (default 65536)",
    )
    serve.add_argument(
        "--http-keep-alive-timeout-s",
        type=float,
        help="close HTTP connections idle this long, seconds (0: never; default 75; keep it "
        "above the idle timeout of a proxy in front)",
    )
    serve.add_argument(
        "--max-tensor-elements",
        type=int,
        help="most elements in one input tensor (400 beyond; default 67108864)",
    )
    serve.add_argument(
        "--max-bytes-element-bytes",
        type=int,
        help="longest element of a BYTES input (400 beyond; default 67108864)",
    )
    serve.add_argument(
        "--max-inputs-per-call",
        type=int,
        help="most inputs (texts, documents) one call of the embeddings, rerank and "
        "classification APIs may carry (413 beyond; default 2048)",
    )


def _residency_flags(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--load-on-demand",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="load each model at its first request instead of at start (requests wait for "
        "the load); ready with nothing loaded (or GPUSERVE_LOAD_ON_DEMAND; default off)",
    )
    serve.add_argument(
        "--max-loaded-models",
        type=int,
        help="most models loaded at once; the least recently used idle one is unloaded "
        "first (default 0: no limit)",
    )
    serve.add_argument(
        "--loaded-models-memory-bytes",
        type=int,
        help="most memory loaded models may hold per device, bytes (GPU memory for GPU "
        "models, resident host memory for CPU models, measured at load; default 0: no limit)",
    )
    serve.add_argument(
        "--idle-unload-s",
        type=float,
        help="unload a model after this many seconds without a request; its next request "
        "loads it again (default 0: never; a model's idle_unload_s wins)",
    )
    serve.add_argument(
        "--model-load-timeout-s",
        type=float,
        help="how long a request waits for its model to load when the model sets no "
        "default_timeout_us, seconds (default 120)",
    )


def _lifecycle_flags(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--model-control-mode",
        choices=["none", "explicit", "poll"],
        help="none: load every model at start (default); explicit: load only --load-model, "
        "then what the repository API loads; poll: also apply repository changes",
    )
    serve.add_argument(
        "--load-model",
        action="append",
        metavar="NAME",
        help="model to load at start in explicit mode (repeatable; '*' = all)",
    )
    serve.add_argument(
        "--repository-poll-interval-s",
        type=float,
        help="seconds between repository scans in poll mode (default 15)",
    )
    serve.add_argument(
        "--unload-timeout-s",
        type=float,
        help="seconds an unloaded or replaced version may take to finish its requests (default 30)",
    )
    serve.add_argument(
        "--strict-readiness",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ready only when every required model has a READY version (default: ready when "
        "any version is READY)",
    )
    serve.add_argument(
        "--disable-management",
        action="store_true",
        default=None,
        help="refuse the load/unload/rollback/canary endpoints (403), whatever enables them",
    )
    serve.add_argument(
        "--enable-management",
        action="store_true",
        default=None,
        help="enable the load/unload/rollback/canary endpoints (off by default in 'none' "
        "mode; on in explicit/poll mode or with a management token)",
    )
    serve.add_argument(
        "--allow-model-upload-code",
        action="store_true",
        default=None,
        help="accept load requests whose file: parameters carry code (model.py, pickled or "
        "TorchScript files) with no token set (default: they need the management token)",
    )
    serve.add_argument(
        "--management-token",
        help="bearer token the load/unload/rollback/canary endpoints require; enables them (or "
        "GPUSERVE_MANAGEMENT_TOKEN)",
    )


def run(args: argparse.Namespace) -> int:
    """Check the settings, the repository and the ports, then serve until a signal.

    Returns:
        0 after a clean shutdown; 2 for an invalid setting (also a ``--trace-config`` entry,
        or its mode's missing extra), a model repository that is not a readable folder, or a
        port another process holds (one line on stderr naming it,
        before anything heavy is imported); the server exits 1 when it fails while starting.
    """
    from gpuserve.config import ServerConfig
    from gpuserve.server.startup import StartupError, preflight

    overrides = {
        name: getattr(args, name) for name in SERVE_FIELDS if getattr(args, name, None) is not None
    }
    strict = getattr(args, "strict_model_config", None)
    if strict is not None:  # --disable-auto-complete-config wins when both are given
        overrides.setdefault("disable_auto_complete_config", strict)
    try:
        config = ServerConfig(**overrides)
    except ValidationError as err:
        for item in err.errors():
            field = ".".join(str(p) for p in item["loc"])
            print(
                f"gpuserve: invalid setting {field}: {item['msg']} (given: {item.get('input')!r})",
                file=sys.stderr,
            )
        return 2
    try:
        preflight(config)
    except StartupError as err:
        for problem in err.problems:
            print(f"gpuserve: {problem}", file=sys.stderr)
        return 2
    from gpuserve.server.logs import configure_logging
    from gpuserve.server.memory import start_memory_care

    configure_logging(config.log_level, config.log_format, config.access_log)
    memory = start_memory_care(config)  # malloc settings before torch and any thread
    from gpuserve.errors import ConfigError
    from gpuserve.server.runner import GpuServer

    try:
        try:
            server = GpuServer(config)
        except ConfigError as err:  # a server setting (--trace-config, its extra): one line
            print(f"gpuserve: {err.message}", file=sys.stderr)
            return 2
        server.run()
    finally:
        memory.stop()
    return 0
