"""Typed configuration: the server's settings and each model's ``config.yaml``.

Units are part of field names (``max_queue_delay_us``, ``request_timeout_s``). Names follow
Triton's model configuration wherever Triton has a name for the thing (``max_batch_size``,
``dynamic_batching``, ``preferred_batch_sizes``, ``instance_group``, ``version_policy``).

Model configs are validated with pydantic; :func:`load_model_config` turns a validation
failure into a :class:`~gpuserve.errors.ConfigError` whose message names the file, the field,
the value given and what is allowed.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from gpuserve.datatypes import Datatype
from gpuserve.errors import ConfigError

CONFIG_FILENAME = "config.yaml"


class _Strict(BaseModel):
    """Base for config sections: unknown keys are errors, so typos are caught at load."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorSpec(_Strict):
    """One declared input or output.

    Attributes:
        name: Tensor name used on the wire.
        datatype: KServe V2 datatype (FP32, INT64, BYTES, ...).
        shape: Shape without the batch dimension; ``-1`` marks a variable dimension.
            ``[]`` declares one value per batch row.
        optional: Inputs only: the request may omit it.
    """

    name: str = Field(min_length=1)
    datatype: Datatype
    shape: list[int]
    optional: bool = False

    @field_validator("shape")
    @classmethod
    def _dims(cls, shape: list[int]) -> list[int]:
        for dim in shape:
            if dim < -1 or dim == 0:
                raise ValueError(f"each dim must be a positive integer or -1, got {dim}")
        return shape


class AdaptiveBatchingConfig(_Strict):
    """Adaptive batching (``dynamic_batching.adaptive``): the batcher sets its own queue delay
    and batch-size cap from measured batch latency to keep p99 latency near the target.

    Attributes:
        target_p99_ms: Latency target, milliseconds. ``max_queue_delay_us`` is then only the
            delay used until the first batch has been measured.
    """

    target_p99_ms: float = Field(gt=0, le=600_000)


class DynamicBatchingConfig(_Strict):
    """How requests are merged into batches (Triton's ``dynamic_batching``).

    Attributes:
        max_queue_delay_us: Longest a request waits for others to join its batch,
            microseconds. 0 sends whatever is queued as soon as an instance is free, which
            still batches under load (requests gather while the instance is busy).
        preferred_batch_sizes: Batch sizes (rows) to send at once when reachable, without
            waiting out ``max_queue_delay_us``.
        max_queue_size: Most requests held in the queue; one more is refused with 429.
        default_timeout_us: Queue timeout of a request that names none, microseconds;
            0 means no timeout. A request past it is refused with 503 and never run.
        priority_levels: Number of priority levels; level 1 is served first.
        default_priority_level: Level of a request that names none.
        early_dispatch: Send a batch before ``max_queue_delay_us`` runs out once as many rows
            are queued as the previous batch carried (under a steady load that is all that is
            coming: waiting longer only idles the instance); and when an instance frees up,
            let a batch regather to that size for up to the smaller of the delay and a tenth
            of the finished batch's time (see :mod:`gpuserve.engine.batcher`).
        adaptive: Adaptive batching settings; None (default) keeps the fixed delay.
    """

    max_queue_delay_us: int = Field(default=0, ge=0, le=60_000_000)
    preferred_batch_sizes: list[int] = Field(default_factory=list)
    max_queue_size: int = Field(default=1024, ge=1)
    default_timeout_us: int = Field(default=0, ge=0)
    priority_levels: int = Field(default=1, ge=1, le=16)
    default_priority_level: int = Field(default=1, ge=1)
    early_dispatch: bool = True
    adaptive: AdaptiveBatchingConfig | None = None

    @model_validator(mode="after")
    def _check(self) -> DynamicBatchingConfig:
        if self.default_priority_level > self.priority_levels:
            raise ValueError(
                f"default_priority_level={self.default_priority_level} exceeds "
                f"priority_levels={self.priority_levels}"
            )
        for size in self.preferred_batch_sizes:
            if size < 1:
                raise ValueError(f"preferred_batch_sizes must be >= 1, got {size}")
        return self


