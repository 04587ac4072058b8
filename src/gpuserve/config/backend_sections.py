"""The backend sections of a model's ``config.yaml``: ``optimization`` (the torch and python
backends' execution settings), ``onnx`` (ONNX Runtime's session) and ``huggingface`` (a local
transformers folder and its task)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from gpuserve.config.base import Strict as _Strict


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
            ``compile_backend``, every batch-size bucket warmed up at load.
        compile_mode: ``torch.compile``'s mode: ``default``, ``reduce-overhead`` or
            ``max-autotune``.
        compile_backend: ``torch.compile``'s backend: ``inductor``; ``aot_eager`` traces
            without generating code.
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


#: What a ``huggingface`` model is served for.
HuggingFaceTask = Literal[
    "feature-extraction", "sequence-classification", "sparse-embedding", "text-generation"
]


class HuggingFaceConfig(_Strict):
    """A local Hugging Face transformers folder (backend ``huggingface``).

    Attributes:
        task: ``feature-extraction`` (pooled sentence embeddings, output ``EMBEDDING``),
            ``sequence-classification`` (outputs ``LOGITS``, ``PROBABILITIES``, ``LABEL``;
            an optional ``TEXT_PAIR`` input for pairs: a cross-encoder with one label is a
            reranker) or ``sparse-embedding`` (a masked-LM model with SPLADE pooling,
            outputs ``SPARSE_INDICES``, ``SPARSE_VALUES``) or ``text-generation`` (a causal
            language model served with continuous batching; see the ``generate`` section).
            None (the default): read from the folder at load, as TEI does, from the first
            ``architectures`` entry of ``config.json`` with a head:
            ``*ForSequenceClassification`` -> ``sequence-classification``;
            ``*ForCausalLM`` / ``*LMHeadModel`` (and any ``.gguf`` file) ->
            ``text-generation``; ``*ForMaskedLM`` -> ``sparse-embedding`` if the folder's
            sentence-transformers ``modules.json`` has a ``SpladePooling`` module, else
            ``feature-extraction``; a bare encoder (``BertModel``, sentence-transformers
            folders) or no ``architectures`` -> ``feature-extraction``; any other head
            (``*ForTokenClassification``, ...) is refused. A task set here that needs a head
            the folder lacks (``sequence-classification`` of a ``BertModel``: its classifier
            would be random) is refused at load, naming both; ``feature-extraction`` of a
            folder with a head serves its encoder, with a warning that the head is unused.
        model_dir: Folder with ``config.json``, the weights and the tokenizer files; relative
            paths are relative to the version folder. None: the version folder itself. For
            ``text-generation`` also a GGUF file, or ``package:NAME/FILE`` for a file shipped
            inside an installed Python package (found without importing it).
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
        sparse_top_k: Sparse embedding: terms kept per text (the largest weights).
        unpadded: Run batches packed, on their real tokens only (no padding tokens in any
            projection or in attention), for BERT, RoBERTa and XLM-RoBERTa models doing
            feature extraction or sequence classification: the same outputs for less compute.
            ``auto``: on for those models on the CPU with ``padding: longest``; ``true``: also
            on a GPU, and a model it cannot run fails to load; ``false``: padded batches.
    """

    task: HuggingFaceTask | None = None
    model_dir: str | None = None
    max_length: int | None = Field(default=None, ge=2, le=1_000_000)
    truncation: bool = True
    padding: Literal["longest", "max_length"] = "longest"
    pooling: Literal["auto", "mean", "cls"] = "auto"
    normalize: bool | None = None
    sparse_top_k: int = Field(default=256, ge=1, le=1_000_000)
    unpadded: Literal["auto"] | bool = "auto"
