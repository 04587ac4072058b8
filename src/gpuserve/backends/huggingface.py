"""The ``huggingface`` backend: a local transformers folder, served for one task.

The folder (``huggingface.model_dir``, default the version folder itself) holds what
``save_pretrained`` writes: ``config.json``, the weights (``model.safetensors`` or
``pytorch_model.bin``) and the tokenizer files (``tokenizer.json`` for the fast tokenizer).
It is loaded with ``from_pretrained(folder, local_files_only=True)``: never a hub download.
Needs ``transformers`` (``pip install 'gpuserve[huggingface]'``).

Tasks (``huggingface.task``; when unset, read from the folder's ``config.json``
``architectures`` as TEI does, see :mod:`gpuserve.backends.hf_task`) and their tensors;
``config.yaml`` may omit ``inputs`` and ``outputs``, which are then filled in from
``config.json`` (see :meth:`complete_config`)::

    feature-extraction        TEXT BYTES [1] -> EMBEDDING FP32 [hidden_size]
    sequence-classification   TEXT BYTES [1] (+ TEXT_PAIR BYTES [1], optional)
                                             -> LOGITS FP32 [num_labels], LABEL BYTES [1]
                                                (PROBABILITIES FP32 [num_labels] if declared)
    sparse-embedding          TEXT BYTES [1] -> SPARSE_INDICES INT64 [k], SPARSE_VALUES FP32 [k]

Sequence classification with ``TEXT_PAIR`` scores pairs (a cross-encoder; see
:mod:`gpuserve.backends.hf_text` for how a pair is truncated). Completion also fills in the
retrieval sections (:mod:`gpuserve.config.retrieval`): ``classification`` with the folder's
``id2label``, ``rerank`` for a classifier with one label, ``sparse`` for sparse embedding
(``AutoModelForMaskedLM`` with SPLADE pooling, ``huggingface.sparse_top_k`` terms per text).

Feature extraction is what sentence-transformers computes: the encoder's last hidden state,
pooled (masked mean, or the first token) and optionally L2-normalised; with ``pooling: auto``
and ``normalize`` unset both follow the folder's sentence-transformers files
(``modules.json``, ``1_Pooling/config.json``), so a sentence-transformers folder gives the
embeddings ``SentenceTransformer.encode`` gives. Sequence classification returns the raw
logits, the softmax (sigmoid for ``problem_type: multi_label_classification``) and the
``id2label`` name of the largest logit.

Stages: the CPU stage decodes the UTF-8 rows and tokenises them with the fast tokenizer
(``max_length``, ``truncation``, ``padding`` from config; pinned host tensors for a GPU); the
device stage runs the model on ``context.device`` in ``context.torch_dtype`` (pooling and
logits in float32); the CPU stage converts to numpy. With ``truncation: false`` a row longer
than ``max_length`` fails alone (400); the rest of its batch is served.

Admission step (:meth:`HuggingFaceBackend.admission`, per request before batching, on the
server's admission threads): each row's tokens after truncation, and a text longer than
``max_length`` tokens cut before tokenisation to a prefix that tokenises exactly as the whole
text truncated (:mod:`gpuserve.text.truncation`; at most ``max_length x 128``
characters are read), so a 2 MB text costs what a ``max_length``-token one does. With
``truncation: false`` a row over ``max_length`` fails its request with 400 at admission
(naming its count and the limit); a row over ``max_length x 128`` characters whose count that
prefix cannot settle is refused with 400 (the character cap).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from gpuserve.backends import hf_text
from gpuserve.backends.base import (
    AdmissionStep,
    Backend,
    Capabilities,
    LoadContext,
    RowErrors,
    Token,
)
from gpuserve.backends.cpu_features import require_cpu_precision
from gpuserve.backends.hf_folder import (
    DEFAULT_MAX_LENGTH,
    FEATURE_EXTRACTION,
    NO_LIMIT,
    SEQUENCE_CLASSIFICATION,
    SPARSE_EMBEDDING,
    TEXT_INPUT,
    TOKENIZER_FILES,
    FolderInfo,
    complete_hf_config,
    model_folder,
    read_folder,
)
from gpuserve.backends.hf_packed import PackedEncoder, PackedRows, unsupported
from gpuserve.backends.optional import library_lock, require
from gpuserve.backends.text_admission import admit_texts
from gpuserve.config import ModelConfig
from gpuserve.errors import BackendError, ConfigError, InvalidInputError
from gpuserve.text.decode import decode_texts
from gpuserve.text.truncation import PrefixTruncator, bounded_texts, length_problem

logger = logging.getLogger(__name__)

#: The names of ``transformers`` this backend uses, resolved under the import lock (its
#: top-level module builds them lazily, which is not thread-safe: BC-35).
_TRANSFORMERS_NAMES = (
    "AutoTokenizer",
    "AutoModel",
    "AutoModelForSequenceClassification",
    "AutoModelForMaskedLM",
    "utils.logging",
)


def import_transformers() -> Any:
    """``transformers`` with the names this backend uses resolved (thread-safe, see
    :mod:`gpuserve.backends.optional`).

    Raises:
        MissingDependencyError: transformers is not installed (the message names the extra).
    """
    return require("transformers", "backend 'huggingface'", _TRANSFORMERS_NAMES)


@dataclass(slots=True)
class TokenBatch:
    """CPU stage result: tokenised rows (int64 [B, L] each, pinned for a GPU; or, for packed
    execution, ``packed`` with ``features`` empty) and row errors."""

    features: dict[str, Any]
    errors: dict[int, InvalidInputError] = field(default_factory=dict)
    packed: PackedRows | None = None


@dataclass(slots=True)
class DeviceResult:
    """Device stage result: float32 [B, W] on the device (embeddings or logits)."""

    values: Any
    errors: dict[int, InvalidInputError] = field(default_factory=dict)


class HuggingFaceBackend(Backend):
    """A transformers model and its fast tokenizer, for one task (see the module docstring)."""

    def __init__(self) -> None:
        self.model: Any = None
        self.tokenizer: Any = None
        self.task = FEATURE_EXTRACTION
        self.device: Any = None
        self.text_input = TEXT_INPUT
        self.pair_input: str | None = None
        self.top_k = 256
        self.output_names: list[str] = []
        self.max_length = DEFAULT_MAX_LENGTH
        self.truncation = True
        self.padding = "longest"
        self.pooling = "mean"
        self.normalize = False
        self.labels: list[str] = []
        self.multi_label = False
        self._input_names: list[str] = []
        self._pin = False
        self._truncator: PrefixTruncator | None = None
        self._step: AdmissionStep | None = None
        self._packed: PackedEncoder | None = None

    @classmethod
    def complete_config(
        cls, config: ModelConfig, version_path: Path, *, auto_complete: bool = True
    ) -> ModelConfig:
        return complete_hf_config(config, version_path)

    def load(self, context: LoadContext) -> None:
        import torch

        if torch.device(context.device).type == "cpu":
            # the same refusal as every CPU execution: bf16 without bf16 dot products is
            # emulated, many times slower than fp32 (before any weight is read)
            require_cpu_precision(context.precision)
        transformers = import_transformers()
        config = complete_hf_config(context.config, context.version_path)
        hf = config.huggingface
        info = read_folder(model_folder(config, context.version_path))
        self.task = hf.task or FEATURE_EXTRACTION  # completion has set it
        self.text_input = config.inputs[0].name
        self.pair_input = config.inputs[1].name if len(config.inputs) > 1 else None
        self.top_k = hf.sparse_top_k
        self.output_names = [spec.name for spec in config.outputs]
        self.labels = info.labels
        self.multi_label = info.multi_label
        self.truncation = hf.truncation
        self.padding = hf.padding
        self.pooling, self.normalize = _pooling(hf.pooling, hf.normalize, info)

        folder = str(info.path)
        if not any((info.path / name).is_file() for name in TOKENIZER_FILES):
            # Recent transformers would build an empty tokenizer rather than fail.
            raise ConfigError(
                f"{folder}: no tokenizer files (one of {list(TOKENIZER_FILES)}); save the "
                "tokenizer into the folder with tokenizer.save_pretrained"
            )
        # from_pretrained imports the model family's modules lazily on first use and fills
        # transformers' registries, which is not safe from several threads at once (BC-35):
        # versions of huggingface models read their files one at a time; moving the weights
        # to the device, warm-up and serving run in parallel.
        with library_lock("transformers"):
            self.tokenizer, model = _from_pretrained(transformers, folder, self.task)
        self.max_length = _max_length(hf.max_length, info, self.tokenizer)
        # The admission step's own copy of the tokenizer's Rust core (thread-safe; the CPU
        # stage's transformers tokenizer changes its settings per call).
        self._direction = str(getattr(self.tokenizer, "truncation_side", "right"))
        self._truncator = PrefixTruncator(
            self.tokenizer.backend_tokenizer,
            self.max_length,
            strict=not self.truncation,
            direction=self._direction,
        )
        # The CPU stage's copy for pairs (its truncation is set call by call).
        self._pair_tokenizer = PrefixTruncator.copy_of(self.tokenizer.backend_tokenizer)
        if self.pair_input is not None:
            self._step = partial(
                hf_text.admit_pairs,
                self._truncator,
                int(self.tokenizer.backend_tokenizer.num_special_tokens_to_add(True)),
                not self.truncation,
                name=self.text_input,
                pair_name=self.pair_input,
            )
        else:
            self._step = partial(admit_texts, self._truncator, name=self.text_input)
        self._input_names = list(self.tokenizer.model_input_names)
        self.device = torch.device(context.device)
        self.model = model.to(device=self.device, dtype=context.torch_dtype).eval()
        self.model.requires_grad_(False)
        self._pin = self.device.type == "cuda"
        self._packed = _packed_runner(self.model, self.task, hf.unpadded, self.device, hf.padding)
        if self._packed is not None and self._packed.prepack_problem is not None:
            logger.warning(
                "model %s: projections run unfused: %s", config.name, self._packed.prepack_problem
            )
        if self.task == SEQUENCE_CLASSIFICATION and self.model.config.num_labels != len(
            self.labels
        ):
            self.labels = [
                self.model.config.id2label.get(i, f"LABEL_{i}")
                for i in range(self.model.config.num_labels)
            ]
        logger.info(
            "model %s: transformers %s %s (%s) on %s in %s, max_length %d, pooling %s%s%s",
            config.name,
            type(self.model).__name__,
            self.task,
            folder,
            self.device,
            context.precision,
            self.max_length,
            self.pooling if self.task == FEATURE_EXTRACTION else "-",
            ", normalised" if self.normalize and self.task == FEATURE_EXTRACTION else "",
            ", unpadded" if self._packed is not None else "",
        )

    def warmup(self) -> None:
        text = np.array([[b"gpuserve warms up the model."]], dtype=object)
        self.postprocess(self.forward(self.preprocess({self.text_input: text})))

    def preprocess(self, inputs: dict[str, np.ndarray]) -> TokenBatch:
        texts = decode_texts(inputs[self.text_input])
        errors: dict[int, InvalidInputError] = {}
        truncator = self._truncator
        assert truncator is not None, "the huggingface backend is not loaded"
        if self.pair_input is not None and self.pair_input in inputs:
            return self._preprocess_pairs(texts, decode_texts(inputs[self.pair_input]))
        if self.truncation:  # texts that did not go through admission: cut them too
            texts = bounded_texts(truncator, texts)
        else:  # rows over max_length (counted on a bounded prefix) fail alone
            where = f"input '{self.text_input}'"
            for row, length in enumerate(truncator.measure(texts)):
                problem = length_problem(truncator, length, where)
                if problem is not None:
                    errors[row] = InvalidInputError(problem)
                    texts[row] = ""
        if self._packed is not None:
            encoded = self.tokenizer(texts, truncation=True, max_length=self.max_length)
            rows = [{k: encoded[k][i] for k in encoded} for i in range(len(texts))]
            return TokenBatch({}, errors, PackedRows.of(rows, self._pin))
        encoded = self.tokenizer(
            texts,
            padding=self.padding,
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        )
        features = {k: v for k, v in encoded.items() if k in self._input_names}
        if self._pin:
            features = {k: v.pin_memory() for k, v in features.items()}
        return TokenBatch(features, errors)

    def _preprocess_pairs(self, firsts: list[str], seconds: list[str]) -> TokenBatch:
        """Tokenise pairs (see :mod:`gpuserve.backends.hf_text`); with ``truncation: false``
        a pair over ``max_length`` fails alone."""
        truncator = self._truncator
        assert truncator is not None
        errors: dict[int, InvalidInputError] = {}
        firsts, seconds = bounded_texts(truncator, firsts), bounded_texts(truncator, seconds)
        if not self.truncation:
            single = truncator.specials
            pair = int(self.tokenizer.num_special_tokens_to_add(pair=True))
            a = [r.full or r.tokens for r in truncator.measure(firsts)]
            b = [r.full or r.tokens for r in truncator.measure(seconds)]
            for row, (x, y) in enumerate(zip(a, b, strict=True)):
                if x - single + y - single + pair > self.max_length:
                    errors[row] = InvalidInputError(
                        f"inputs '{self.text_input}'/'{self.pair_input}' row {row}: the pair "
                        f"has more than max_length {self.max_length} tokens (truncation is off)"
                    )
                    firsts[row], seconds[row] = "", ""
        if self._packed is not None:
            rows = hf_text.pair_rows(
                self._pair_tokenizer, firsts, seconds, self.max_length, self._direction
            )
            if "token_type_ids" not in self._input_names:
                rows = [{"input_ids": row["input_ids"]} for row in rows]
            return TokenBatch({}, errors, PackedRows.of(rows, self._pin))
        encoded = hf_text.encode_pairs(
            self.tokenizer, self._pair_tokenizer, firsts, seconds, self.max_length, self.padding
        )
        features = {k: v for k, v in encoded.items() if k in self._input_names}
        if self._pin:
            features = {k: v.pin_memory() for k, v in features.items()}
        return TokenBatch(features, errors)

    def tokenize(self, texts: Sequence[str], add_special_tokens: bool) -> list[list[Token]]:
        """The tokens of each text, untruncated (TEI's ``/tokenize``; the admission step's
        thread-safe copy of the tokenizer)."""
        truncator = self._truncator
        if truncator is None:
            raise BackendError("the huggingface backend is not loaded")
        return hf_text.tokenize(truncator.tokenizer, list(texts), add_special_tokens)

    def admission(self) -> AdmissionStep | None:
        """The text tasks' admission step: tokens per row after truncation, long texts cut
        before tokenisation (with ``truncation: false``, a row over ``max_length`` fails its
        request with 400 at admission). See :mod:`gpuserve.text.truncation`."""
        return self._step

    def capabilities(self) -> Capabilities:
        """Padded batches, the text tasks' admission step and token counter."""
        return Capabilities(
            takes_tensors=self.takes_tensors,
            gives_tensors=self.gives_tensors,
            admission=self._step,
            count_tokens=self.count_tokens,
            tokenize=self.tokenize,
        )

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens per text as :meth:`preprocess` feeds them to the model (special tokens
        included, truncated to ``max_length``, no padding): ``usage`` of ``/v1/embeddings``.

        Called from worker threads while batches run, so it never uses the tokenizer of
        the CPU stage (a transformers call changes its truncation and padding settings): the
        admission step's truncator owns a copy of the fast tokenizer's Rust core, and reads
        only a bounded prefix of each text.
        """
        truncator = self._truncator
        if truncator is None:
            raise BackendError("the huggingface backend is not loaded")
        return [row.tokens for row in truncator.measure(list(texts))]

    def forward(self, prepared: TokenBatch) -> DeviceResult:
        import torch
        import torch.nn.functional as F

        with torch.inference_mode():
            if prepared.packed is not None and self._packed is not None:
                if self.task == SEQUENCE_CLASSIFICATION:
                    values = self._packed.logits(prepared.packed, self.device)
                else:
                    values = self._packed.pooled(prepared.packed, self.device, self.pooling)
                    values = F.normalize(values, p=2, dim=1) if self.normalize else values
                return DeviceResult(values, prepared.errors)
            feeds = {k: v.to(self.device, non_blocking=True) for k, v in prepared.features.items()}
            out = self.model(**feeds)
            if self.task == SEQUENCE_CLASSIFICATION:
                return DeviceResult(out.logits.float(), prepared.errors)
            if self.task == SPARSE_EMBEDDING:
                indices, weights = hf_text.splade(out.logits, feeds["attention_mask"], self.top_k)
                return DeviceResult((indices, weights), prepared.errors)
            hidden = out.last_hidden_state.float()
            if self.pooling == "cls":
                pooled = hidden[:, 0]
            else:
                mask = feeds["attention_mask"].to(torch.float32).unsqueeze(-1)
                pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            if self.normalize:
                pooled = F.normalize(pooled, p=2, dim=1)
            return DeviceResult(pooled, prepared.errors)

    def postprocess(self, raw: DeviceResult) -> dict[str, np.ndarray]:
        result: dict[str, np.ndarray] = {}
        if self.task == SPARSE_EMBEDDING:
            indices, weights = raw.values
            result = {
                "SPARSE_INDICES": indices.cpu().numpy(),
                "SPARSE_VALUES": weights.float().cpu().numpy(),
            }
            result = {k: v for k, v in result.items() if k in self.output_names}
            return RowErrors(result, raw.errors) if raw.errors else result
        values = raw.values.cpu().numpy()
        for name in self.output_names:
            if name in ("EMBEDDING", "LOGITS"):
                result[name] = values
            elif name == "PROBABILITIES":
                result[name] = _probabilities(values, self.multi_label)
            elif name == "LABEL":
                best = values.argmax(axis=1) if values.size else np.zeros(0, dtype=np.int64)
                labels = [self.labels[i].encode("utf-8") for i in best]
                result[name] = np.array(labels, dtype=object).reshape(-1, 1)
        return RowErrors(result, raw.errors) if raw.errors else result

    def unload(self) -> None:
        self.model = None
        self.tokenizer = None
        self._truncator = None
        self._step = None
        self._packed = None


def _packed_runner(
    model: Any, task: str, unpadded: str | bool, device: Any, padding: str
) -> PackedEncoder | None:
    """The packed execution of ``model`` (``huggingface.unpadded``), or None for padded.

    Raises:
        ConfigError: ``unpadded: true`` for a model that packed execution does not cover.
    """
    if unpadded is False:
        return None
    reason = unsupported(model, task)
    if unpadded is True:
        if reason is not None:
            raise ConfigError(
                f"huggingface.unpadded: true, but packed execution does not "
                f"cover {reason}; set unpadded: auto or false"
            )
        return PackedEncoder.of(model, task)
    if reason is not None or device.type != "cpu" or padding != "longest":
        return None
    return PackedEncoder.of(model, task)


def _from_pretrained(transformers: Any, folder: str, task: str) -> tuple[Any, Any]:
    """The fast tokenizer and the model of ``task`` from a local folder (no hub access).

    Raises:
        ConfigError: either cannot be loaded, or the tokenizer is not a fast one (the message
            names the folder and the cause).
    """
    # Per-load progress bars are noise in a server's log.
    transformers.utils.logging.disable_progress_bar()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            folder, local_files_only=True, use_fast=True
        )
    except Exception as err:  # transformers raises OSError/ValueError/... for bad folders
        raise ConfigError(f"{folder}: cannot load a tokenizer: {err}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(f"{folder}: no fast tokenizer (tokenizer.json) in the folder")
    auto = {
        FEATURE_EXTRACTION: transformers.AutoModel,
        SEQUENCE_CLASSIFICATION: transformers.AutoModelForSequenceClassification,
        SPARSE_EMBEDDING: transformers.AutoModelForMaskedLM,
    }[task]
    try:
        model = auto.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except Exception as err:  # see above
        raise ConfigError(f"{folder}: cannot load the model for '{task}': {err}") from None
    return tokenizer, model


def _pooling(pooling: str, normalize: bool | None, info: FolderInfo) -> tuple[str, bool]:
    """Resolve ``auto`` pooling and unset ``normalize`` from the sentence-transformers files.

    Raises:
        ConfigError: the folder's pooling mode is one this backend does not compute.
    """
    if pooling == "auto":
        pooling = info.st_pooling or "mean"
        if pooling not in ("mean", "cls"):
            raise ConfigError(
                f"{info.path}: sentence-transformers pooling {pooling!r} is not supported "
                "(mean or cls); set huggingface.pooling"
            )
    return pooling, info.st_normalize if normalize is None else normalize


def _max_length(configured: int | None, info: FolderInfo, tokenizer: Any) -> int:
    """``max_length`` from config, sentence-transformers, the tokenizer, capped by positions."""
    if configured is not None:
        length = configured
    elif info.st_max_seq_length is not None:
        length = info.st_max_seq_length
    else:
        limit = int(getattr(tokenizer, "model_max_length", NO_LIMIT) or NO_LIMIT)
        length = limit if limit < NO_LIMIT else DEFAULT_MAX_LENGTH
    if info.max_positions is not None and length > info.max_positions:
        if configured is not None:
            raise ConfigError(
                f"huggingface.max_length {configured} exceeds the model's "
                f"max_position_embeddings {info.max_positions}"
            )
        length = info.max_positions
    return length


def _probabilities(logits: np.ndarray, multi_label: bool) -> np.ndarray:
    """Softmax over labels (sigmoid per label for multi-label models), float32."""
    if multi_label:
        return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    shifted = logits - logits.max(axis=1, keepdims=True) if logits.size else logits
    exp = np.exp(shifted)
    return (exp / exp.sum(axis=1, keepdims=True)).astype(np.float32)
