"""Which task a ``huggingface`` model is served for: ``huggingface.task``, or, where the config
leaves it unset, the task the folder's ``config.json`` names in ``architectures`` (the rule
TEI's router follows). :func:`resolve_task` runs once per version at load (and in
``gpuserve models validate``), before the backend is chosen: the task picks it (text
generation runs on the causal LM backend). No ``transformers`` import: files are read as JSON.

An architecture's name ends in the head it carries::

    *ForSequenceClassification       -> sequence-classification
    *ForCausalLM, *LMHeadModel        -> text-generation
    *ForMaskedLM, *ForPreTraining     -> sparse-embedding when the folder's sentence-transformers
                                         modules.json lists a SpladePooling module (the
                                         folder says it is SPLADE), else feature-extraction
    a bare encoder (BertModel, ...)   -> feature-extraction (sentence-transformers folders)
    no architectures                  -> feature-extraction
    a .gguf file                      -> text-generation

The first entry of ``architectures`` that carries one of these heads decides, as in TEI. A
masked LM is embedded by TEI too (its MLM head is pre-training, not a task) unless asked for
SPLADE; TEI asks with ``--pooling splade``, a folder here with its ``modules.json``, a config
with ``task: sparse-embedding``. Any other head (``*ForTokenClassification``,
``*ForQuestionAnswering``, ...) is refused unless the config sets a task: no task serves it,
and embedding its encoder would drop it unseen. (A ``*ForTokenClassification`` with no
``id2label`` is taken for a bare encoder, TEI's rule for Alibaba's GTE folders.)

A task the config sets (``huggingface.task``, or a ``generate:`` section, which asks for text
generation) is checked against the same names:

* one that needs a head the folder lacks is refused, naming both: its weights would be
  random (``sequence-classification`` without a classification head, ``sparse-embedding``
  without a masked LM, ``text-generation`` without a causal LM; any task but
  ``text-generation`` for a ``.gguf`` file);
* ``feature-extraction`` of a folder with a head is served from its encoder with a warning
  that the head goes unused (embedding models published as ``*ForCausalLM`` are served so);
* a folder with no ``architectures`` takes any task.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from gpuserve.backends.hf_folder import (
    FEATURE_EXTRACTION,
    SEQUENCE_CLASSIFICATION,
    SPARSE_EMBEDDING,
    read_config_json,
    source_path,
    st_modules,
)
from gpuserve.config import CONFIG_FILENAME, ModelConfig
from gpuserve.config.model import updated_model_config
from gpuserve.errors import ConfigError

logger = logging.getLogger(__name__)

TEXT_GENERATION = "text-generation"
CLASSIFIER = "sequence classification"
CAUSAL_LM = "causal language model"
MASKED_LM = "masked language model"
#: The head each task reads its outputs from.
TASK_HEADS = {
    SEQUENCE_CLASSIFICATION: CLASSIFIER,
    SPARSE_EMBEDDING: MASKED_LM,
    TEXT_GENERATION: CAUSAL_LM,
}
_HEAD_SUFFIXES = (
    (("ForSequenceClassification",), CLASSIFIER),
    (("ForCausalLM", "LMHeadModel"), CAUSAL_LM),
    (("ForMaskedLM", "ForPreTraining"), MASKED_LM),
)
#: ``<Family>For<Head>``: a head no task serves (token classification, question answering...).
_OTHER_HEAD = re.compile(r"For([A-Z]\w*)$")


def head_of(architecture: str, config_json: dict[str, Any]) -> str | None:
    """The head an ``architectures`` entry carries (:data:`CLASSIFIER`, :data:`CAUSAL_LM`,
    :data:`MASKED_LM`, or the name of another, e.g. ``TokenClassification``), or None for a
    bare encoder."""
    for suffixes, head in _HEAD_SUFFIXES:
        if architecture.endswith(suffixes):
            return head
    other = _OTHER_HEAD.search(architecture)
    if other is None:
        return None
    if other.group(1) == "TokenClassification" and not config_json.get("id2label"):
        return None  # TEI: Alibaba's GTE folders name this head and hold none
    return other.group(1)


def _architectures(config_json: dict[str, Any]) -> list[str]:
    names = config_json.get("architectures")
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def _is_splade(folder: Path) -> bool:
    """The folder's sentence-transformers ``modules.json`` ends in SPLADE pooling (a
    ``SparseEncoder``'s ``SpladePooling`` module)."""
    return any(str(m.get("type", "")).endswith("SpladePooling") for m in st_modules(folder))


def folder_task(config: ModelConfig, version_path: Path) -> str:
    """The task a version's folder (or GGUF file) is served for when the config sets none
    (see the module docstring).

    Raises:
        ConfigError: no ``config.json`` where the model should be, unreadable JSON, or an
            architecture with a head no task serves (the message names it).
    """
    source = source_path(config, version_path)
    if source.suffix == ".gguf":
        return TEXT_GENERATION
    return _task_of(source, read_config_json(source), config.name)


