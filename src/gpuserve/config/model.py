"""Each model's ``config.yaml``, typed: :class:`ModelConfig` and its sections.

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
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from gpuserve.config.backend_sections import HuggingFaceConfig, OnnxConfig, OptimizationConfig
from gpuserve.config.base import Strict as _Strict
from gpuserve.config.base import check_dims
from gpuserve.config.batching import DynamicBatchingConfig
from gpuserve.config.embedding import EmbeddingConfig, embedding_problem
from gpuserve.config.ensemble import EnsembleConfig, graph_problem
from gpuserve.config.generate import GenerateConfig
from gpuserve.config.keys import unknown_key_hint
from gpuserve.config.padding import padding_problem
from gpuserve.config.precision import PrecisionCheckConfig
from gpuserve.config.reshape import check_reshape_dims, refused_with, reshapes
from gpuserve.config.retrieval import (
    ClassificationConfig,
    RerankConfig,
    SparseConfig,
    retrieval_problem,
)
from gpuserve.config.sequence import SequenceBatchingConfig, sequence_problem
from gpuserve.config.warmup import WarmupSample, WarmupTarget, warmup_problem
from gpuserve.datatypes import Datatype
from gpuserve.errors import ConfigError

CONFIG_FILENAME = "config.yaml"


class TensorSpec(_Strict):
    """One declared input or output.

    Attributes:
        name: Tensor name used on the wire.
        datatype: KServe V2 datatype (FP32, INT64, BYTES, ...).
        shape: Shape without the batch dimension; ``-1`` marks a variable dimension.
            ``[]`` declares one value per batch row.
        optional: Inputs only: the request may omit it.
        pad_value: Inputs only: the variable dimensions (``-1``) may be padded with this
            value, so requests of different lengths share a batch (padded to the batch's
            largest; grouped by length, see ``dynamic_batching.max_batch_tokens``). None: only
            requests of equal shapes share a batch. See :mod:`gpuserve.config.padding`.
        unpad: Outputs only: the name of a padded input; each request gets this output's
            variable dimensions cut back to its own sizes of that input's variable dimensions.
        label_filename: Outputs only: a file in the model folder with one class label per
            line (line ``i`` names class ``i``), for Triton's classification extension
            (an output requested with ``classification: k``).
        format: Inputs only: the image layout Triton's ModelConfig reports (``FORMAT_NCHW``
            or ``FORMAT_NHWC``; informational, for clients that prepare images by it).
        reshape: The shape the model sees without the batch dimension, when it differs
            from ``shape`` (Triton's ``reshape``): clients use ``shape``, the model gets an
            input / makes an output in ``reshape``. None: ``shape``. See
            :mod:`gpuserve.config.reshape`.
    """

    name: str = Field(min_length=1)
    datatype: Datatype
    shape: list[int]
    optional: bool = False
    pad_value: float | None = None
    unpad: str | None = None
    label_filename: str | None = None
    format: Literal["FORMAT_NONE", "FORMAT_NCHW", "FORMAT_NHWC"] | None = None
    reshape: list[int] | None = None

    @field_validator("label_filename")
    @classmethod
    def _inside_model_folder(cls, value: str | None) -> str | None:
        if value is not None and (
            not value or value.startswith("/") or ".." in value.replace("\\", "/").split("/")
        ):
            raise ValueError(f"must be a file name inside the model folder, got {value!r}")
        return value

    @field_validator("shape")
    @classmethod
    def _dims(cls, shape: list[int]) -> list[int]:
        return check_dims(shape)

    @field_validator("reshape")
    @classmethod
    def _reshape_dims(cls, reshape: list[int] | None) -> list[int] | None:
        return check_reshape_dims(reshape)


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
    """Serve the highest versions (``version_policy.latest``).

    Attributes:
        num_versions: How many of the highest complete version folders are served.
    """

    num_versions: int = Field(default=1, ge=1)


class SpecificPolicy(_Strict):
    """Serve the listed versions (``version_policy.specific``).

    Attributes:
        versions: Version numbers to serve (those with a complete folder).
    """

    versions: list[int] = Field(min_length=1)


class VersionPolicy(_Strict):
    """Which numeric version folders are served. Exactly one of the three may be set.

    ``latest: {num_versions: N}`` (default, N=1), ``all: {}``, ``specific: {versions: [..]}``.

    Attributes:
        latest: Serve the ``num_versions`` highest versions (the default, with 1).
        all: ``{}``: serve every version folder.
        specific: Serve the listed ``versions``.
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


class TransactionPolicyConfig(_Strict):
    """How a model answers its requests (Triton's ``model_transaction_policy``).

    Attributes:
        decoupled: The model sends zero or more responses per request, and marks the last
            (a generator ``Model.generate``, or Triton's response sender). Served as a stream:
            gRPC ``ModelStreamInfer`` and HTTP ``/generate_stream``; unary ``infer`` and
            ``/generate`` answer only when the model sent exactly one response (400 else).
        max_buffered_responses: Responses of one request held between the model and a client
            that reads slowly; when full, the model's ``yield``/``send`` blocks until the
            client takes one (back-pressure, bounded memory).
    """

    decoupled: bool = False
    max_buffered_responses: int = Field(default=16, ge=1, le=4096)


class ModelConfig(_Strict):
    """A model's ``config.yaml``.

    Attributes:
        name: Model name; defaults to the folder name, and must equal it when given.
        backend: ``python`` (a user class in ``model.py``), ``torch`` (an ``nn.Module`` in
            ``model.py``, a TorchScript ``model.pt`` or a ``torch.export`` program
            ``model.pt2``), ``onnx`` (``model.onnx`` on ONNX Runtime) or ``huggingface``
            (a local transformers folder, see ``HuggingFaceConfig``), or ``ensemble``
            (steps run by other models of the repository, see ``ensemble``).
        max_batch_size: Most rows in one batch. 0 disables batching: inputs then carry no
            batch dimension and each request runs alone.
        inputs / outputs: Declared tensors, shapes without the batch dimension. May be
            omitted (or empty) where the model file declares them (``onnx``, ``torch`` with
            ``model.pt2``, ``huggingface``) or a Python model completes them
            (``Model.complete_config``, Triton's ``auto_complete_config``): the backend then
            fills them in at load (see ``Backend.complete_config``).
        dynamic_batching: Batching and queueing policy.
        instance_group: Copies of the model and their devices.
        precision: Compute precision; clients keep the declared datatypes. ``int8`` is
            dynamic quantisation of linear layers on the torch backend (CPU), and
            ONNX Runtime's int8 matrix products for the built-in text embedding model and
            ``backend: onnx`` (CPU); ``bf16``
            on a CPU needs AVX-512 BF16 or AMX (refused otherwise).
        precision_check: The accuracy gate a precision other than fp32 passes at load (see
            ``PrecisionCheckConfig``; the built-in text embedding model, onnx at int8).
        optimization: Graph capture / compile options.
        version_policy: Which versions are served.
        canary: Optional canary version and its traffic share (see ``CanaryConfig``).
        execution_timeout_s: A batch still running after this many seconds marks its
            instance hung: its requests fail with 500 and the instance is replaced (a
            decoupled model's batch runs until its model's call returns). 0 = off.
        parameters: Free-form values handed to the model at load.
        onnx: ONNX Runtime session settings (backend ``onnx`` only).
        huggingface: Model folder and task (backend ``huggingface`` only).
        embedding: Serve it on the OpenAI embeddings API (see ``EmbeddingConfig``); None:
            only where automatic (huggingface ``feature-extraction``).
        rerank / classification / sparse: Serve it on the rerank, classification or sparse
            embedding APIs (see :mod:`gpuserve.config.retrieval`); automatic for the
            huggingface backend's ``sequence-classification`` and ``sparse-embedding`` tasks.
        pinned: Never evicted to make room for another model (``--max-loaded-models``,
            ``--loaded-models-memory-bytes``) nor unloaded when idle; with
            ``--load-on-demand`` it is loaded at start.
        idle_unload_s: Unload the model after this many seconds without a request (scale
            to zero within the process); its next request loads it again. None: the
            server's ``idle_unload_s``; 0: never.
        expected_memory_bytes: What the loaded model (all its versions and instances) is
            expected to hold on each device it runs on, bytes, until it has loaded once:
            ``--loaded-models-memory-bytes`` makes room for this much before its first
            load. None: estimated from the model's own version files (their size on disk,
            times its instances per device, halved for ``fp16``/``bf16``/``int8``). Once
            it has loaded, its measured footprint is used instead.
        ensemble: The steps of an ensemble (``backend: ensemble``; see
            :mod:`gpuserve.config.ensemble`).
        model_transaction_policy: ``decoupled: true`` for a model that answers a request
            with a stream of responses (see ``TransactionPolicyConfig``; backend python).
        sequence_batching: Serve a stateful model with the sequence batcher (see
            :mod:`gpuserve.config.sequence`); None: the dynamic batcher.
        generate: Serve a causal language model with continuous batching (see
            :mod:`gpuserve.config.generate`); implied by ``huggingface.task:
            text-generation``, and by a folder holding a causal language model (or a GGUF
            file) when the task is unset.
        model_warmup: Requests each instance runs before the version serves (Triton's
            ``model_warmup``, see :mod:`gpuserve.config.warmup`).
    """

    name: str | None = None
    backend: Literal["python", "torch", "onnx", "huggingface", "ensemble"] = "python"
    max_batch_size: int = Field(default=8, ge=0, le=1_000_000)
    inputs: list[TensorSpec] = Field(default_factory=list)
    outputs: list[TensorSpec] = Field(default_factory=list)
    dynamic_batching: DynamicBatchingConfig = Field(default_factory=DynamicBatchingConfig)
    instance_group: list[InstanceGroup] = Field(default_factory=lambda: [InstanceGroup()])
    precision: Literal["fp32", "fp16", "bf16", "int8"] = "fp32"
    precision_check: PrecisionCheckConfig = Field(default_factory=PrecisionCheckConfig)
    optimization: OptimizationConfig = Field(default_factory=OptimizationConfig)
    version_policy: VersionPolicy = Field(default_factory=VersionPolicy)
    canary: CanaryConfig | None = None
    execution_timeout_s: float = Field(default=0.0, ge=0)
    parameters: dict[str, Any] = Field(default_factory=dict)
    onnx: OnnxConfig = Field(default_factory=OnnxConfig)
    huggingface: HuggingFaceConfig = Field(default_factory=HuggingFaceConfig)
    embedding: EmbeddingConfig | None = None
    rerank: RerankConfig | None = None
    classification: ClassificationConfig | None = None
    sparse: SparseConfig | None = None
    pinned: bool = False
    idle_unload_s: float | None = Field(default=None, ge=0)
    expected_memory_bytes: int | None = Field(default=None, ge=0)
    sequence_batching: SequenceBatchingConfig | None = None
    generate: GenerateConfig | None = None
    ensemble: EnsembleConfig | None = None
    model_transaction_policy: TransactionPolicyConfig = Field(
        default_factory=TransactionPolicyConfig
    )
    model_warmup: list[WarmupSample] = Field(default_factory=list)

    @property
    def generates(self) -> bool:
        """Whether this is a generative model (a ``generate`` section, or the huggingface
        backend's ``text-generation`` task). A huggingface task left unset is read from the
        model's folder at load (:func:`gpuserve.backends.hf_task.resolve_task`): until then
        this says False, and the served (loaded) configuration says what the folder holds."""
        return self.generate is not None or (
            self.backend == "huggingface" and self.huggingface.task == "text-generation"
        )

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        for group, label in ((self.inputs, "inputs"), (self.outputs, "outputs")):
            names = [t.name for t in group]
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"{label} names must be unique; repeated: {dupes}")
        if self.generate is not None and self.backend != "huggingface":
            raise ValueError(
                "a 'generate' section needs backend 'huggingface' (a causal language model "
                f"folder or GGUF file), got backend {self.backend!r}"
            )
        task = self.huggingface.task
        if self.generate is not None and task not in (None, "text-generation"):
            raise ValueError(
                "a 'generate' section serves text generation; huggingface.task is "
                f"{task!r} (set it to 'text-generation', or leave it unset)"
            )
        if self.generates and self.max_batch_size not in (0, 8):
            raise ValueError(
                "a generative model is batched by its 'generate' section (max_running, "
                f"max_tokens_per_step), not max_batch_size (got {self.max_batch_size})"
            )
        # A huggingface task read from the folder at load is checked again then.
        unread = self.backend == "huggingface" and task is None
        if self.model_transaction_policy.decoupled and not (
            self.backend == "python" or self.generates or unread
        ):
            raise ValueError(
                "model_transaction_policy.decoupled needs backend 'python' (a Model.generate "
                f"generator or Triton's response sender), got backend {self.backend!r}"
            )
        if self.model_transaction_policy.decoupled and self.sequence_batching is not None:
            # its requests would take the dynamic batcher's path: the sequence's routing,
            # implicit state and control inputs would silently not happen
            raise ValueError(
                "sequence_batching is not supported on a decoupled model "
                "(model_transaction_policy.decoupled: true): remove one of the two"
            )
        for size in self.dynamic_batching.preferred_batch_sizes:
            if self.max_batch_size and size > self.max_batch_size:
                raise ValueError(
                    f"preferred_batch_sizes entry {size} exceeds max_batch_size="
                    f"{self.max_batch_size}"
                )
        return self

    @model_validator(mode="after")
    def _check_ensemble(self) -> ModelConfig:
        # The graph alone (see gpuserve.config.ensemble); the steps' tensors at load.
        if (self.backend == "ensemble") != (self.ensemble is not None):
            raise ValueError(
                "backend 'ensemble' and an 'ensemble' section go together "
                f"(backend is {self.backend!r}, ensemble is "
                f"{'set' if self.ensemble is not None else 'missing'})"
            )
        if self.ensemble is not None:
            for label in ("inputs", "outputs"):
                if not getattr(self, label):
                    raise ValueError(f"backend 'ensemble' needs {label} declared")
        return self

    @field_validator("ensemble")
    @classmethod
    def _ensemble_graph(cls, ensemble: EnsembleConfig | None, info: Any) -> EnsembleConfig | None:
        # Reported on field 'ensemble'; inputs and outputs are validated before it.
        if ensemble is not None:
            inputs = [t.name for t in info.data.get("inputs", [])]
            outputs = [t.name for t in info.data.get("outputs", [])]
            problem = graph_problem(ensemble, inputs, outputs)
            if problem is not None:
                raise ValueError(problem)
        return ensemble

    @field_validator("model_warmup")
    @classmethod
    def _warmup(cls, samples: list[WarmupSample], info: Any) -> list[WarmupSample]:
        # Reported on field 'model_warmup'; the fields it is checked against come before it.
        problem = warmup_problem(samples, WarmupTarget.of_fields(info.data))
        if problem is not None:
            raise ValueError(problem)
        return samples

    @model_validator(mode="after")
    def _check_embedding(self) -> ModelConfig:
        # Checked here against declared tensors; tensors a backend fills in at load are
        # checked again once filled in (gpuserve.backends.complete_for_version).
        problem = sections_problem(self)
        if problem is not None:
            raise ValueError(problem)
        return self

    @field_validator("inputs", "outputs")
    @classmethod
    def _reshapes(cls, specs: list[TensorSpec], info: Any) -> list[TensorSpec]:
        # Reported on field 'inputs' / 'outputs'; max_batch_size is validated before them.
        problem = reshapes(specs, int(info.data.get("max_batch_size", 0)) > 0, info.field_name)
        if problem is not None:
            raise ValueError(problem)
        return specs

    @model_validator(mode="after")
    def _check_reshape(self) -> ModelConfig:
        problem = refused_with(self)
        if problem is not None:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _check_padding(self) -> ModelConfig:
        problem = padding_problem(self)
        if problem is not None:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _check_sequence(self) -> ModelConfig:
        problem = sequence_problem(self)
        if problem is not None:
            raise ValueError(problem)
        return self

    def input(self, name: str) -> TensorSpec | None:
        """The declared input called ``name``, or None."""
        for spec in self.inputs:
            if spec.name == name:
                return spec
        return None


def sections_problem(config: ModelConfig) -> str | None:
    """What is wrong with the API sections of ``config`` (``embedding``, ``rerank``,
    ``classification``, ``sparse``) for its inputs and outputs, or None. Only declared
    tensors are checked: run it again on the completed configuration, whose tensors are the
    model's. The message names the section's field and the model's tensors."""
    problems = [retrieval_problem(config)]
    if config.embedding is not None and config.embedding.enabled:
        problems.insert(0, embedding_problem(config, config.embedding))
    found = [p for p in problems if p is not None]
    return "; ".join(found) if found else None


def updated_model_config(config: ModelConfig, path: Path, **fields: Any) -> ModelConfig:
    """``config`` with top-level ``fields`` replaced (given as a ``config.yaml`` gives them),
    validated again as a whole: every cross-field rule holds for the result. The fields
    ``config`` sets stay set, and no others.

    Raises:
        ConfigError: the result is invalid (worded as :func:`parse_model_config` words it,
            naming ``path``).
    """
    data = config.model_dump(exclude_unset=True) | fields
    try:
        return ModelConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(path, err)) from None


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