class InstanceGroup(_Strict):
    """Copies of the model to run (Triton's ``instance_group``).

    Attributes:
        count: Instances on each listed device.
        kind: ``auto`` (GPU when CUDA is available, else CPU), ``gpu`` or ``cpu``.
        gpus: GPU ids for kind gpu/auto; empty means every visible GPU.
    """

    count: int = Field(default=1, ge=1, le=64)
    kind: Literal["auto", "gpu", "cpu"] = "auto"
    gpus: list[int] = Field(default_factory=list)


class LatestPolicy(_Strict):
    num_versions: int = Field(default=1, ge=1)


class SpecificPolicy(_Strict):
    versions: list[int] = Field(min_length=1)


class VersionPolicy(_Strict):
    """Which numeric version folders are served. Exactly one of the three may be set.

    ``latest: {num_versions: N}`` (default, N=1), ``all: {}``, ``specific: {versions: [..]}``.
    """

    latest: LatestPolicy | None = None
    all: dict[str, Any] | None = None
    specific: SpecificPolicy | None = None

    @model_validator(mode="after")
    def _one(self) -> VersionPolicy:
        chosen = [k for k in ("latest", "all", "specific") if getattr(self, k) is not None]
        if len(chosen) > 1:
            raise ValueError(f"set only one of latest, all, specific; got {chosen}")
        return self

    def select(self, available: list[int]) -> list[int]:
        """Return the versions to serve out of ``available``, ascending."""
        ordered = sorted(available)
        if self.all is not None:
            return ordered
        if self.specific is not None:
            return [v for v in ordered if v in set(self.specific.versions)]
        n = self.latest.num_versions if self.latest is not None else 1
        return ordered[-n:]


class CanaryConfig(_Strict):
    """A version that takes a share of the requests that name no version.

    Attributes:
        version: The canary version (loaded in addition to what ``version_policy`` selects).
        weight: Share of unversioned requests it gets, 0..1 (0.1 = 10%); the rest go to the
            default version. A request with an ``id`` always goes the same way (hash of the
            id); one without goes at random.
    """

    version: int = Field(ge=1)
    weight: float = Field(ge=0.0, le=1.0)


class OptimizationConfig(_Strict):
    """Execution options (see the GPU execution engine): applied where the backend can.

    Attributes:
        pipeline_depth: Batches in flight per instance; above 1 the preprocess, forward and
            postprocess stages run on their own threads and overlap. 0 = auto: 3 on a GPU
            (CPU stages overlap device work), 1 on a CPU (the stages would compete for the
            same cores, and smaller batches would form).
        gpu_memory_budget_mib: Most device memory one instance may hold after load and
            warm-up (allocated by the caching allocator), MiB; an instance over it fails to
            load with the numbers. 0 = no limit.
        cuda_graphs: Capture a CUDA graph per batch-size bucket and replay it.
        compile: Run the module through ``torch.compile`` with ``compile_mode`` and
            ``compile_backend`` (``inductor``; ``aot_eager`` traces without generating code).
        channels_last: Use the channels-last memory format for 4-D inputs and weights.
    """

    pipeline_depth: int = Field(default=0, ge=0, le=8)
    gpu_memory_budget_mib: int = Field(default=0, ge=0)
    cuda_graphs: bool = False
    compile: bool = False
    compile_mode: Literal["default", "reduce-overhead", "max-autotune"] = "default"
    compile_backend: str = "inductor"
    channels_last: bool = False


OnnxProvider = Literal["tensorrt", "cuda", "cpu"]
_DEFAULT_PROVIDERS: tuple[OnnxProvider, ...] = ("tensorrt", "cuda", "cpu")


class OnnxConfig(_Strict):
    """ONNX Runtime session settings (backend ``onnx``).

    Attributes:
        intra_op_threads: Threads used inside one operator; 0 lets ONNX Runtime choose (one per
            physical core).
        inter_op_threads: Threads running independent operators at once; used only with
            ``execution_mode: parallel``; 0 lets ONNX Runtime choose.
        execution_mode: ``sequential`` (default) or ``parallel`` operator scheduling.
        graph_optimization_level: ONNX Runtime graph optimisations: ``disable``, ``basic``,
            ``extended`` or ``all`` (default).
        execution_providers: Preference order among ``tensorrt``, ``cuda`` and ``cpu``. Only
            the providers that the installed ONNX Runtime offers are used, GPU providers only
            for instances on a GPU; drop ``tensorrt`` to skip TensorRT engine builds.
    """

    intra_op_threads: int = Field(default=0, ge=0, le=1024)
    inter_op_threads: int = Field(default=0, ge=0, le=1024)
    execution_mode: Literal["sequential", "parallel"] = "sequential"
    graph_optimization_level: Literal["disable", "basic", "extended", "all"] = "all"
    execution_providers: list[OnnxProvider] = Field(
        default_factory=lambda: list(_DEFAULT_PROVIDERS), min_length=1
    )

    @field_validator("execution_providers")
    @classmethod
    def _unique(cls, providers: list[str]) -> list[str]:
        if len(set(providers)) != len(providers):
            raise ValueError(f"each provider may be listed once, got {providers}")
        return providers


