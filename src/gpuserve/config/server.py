"""The server's process-wide settings (:class:`ServerConfig`): ``GPUSERVE_<FIELD>`` environment
variables and ``gpuserve serve`` flags, validated by pydantic-settings. Model configurations are
in :mod:`gpuserve.config.model`; :mod:`gpuserve.config` re-exports both.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


def default_model_repository() -> Path:
    """The repository shipped inside the package (``text_embedding`` and ``simple``)."""
    return Path(__file__).resolve().parent.parent / "default_repository"


class ServerConfig(BaseSettings):
    """Process-wide settings; each field can be set as ``GPUSERVE_<FIELD>`` or a CLI flag.

    Attributes:
        model_repository: Folder of models; defaults to the embedded repository.
        host: Address the HTTP server binds.
        http_port: HTTP port (KServe V2 REST).
        grpc_port: gRPC port (KServe V2 ``inference.GRPCInferenceService`` and the standard
            health service); 0 = a free port; -1 = no gRPC listener.
        log_level: ``debug``, ``info``, ``warning`` or ``error``.
        metrics_port: Port of a separate Prometheus ``/metrics`` listener on ``host``
            (0 = a free port; negative or None = none: ``/metrics`` only on the HTTP port).
        log_format: ``text`` lines, or ``json``: one JSON object per line.
        access_log: Log one line per HTTP request (logger ``gpuserve.access``, INFO).
        shutdown_timeout_s: On SIGTERM, how long queued and running requests may finish.
        max_request_body_bytes: Larger request bodies are refused with 413.
        model_control_mode: ``none`` loads every model at start and never changes them;
            ``explicit`` loads only ``load_model`` at start, then what the repository API
            loads and unloads; ``poll`` loads every model at start, then applies repository
            changes every ``repository_poll_interval_s``.
        load_model: Models to load at start in ``explicit`` mode (``*`` = all).
        repository_poll_interval_s: Seconds between repository scans in ``poll`` mode.
        unload_timeout_s: How long a version that is unloaded or replaced may take to finish
            its queued and running requests before the rest get 503.
        strict_readiness: False: ready when at least one model version is READY. True: ready
            only when every model required at start (or loaded since) has a READY version.
        disable_management: Refuse the repository's load/unload/rollback/canary endpoints
            (403); the index stays readable.
        management_token: When set, those endpoints need ``Authorization: Bearer <token>``
            (401 without it); setting it also enables them.
        trace_dir: Where ``POST /v2/repository/models/{m}/trace`` writes ``torch.profiler``
            traces (one sub-folder per call), and the only folder trace files may be in.
        trace_config: Triton's ``--trace-config`` entries: ``<setting>=<value>`` (``rate``,
            ``level``, ``count``, ``mode``), ``triton,<setting>=<value>`` (``file``,
            ``log-frequency``), ``opentelemetry,<setting>=<value>`` (``url``, ``resource``,
            ``bsp_max_queue_size``, ``bsp_schedule_delay``, ``bsp_max_export_batch_size``).
            From the environment: entries separated by ``;``.
        enable_management: Enable those endpoints in ``none`` mode. They are off unless
            enabled: by this, by a management token, or by ``explicit``/``poll`` mode
            (see :attr:`management_enabled`); ``disable_management`` always wins.
        api_token: When set, every endpoint except health (``/v2/health/live``,
            ``/v2/health/ready``, gRPC ServerLive/ServerReady and ``grpc.health.v1``),
            ``/metrics`` and ``/v2/openapi.json`` needs ``Authorization: Bearer <token>``
            (HTTP 401, gRPC UNAUTHENTICATED without it).
        tls_cert_file: PEM certificate (chain) for HTTPS and gRPC over TLS; needs
            ``tls_key_file``. None: plain HTTP and gRPC.
        tls_key_file: PEM private key of ``tls_cert_file``.
        max_header_bytes: Longest request line plus headers of one HTTP request (431 beyond),
            and the gRPC metadata limit.
        max_tensor_elements: Most elements in one input tensor (400 beyond, checked on the
            shape before any data is read).
        max_bytes_element_bytes: Longest element of a BYTES input, bytes (400 beyond).
        max_inputs_per_call: Most inputs (texts, documents, token-id rows) one call of the
            embeddings and retrieval APIs may carry: OpenAI's ``/v1/embeddings``, TEI's
            ``/embed``, ``/embed_sparse``, ``/predict``, ``/rerank``, ``/similarity``,
            ``/tokenize``, Cohere's ``/v1/rerank`` (413 beyond, nothing computed). A model's
            ``rerank.max_documents``, ``classification.max_inputs`` or ``sparse.max_inputs``
            may set a lower cap for it.
        http_keep_alive_timeout_s: An HTTP connection idle this many seconds is closed
            (0: never). Keep it above the idle timeout of any proxy in front (nginx keeps
            upstream connections 60 s), or the proxy may reuse a connection being closed.
        load_on_demand: Load each model at its first request instead of at start (that
            request, and those arriving meanwhile, wait for the load up to the model's
            ``default_timeout_us`` or ``model_load_timeout_s``); the server is ready with
            nothing loaded. Pinned models and ``load_model`` ones (explicit mode) load at
            start.
        max_loaded_models: Most models loaded at once (0: no limit): loading one more
            first unloads the least recently used model with nothing queued or running.
        loaded_models_memory_bytes: Most memory the loaded models may hold per device, bytes
            (0: no limit): GPU memory per device for models on GPUs, resident host memory
            for CPU models, as measured around each load and warm-up (approximate: what
            the process gained while the model loaded). Evicts as ``max_loaded_models``.
        idle_unload_s: Unload a model after this many seconds without a request (0: never;
            a model's own ``idle_unload_s`` wins); its next request loads it again.
        model_load_timeout_s: How long a request for a model that is not loaded waits for
            it to load (and for room to be made), seconds, when the model sets no
            ``default_timeout_us``; then 503 with the reason.
        allow_model_upload_code: Accept load requests whose ``file:<path>`` parameters carry
            files that run code when loaded (``.py``, pickled, TorchScript or
            ``torch.export`` files such as ``.pt``/``.pth``/``.pt2``/``.pkl``, native
            libraries) with no token set. Off by default: such uploads need a management
            token (or an API token when no management token is set), and are refused with
            403 otherwise.
        allow_client_shm: Serve Triton's system (and CUDA) shared-memory extension: clients
            register regions and send inputs / receive outputs through them instead of the
            request body (off by default: it lets a client make the server map its shm files).
        disable_auto_complete_config: Triton's ``--disable-auto-complete-config`` (and
            ``--strict-model-config=true``): nothing is filled in at load, neither by a
            Python model's completion hook (``auto_complete_config``, ``complete_config``)
            nor from a model file (ONNX, ``torch.export``, huggingface): every model must
            declare its inputs and outputs.
        admission_workers: Threads that run models' admission steps (the built-in text
            models count tokens and cut long texts there, per request, before batching);
            default: the CPU count, 1 to 4.
        admission_queue: Most requests waiting for or running an admission step at once;
            beyond it a request is refused with 429.
        admission_inline_bytes: A request whose inputs hold at most this many bytes runs its
            admission step on the event loop, at once (a short text costs tens of
            microseconds to measure: less than a hop to a worker thread and back, and it
            reaches the batcher sooner); larger ones go to the admission threads. 0: always
            the threads.
        malloc_arena_max: Most glibc malloc arenas (``mallopt(M_ARENA_MAX)`` at start;
            0: glibc's default, 8 per core). See the README's "Memory".
        malloc_mmap_threshold_bytes: Blocks of at least this many bytes are mapped and
            unmapped at ``free`` (``mallopt(M_MMAP_THRESHOLD)``), so varied-size tensors do
            not fragment the heap (0: glibc's dynamic threshold, which rises to 32 MiB).
        memory_trim_interval_s: ``malloc_trim(0)`` once the process is quiet after work, and
            at most this often while it is busy, seconds (0: never). All three are no-ops
            without glibc or with another allocator preloaded.
        state_dir: Where the Batch API keeps its files and its job store (SQLite), so jobs
            resume after a restart. None: ``.gpuserve-state`` beside the model repository
            when its parent folder is writable (and it is not the embedded repository), else
            the user's data directory (``$XDG_DATA_HOME/gpuserve/state``, by default
            ``~/.local/share/gpuserve/state``). Created when the Batch API is first used.
        batch_max_file_bytes: Largest file ``POST /v1/files`` accepts, bytes (413 beyond;
            the request body limit ``max_request_body_bytes`` applies first).
        batch_max_lines: Most lines (requests) in one uploaded batch file (413 beyond).
        batch_concurrent_lines: Batch lines in flight at once, all batches together (each
            line is one call to its endpoint).
        batch_file_ttl_s: Seconds a stored file (upload, batch output or errors) is kept
            before it expires and is deleted (never while an unfinished batch reads it); a
            finished batch's record is kept as long after it ended.
        batch_max_storage_bytes: Most bytes the state directory's files may hold; an upload
            past it is refused with 413 (0: no limit but expiry).
    """

    model_config = SettingsConfigDict(env_prefix="GPUSERVE_", extra="ignore")

    model_repository: Path = Field(default_factory=default_model_repository)
    host: str = "0.0.0.0"
    http_port: int = Field(default=8000, ge=0, le=65535)
    grpc_port: int = Field(default=8001, ge=-1, le=65535)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    metrics_port: int | None = Field(default=8002, le=65535)
    log_format: Literal["text", "json"] = "text"
    access_log: bool = False
    shutdown_timeout_s: float = Field(default=30.0, ge=0)
    max_request_body_bytes: int = Field(default=256 * 1024 * 1024, ge=1024)
    model_control_mode: Literal["none", "explicit", "poll"] = "none"
    load_model: Annotated[list[str], NoDecode] = Field(default_factory=list)
    repository_poll_interval_s: float = Field(default=15.0, gt=0)
    unload_timeout_s: float = Field(default=30.0, ge=0)
    strict_readiness: bool = False
    disable_management: bool = False
    management_token: SecretStr | None = None
    trace_dir: Path = Field(default_factory=lambda: Path(tempfile.gettempdir()) / "gpuserve-traces")
    trace_config: Annotated[list[str], NoDecode] = Field(default_factory=list)
    enable_management: bool = False
    api_token: SecretStr | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    max_header_bytes: int = Field(default=64 * 1024, ge=1024)
    max_tensor_elements: int = Field(default=64 * 1024 * 1024, ge=1)
    max_bytes_element_bytes: int = Field(default=64 * 1024 * 1024, ge=1)
    max_inputs_per_call: int = Field(default=2048, ge=1, le=1_000_000)
    http_keep_alive_timeout_s: float = Field(default=75.0, ge=0)
    load_on_demand: bool = False
    max_loaded_models: int = Field(default=0, ge=0)
    loaded_models_memory_bytes: int = Field(default=0, ge=0)
    idle_unload_s: float = Field(default=0.0, ge=0)
    model_load_timeout_s: float = Field(default=120.0, gt=0)
    allow_model_upload_code: bool = False
    allow_client_shm: bool = False
    disable_auto_complete_config: bool = False
    admission_workers: int = Field(
        default_factory=lambda: max(1, min(4, os.cpu_count() or 1)), ge=1, le=64
    )
    admission_queue: int = Field(default=1024, ge=1)
    admission_inline_bytes: int = Field(default=2048, ge=0)
    malloc_arena_max: int = Field(default=0, ge=0)
    malloc_mmap_threshold_bytes: int = Field(default=0, ge=0)
    memory_trim_interval_s: float = Field(default=5.0, ge=0)
    state_dir: Path | None = None
    batch_max_file_bytes: int = Field(default=200 * 1024 * 1024, ge=1)
    batch_max_lines: int = Field(default=50_000, ge=1)
    batch_concurrent_lines: int = Field(default=8, ge=1, le=4096)
    batch_file_ttl_s: float = Field(default=30 * 24 * 3600.0, gt=0)
    batch_max_storage_bytes: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _tls_pair(self) -> ServerConfig:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError(
                f"tls_cert_file ({self.tls_cert_file}) and tls_key_file ({self.tls_key_file}) "
                "go together: give both or neither"
            )
        return self

    @property
    def management_enabled(self) -> bool:
        """Whether the repository's load/unload/rollback/canary endpoints are on: off unless
        enabled (``enable_management``, a ``management_token``, or ``explicit``/``poll``
        mode, where the operator asked for a changing repository); ``disable_management``
        always turns them off."""
        if self.disable_management:
            return False
        return (
            self.enable_management
            or self.management_token is not None
            or self.model_control_mode != "none"
        )

    @field_validator("trace_config", mode="before")
    @classmethod
    def _split_trace_config(cls, value: Any) -> Any:
        # GPUSERVE_TRACE_CONFIG="mode=opentelemetry;rate=1" as well as a list (flags, code).
        if isinstance(value, str):
            return [entry.strip() for entry in value.split(";") if entry.strip()]
        return value

    @field_validator("load_model", mode="before")
    @classmethod
    def _split_names(cls, value: Any) -> Any:
        # GPUSERVE_LOAD_MODEL=a,b (the environment) as well as a list (flags, code).
        if isinstance(value, str):
            return [name.strip() for name in value.split(",") if name.strip()]
        return value