def _task_of(source: Path, config_json: dict[str, Any], model: str | None) -> str:
    """:func:`folder_task` of the transformers folder ``source``, its ``config.json`` read."""
    names = _architectures(config_json)
    heads = [head_of(name, config_json) for name in names]
    for head in heads:
        if head == CLASSIFIER:
            return SEQUENCE_CLASSIFICATION
        if head == CAUSAL_LM:
            return TEXT_GENERATION
        if head == MASKED_LM:
            return SPARSE_EMBEDDING if _is_splade(source) else FEATURE_EXTRACTION
    unserved = [name for name, head in zip(names, heads, strict=True) if head is not None]
    if unserved:
        raise ConfigError(
            f"model '{model}': {source / 'config.json'} lists architectures {names}: "
            f"no huggingface task serves the head of {unserved[0]} (served: sequence "
            "classification, causal and masked language models, bare encoders); set "
            "huggingface.task: feature-extraction to serve its encoder's embeddings without "
            "that head"
        )
    return FEATURE_EXTRACTION


def check_task(config: ModelConfig, version_path: Path, task: str, asked_by: str) -> None:
    """Refuse a task the config sets that needs a head the folder lacks; warn when
    ``feature-extraction`` leaves the folder's head unused (see the module docstring).

    Args:
        config: The version's configuration.
        version_path: The version folder.
        task: The task asked for.
        asked_by: What asked for it, for messages (``huggingface.task 'X'``, ``a 'generate'
            section``).

    Raises:
        ConfigError: the task needs a head the folder does not have (naming both).
    """
    source = source_path(config, version_path)
    if source.suffix == ".gguf":
        if task != TEXT_GENERATION:
            raise ConfigError(
                f"model '{config.name}': {asked_by} cannot be served from {source}: a GGUF "
                f"file holds a causal language model (task '{TEXT_GENERATION}')"
            )
        return
    if not (source / "config.json").is_file():
        return  # completion says what the folder lacks
    config_json = read_config_json(source)
    names = _architectures(config_json)
    if not names:
        return
    heads = [head_of(name, config_json) for name in names]
    needed = TASK_HEADS.get(task)
    if needed is not None and needed not in heads:
        try:
            found = _task_of(source, config_json, config.name)
            hint = f"; leave huggingface.task unset to serve it as '{found}'"
        except ConfigError:
            hint = ""
        raise ConfigError(
            f"model '{config.name}': {asked_by} needs a {needed} head, but "
            f"{source / 'config.json'} lists architectures {names} (that head's weights would "
            f"be random){hint}"
        )
    if task == FEATURE_EXTRACTION:
        unused = [
            name
            for name, head in zip(names, heads, strict=True)
            if head is not None and (head != MASKED_LM or _is_splade(source))
        ]
        if unused:
            logger.warning(
                "model %s: %s serves the encoder of %s without its head (%s lists %s); leave "
                "huggingface.task unset to serve the head",
                config.name,
                asked_by,
                unused[0],
                source / "config.json",
                names,
            )


def resolve_task(config: ModelConfig, version_path: Path) -> ModelConfig:
    """``config`` with ``huggingface.task`` set: the config's own (checked against the folder
    by :func:`check_task`), ``text-generation`` for a ``generate:`` section, else the folder's
    (:func:`folder_task`). Other backends' configs are returned as they are.

    The result is validated again as a whole (a task read as ``text-generation`` brings the
    rules of generative models: ``max_batch_size``, ``decoupled``).

    Raises:
        ConfigError: the task cannot be read from the folder, contradicts it, or the config
            is invalid for the task read (the message names the folder).
    """
    if config.backend != "huggingface":
        return config
    given = config.huggingface.task
    if given is not None:
        check_task(config, version_path, given, f"huggingface.task '{given}'")
        return config
    if config.generate is not None:
        task = TEXT_GENERATION
        check_task(config, version_path, task, "a 'generate' section (text generation)")
    else:
        task = folder_task(config, version_path)
    section = config.huggingface.model_dump(exclude_unset=True) | {"task": task}
    path = version_path.parent / CONFIG_FILENAME
    try:
        resolved = updated_model_config(config, path, huggingface=section)
    except ConfigError as err:
        raise ConfigError(
            f"{err.message}\n  (huggingface.task '{task}' was read from "
            f"{source_path(config, version_path)})"
        ) from None
    logger.info("model %s: huggingface.task %s, from the model's folder", config.name, task)
    return resolved


__all__ = ["TEXT_GENERATION", "check_task", "folder_task", "head_of", "resolve_task"]