class HuggingFaceConfig(_Strict):
    """A local Hugging Face transformers folder (backend ``huggingface``).

    Attributes:
        task: ``feature-extraction`` (pooled sentence embeddings, output ``EMBEDDING``) or
            ``sequence-classification`` (outputs ``LOGITS``, ``PROBABILITIES``, ``LABEL``).
        model_dir: Folder with ``config.json``, the weights and the tokenizer files; relative
            paths are relative to the version folder. None: the version folder itself.
        max_length: Longest tokenised input, tokens. None: ``max_seq_length`` of a
            sentence-transformers folder, else the tokenizer's ``model_max_length``, capped
            by the model's ``max_position_embeddings``.
        truncation: Cut longer inputs to ``max_length``; False refuses them (400, that row
            alone).
        padding: ``longest`` (pad a batch to its longest row) or ``max_length``.
        pooling: Feature extraction: ``mean`` (masked mean), ``cls`` (first token) or
            ``auto`` (the sentence-transformers ``1_Pooling`` config if present, else mean).
        normalize: Feature extraction: L2-normalise embeddings. None: as the folder's
            sentence-transformers ``modules.json`` says (a ``Normalize`` module), else False.
    """

    task: Literal["feature-extraction", "sequence-classification"] = "feature-extraction"
    model_dir: str | None = None
    max_length: int | None = Field(default=None, ge=2, le=1_000_000)
    truncation: bool = True
    padding: Literal["longest", "max_length"] = "longest"
    pooling: Literal["auto", "mean", "cls"] = "auto"
    normalize: bool | None = None


class ModelConfig(_Strict):
    """A model's ``config.yaml``.

    Attributes:
        name: Model name; defaults to the folder name, and must equal it when given.
        backend: ``python`` (a user class in ``model.py``), ``torch`` (an ``nn.Module`` in
            ``model.py``, a TorchScript ``model.pt`` or a ``torch.export`` program
            ``model.pt2``), ``onnx`` (``model.onnx`` on ONNX Runtime) or ``huggingface``
            (a local transformers folder, see ``HuggingFaceConfig``).
        max_batch_size: Most rows in one batch. 0 disables batching: inputs then carry no
            batch dimension and each request runs alone.
        inputs / outputs: Declared tensors, shapes without the batch dimension. May be
            omitted (or empty) where the model file declares them (``onnx``, ``torch`` with
            ``model.pt2``, ``huggingface``): the backend then fills them in at load (see
            ``Backend.complete_config``).
        dynamic_batching: Batching and queueing policy.
        instance_group: Copies of the model and their devices.
        precision: Compute precision; clients keep the declared datatypes. ``int8`` is
            dynamic quantisation of linear layers (torch backend and text_embedding, CPU).
        optimization: Graph capture / compile options.
        version_policy: Which versions are served.
        canary: Optional canary version and its traffic share (see ``CanaryConfig``).
        execution_timeout_s: A batch still running after this many seconds marks its
            instance hung: its requests fail with 500 and the instance is replaced. 0 = off.
        parameters: Free-form values handed to the model at load.
        onnx: ONNX Runtime session settings (backend ``onnx`` only).
        huggingface: Model folder and task (backend ``huggingface`` only).
    """

    name: str | None = None
    backend: Literal["python", "torch", "onnx", "huggingface"] = "python"
    max_batch_size: int = Field(default=8, ge=0, le=1_000_000)
    inputs: list[TensorSpec] = Field(default_factory=list)
    outputs: list[TensorSpec] = Field(default_factory=list)
    dynamic_batching: DynamicBatchingConfig = Field(default_factory=DynamicBatchingConfig)
    instance_group: list[InstanceGroup] = Field(default_factory=lambda: [InstanceGroup()])
    precision: Literal["fp32", "fp16", "bf16", "int8"] = "fp32"
    optimization: OptimizationConfig = Field(default_factory=OptimizationConfig)
    version_policy: VersionPolicy = Field(default_factory=VersionPolicy)
    canary: CanaryConfig | None = None
    execution_timeout_s: float = Field(default=0.0, ge=0)
    parameters: dict[str, Any] = Field(default_factory=dict)
    onnx: OnnxConfig = Field(default_factory=OnnxConfig)
    huggingface: HuggingFaceConfig = Field(default_factory=HuggingFaceConfig)

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.backend == "python":
            # A Python class declares nothing the server could read its tensors from.
            for label in ("inputs", "outputs"):
                if not getattr(self, label):
                    raise ValueError(
                        f"backend 'python' needs {label} declared (only 'onnx', 'huggingface' "
                        "and 'torch' with a model.pt2 can fill them in from the model files)"
                    )
        for group, label in ((self.inputs, "inputs"), (self.outputs, "outputs")):
            names = [t.name for t in group]
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"{label} names must be unique; repeated: {dupes}")
        for size in self.dynamic_batching.preferred_batch_sizes:
            if self.max_batch_size and size > self.max_batch_size:
                raise ValueError(
                    f"preferred_batch_sizes entry {size} exceeds max_batch_size="
                    f"{self.max_batch_size}"
                )
        return self

    def input(self, name: str) -> TensorSpec | None:
        """The declared input called ``name``, or None."""
        for spec in self.inputs:
            if spec.name == name:
                return spec
        return None


