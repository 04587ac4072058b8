"""Typed configuration: the server's settings and each model's ``config.yaml``.

Units are part of field names (``max_queue_delay_us``, ``request_timeout_s``). Names follow
Triton's model configuration wherever Triton has a name for the thing (``max_batch_size``,
``dynamic_batching``, ``preferred_batch_sizes``, ``instance_group``, ``version_policy``).

Model configs are validated with pydantic; :func:`load_model_config` turns a validation
failure into a :class:`~gpuserve.errors.ConfigError` whose message names the file, the field,
the value given and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from gpuserve.config_keys import unknown_key_hint
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


class EmbeddingConfig(_Strict):
    """Serve the model on the OpenAI-compatible embeddings API (``POST /v1/embeddings``,
    ``GET /v1/models``): which tensors carry the text and the embedding.

    Automatic (no section needed) for the ``huggingface`` backend's ``feature-extraction``
    task; any other model opts in with this section (the default ``text_embedding`` does).
    A request of N inputs is served as N rows of ``text_input`` (or ``token_ids_input``),
    split into requests of at most ``max_batch_size`` rows that are batched with V2 traffic.

    Attributes:
        enabled: False keeps the model off the embeddings API (e.g. a feature-extraction
            model that should be served over V2 only).
        text_input: The BYTES input taking one UTF-8 text per row (shape ``[1]`` or ``[]``);
            None for a model that takes token ids only.
        token_ids_input: An INT64 or INT32 input of shape ``[-1]`` taking one sequence of
            token ids per row, or None: requests sending token ids are refused (400).
        output: The FP32 (or FP16/FP64) output holding one embedding per row, shape
            ``[width]``.
        dimensions: Widths the embedding may be cut to (Matryoshka models: the first N
            values), each at most ``width``; a request's ``dimensions`` must be one of them
            or the full width. Empty: the model refuses ``dimensions`` (400).
        normalize_truncated: L2-normalise a cut embedding (as OpenAI's ``dimensions``
            does); False returns the first N values as computed.
        token_counts: How ``usage.prompt_tokens`` is obtained: ``model`` calls the
            model's ``count_tokens(texts) -> list[int]`` (tokens per text after truncation,
            run at admission off the event loop; the default repository's model and the
            huggingface backend have one); ``none`` reports 0 tokens for text inputs. Token-id
            inputs count their ids either way.
    """

    enabled: bool = True
    text_input: str | None = "TEXT"
    token_ids_input: str | None = None
    output: str = Field(default="EMBEDDING", min_length=1)
    dimensions: list[int] = Field(default_factory=list)
    normalize_truncated: bool = True
    token_counts: Literal["model", "none"] = "model"

    @model_validator(mode="after")
    def _check(self) -> EmbeddingConfig:
        if self.text_input is None and self.token_ids_input is None:
            raise ValueError("set text_input, token_ids_input or both (both are null)")
        if self.text_input is not None and self.text_input == self.token_ids_input:
            raise ValueError(
                f"text_input and token_ids_input must differ, both are {self.text_input!r}"
            )
        for width in self.dimensions:
            if width < 1:
                raise ValueError(f"dimensions must be >= 1, got {width}")
        if len(set(self.dimensions)) != len(self.dimensions):
            raise ValueError(f"dimensions must not repeat, got {self.dimensions}")
        return self


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
        embedding: Serve it on the OpenAI embeddings API (see ``EmbeddingConfig``); None:
            only where automatic (huggingface ``feature-extraction``).
        pinned: Never evicted to make room for another model (``--max-loaded-models``,
            ``--loaded-models-memory-bytes``) nor unloaded when idle; with
            ``--load-on-demand`` it is loaded at start.
        idle_unload_s: Unload the model after this many seconds without a request (scale
            to zero within the process); its next request loads it again. None: the
            server's ``idle_unload_s``; 0: never.
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
    embedding: EmbeddingConfig | None = None
    pinned: bool = False
    idle_unload_s: float | None = Field(default=None, ge=0)

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

    @model_validator(mode="after")
    def _check_embedding(self) -> ModelConfig:
        # Checked here against declared tensors; tensors a backend fills in at load
        # (huggingface) are checked when the embeddings API resolves the served config.
        if self.embedding is not None and self.embedding.enabled:
            problem = embedding_problem(self, self.embedding)
            if problem is not None:
                raise ValueError(problem)
        return self

    def input(self, name: str) -> TensorSpec | None:
        """The declared input called ``name``, or None."""
        for spec in self.inputs:
            if spec.name == name:
                return spec
        return None


_EMBEDDING_DATATYPES = ("FP32", "FP16", "FP64")
_TOKEN_ID_DATATYPES = ("INT64", "INT32")


def embedding_problem(config: ModelConfig, embedding: EmbeddingConfig) -> str | None:
    """What is wrong with ``embedding`` for ``config``'s tensors, or None when it fits.

    Inputs and outputs are checked only when declared (a backend may fill them in at load):
    ``text_input`` BYTES ``[1]`` or ``[]``; ``token_ids_input`` INT64/INT32 ``[-1]``; any
    other input optional (the API sends only one); ``output`` FP32/FP16/FP64 ``[width]``
    with every ``dimensions`` entry at most ``width``.
    """
    where = "embedding"
    if config.inputs:
        used = [n for n in (embedding.text_input, embedding.token_ids_input) if n is not None]
        for name, datatypes, shapes in (
            (embedding.text_input, ("BYTES",), ([1], [])),
            (embedding.token_ids_input, _TOKEN_ID_DATATYPES, ([-1],)),
        ):
            if name is None:
                continue
            spec = config.input(name)
            if spec is None:
                names = [t.name for t in config.inputs]
                return f"{where}: input {name!r} is not declared (inputs: {names})"
            if spec.datatype not in datatypes or spec.shape not in shapes:
                return (
                    f"{where}: input {name!r} is {spec.datatype} {spec.shape}; it must be "
                    f"{' or '.join(datatypes)} with shape {' or '.join(map(str, shapes))}"
                )
            if len(used) > 1 and not spec.optional:
                return f"{where}: input {name!r} must be optional (a request sends text or ids)"
        required = [t.name for t in config.inputs if not t.optional and t.name not in used]
        if required:
            return (
                f"{where}: inputs {required} are required, but the embeddings API sends only "
                f"{used}: declare them optional"
            )
    if config.outputs:
        out = next((t for t in config.outputs if t.name == embedding.output), None)
        if out is None:
            names = [t.name for t in config.outputs]
            return f"{where}: output {embedding.output!r} is not declared (outputs: {names})"
        if out.datatype not in _EMBEDDING_DATATYPES or len(out.shape) != 1:
            return (
                f"{where}: output {out.name!r} is {out.datatype} {out.shape}; it must be "
                f"{'/'.join(_EMBEDDING_DATATYPES)} with shape [width]"
            )
        width = out.shape[0]
        too_wide = [d for d in embedding.dimensions if width != -1 and d > width]
        if too_wide:
            return f"{where}: dimensions {too_wide} exceed the width {width} of {out.name!r}"
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
        if item["type"] == "extra_forbidden":  # a typo: name the nearest valid key
            msg += unknown_key_hint(ModelConfig, item["loc"])
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


# The server's settings live in gpuserve.settings; importable from here as before.
from gpuserve.settings import ServerConfig as ServerConfig  # noqa: E402
from gpuserve.settings import default_model_repository as default_model_repository  # noqa: E402