def _format_validation_error(path: Path, err: ValidationError) -> str:
    lines = [f"{path}: invalid model configuration ({err.error_count()} error(s))"]
    for item in err.errors():
        loc = ".".join(str(p) for p in item["loc"]) or "<root>"
        given = item.get("input")
        given_text = repr(given)
        if len(given_text) > 80:
            given_text = given_text[:77] + "..."
        msg = item["msg"].removeprefix("Value error, ")
        lines.append(f"  field '{loc}': {msg} (given: {given_text})")
    return "\n".join(lines)


def parse_model_config(data: Any, path: Path, folder_name: str) -> ModelConfig:
    """Validate an already-parsed config mapping.

    Raises:
        ConfigError: the mapping is not a valid :class:`ModelConfig`; the message names the
            file, every bad field, the value given and what is allowed.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    try:
        config = ModelConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(path, err)) from None
    if config.name is not None and config.name != folder_name:
        raise ConfigError(
            f"{path}: field 'name': {config.name!r} must equal the model folder name "
            f"{folder_name!r} (or be omitted)"
        )
    return config.model_copy(update={"name": folder_name})


def load_model_config(path: Path) -> ModelConfig:
    """Read and validate ``<repository>/<model>/config.yaml``.

    Raises:
        ConfigError: unreadable file, bad YAML, or invalid fields.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    return parse_model_config(data, path, path.parent.name)


def default_model_repository() -> Path:
    """The repository shipped inside the package (``text_embedding`` and ``simple``)."""
    return Path(__file__).resolve().parent / "default_repository"


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
            traces (one sub-folder per call).
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
        http_keep_alive_timeout_s: An HTTP connection idle this many seconds is closed
            (0: never). Keep it above the idle timeout of any proxy in front (nginx keeps
            upstream connections 60 s), or the proxy may reuse a connection being closed.
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
    enable_management: bool = False
    api_token: SecretStr | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    max_header_bytes: int = Field(default=64 * 1024, ge=1024)
    max_tensor_elements: int = Field(default=64 * 1024 * 1024, ge=1)
    max_bytes_element_bytes: int = Field(default=64 * 1024 * 1024, ge=1)
    http_keep_alive_timeout_s: float = Field(default=75.0, ge=0)

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

    @field_validator("load_model", mode="before")
    @classmethod
    def _split_names(cls, value: Any) -> Any:
        # GPUSERVE_LOAD_MODEL=a,b (the environment) as well as a list (flags, code).
        if isinstance(value, str):
            return [name.strip() for name in value.split(",") if name.strip()]
        return value
