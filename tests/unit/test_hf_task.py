"""The ``huggingface`` task read from a folder's ``config.json`` (``architectures``, as TEI
reads it) when the config sets none; a task the config sets checked against the folder; and
the API sections checked against the tensors of the completed configuration, at load.

Folders here hold only the JSON files the rules read (no weights): resolution and completion
never load a model."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from gpuserve.backends import backend_for, complete_for_version
from gpuserve.backends.hf_task import folder_task, resolve_task
from gpuserve.config import ModelConfig
from gpuserve.errors import ConfigError

BERT = {"model_type": "bert", "hidden_size": 32, "vocab_size": 100}
LABELS = {"id2label": {"0": "negative", "1": "neutral", "2": "positive"}}
SPLADE_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.MLMTransformer"},
    {
        "idx": 1,
        "name": "1",
        "path": "1_SpladePooling",
        "type": "sentence_transformers.sparse_encoder.models.SpladePooling",
    },
]


def folder(root: Path, architectures: list[str] | None, **extra: Any) -> Path:
    """A version folder whose ``config.json`` lists ``architectures`` (None: no such key)."""
    version = root / "m" / "1"
    version.mkdir(parents=True)
    data = {**BERT, **extra}
    if architectures is not None:
        data["architectures"] = architectures
    (version / "config.json").write_text(json.dumps(data))
    return version


def config(**fields: Any) -> ModelConfig:
    return ModelConfig.model_validate({"name": "m", "backend": "huggingface", **fields})


@pytest.mark.parametrize(
    ("architectures", "extra", "task"),
    [
        (["BertForSequenceClassification"], LABELS, "sequence-classification"),
        (["XLMRobertaForSequenceClassification"], {}, "sequence-classification"),
        (["LlamaForCausalLM"], {}, "text-generation"),
        (["GPT2LMHeadModel"], {}, "text-generation"),
        (["BertModel"], {}, "feature-extraction"),
        (None, {}, "feature-extraction"),
        ([], {}, "feature-extraction"),
        # a masked LM is embedded (TEI) unless the folder says SPLADE (below)
        (["BertForMaskedLM"], {}, "feature-extraction"),
        (["BertForPreTraining"], {}, "feature-extraction"),
        # the first entry with a head decides
        (["BertModel", "BertForSequenceClassification"], {}, "sequence-classification"),
        # TEI's rule for Alibaba's GTE folders: a token classifier without labels is bare
        (["NewForTokenClassification"], {}, "feature-extraction"),
    ],
)
def test_the_folder_names_the_task(tmp_path, architectures, extra, task):
    version = folder(tmp_path, architectures, **extra)
    assert folder_task(config(), version) == task
    resolved = resolve_task(config(), version)
    assert resolved.huggingface.task == task
    assert resolved.generates == (task == "text-generation")


def test_a_masked_lm_is_sparse_when_its_modules_say_splade(tmp_path):
    version = folder(tmp_path, ["BertForMaskedLM"])
    (version / "modules.json").write_text(json.dumps(SPLADE_MODULES))
    assert folder_task(config(), version) == "sparse-embedding"


def test_a_gguf_file_generates(tmp_path):
    version = tmp_path / "m" / "1"
    version.mkdir(parents=True)
    (version / "model.Q4_1.gguf").write_bytes(b"GGUF")
    assert folder_task(config(), version) == "text-generation"
    named = config(huggingface={"model_dir": "model.Q4_1.gguf"})
    resolved = resolve_task(named, version)
    assert resolved.generates
    assert backend_for(resolved).__name__ == "CausalLMBackend"
    with pytest.raises(ConfigError, match="a GGUF file holds a causal language model"):
        resolve_task(config(huggingface={"task": "feature-extraction"}), version)


def test_a_head_no_task_serves_is_refused_unless_a_task_is_set(tmp_path, caplog):
    version = folder(tmp_path, ["BertForQuestionAnswering"])
    with pytest.raises(ConfigError) as err:
        resolve_task(config(), version)
    assert "['BertForQuestionAnswering']" in err.value.message
    assert "set huggingface.task: feature-extraction" in err.value.message
    with caplog.at_level(logging.WARNING, logger="gpuserve.backends.hf_task"):
        resolved = resolve_task(config(huggingface={"task": "feature-extraction"}), version)
    assert resolved.huggingface.task == "feature-extraction"
    assert "without its head" in caplog.text


def test_the_resolved_task_keeps_the_fields_the_config_set(tmp_path):
    version = folder(tmp_path, ["BertForSequenceClassification"], **LABELS)
    given = config(huggingface={"max_length": 64}, max_batch_size=4)
    resolved = resolve_task(given, version)
    assert resolved.huggingface.model_dump(exclude_unset=True) == {
        "max_length": 64,
        "task": "sequence-classification",
    }
    assert (resolved.name, resolved.max_batch_size) == ("m", 4)


@pytest.mark.parametrize(
    ("architectures", "fields", "match"),
    [
        # a head the folder lacks would be random weights
        (
            ["BertModel"],
            {"huggingface": {"task": "sequence-classification"}},
            r"huggingface.task 'sequence-classification' needs a sequence classification "
            r"head, but .*config.json lists architectures \['BertModel'\].*serve it as "
            r"'feature-extraction'",
        ),
        (
            ["BertModel"],
            {"huggingface": {"task": "sparse-embedding"}},
            "needs a masked language model head",
        ),
        (
            ["BertForSequenceClassification"],
            {"huggingface": {"task": "text-generation"}},
            r"needs a causal language model head.*\['BertForSequenceClassification'\].*"
            "'sequence-classification'",
        ),
        (
            ["BertForSequenceClassification"],
            {"generate": {}},
            r"a 'generate' section \(text generation\) needs a causal language model head",
        ),
        # read as text generation: its rules apply
        (["LlamaForCausalLM"], {"max_batch_size": 4}, "not max_batch_size"),
        (
            ["BertModel"],
            {"model_transaction_policy": {"decoupled": True}},
            "decoupled needs backend 'python'",
        ),
    ],
)
def test_a_task_the_folder_contradicts_is_refused_naming_both(
    tmp_path, architectures, fields, match
):
    version = folder(tmp_path, architectures)
    with pytest.raises(ConfigError, match=match):
        resolve_task(config(**fields), version)


def test_feature_extraction_of_a_classifier_is_served_with_a_warning(tmp_path, caplog):
    version = folder(tmp_path, ["BertForSequenceClassification"], **LABELS)
    with caplog.at_level(logging.WARNING, logger="gpuserve.backends.hf_task"):
        resolved = resolve_task(config(huggingface={"task": "feature-extraction"}), version)
    assert resolved.huggingface.task == "feature-extraction"
    assert "BertForSequenceClassification without its head" in caplog.text


def test_a_generate_section_and_another_task_are_refused_at_parse():
    with pytest.raises(ValueError, match="a 'generate' section serves text generation"):
        config(generate={}, huggingface={"task": "feature-extraction"})


# --- the sections against the completed tensors ------------------------------------------------


def test_a_classifier_with_no_task_completes_as_a_classifier(tmp_path):
    version = folder(tmp_path, ["BertForSequenceClassification"], **LABELS)
    done = complete_for_version(config(rerank={}), version)
    assert done.huggingface.task == "sequence-classification"
    assert [t.name for t in done.outputs] == ["LOGITS", "LABEL"]
    assert [t.name for t in done.inputs] == ["TEXT", "TEXT_PAIR"]
    assert done.classification is not None
    assert done.classification.labels == ["negative", "neutral", "positive"]
    assert done.rerank is not None and done.rerank.output == "LOGITS"


def test_a_rerank_section_on_an_embedding_model_is_refused_at_load(tmp_path):
    version = folder(tmp_path, ["BertForSequenceClassification"], **LABELS)
    given = config(rerank={}, huggingface={"task": "feature-extraction"})
    with pytest.raises(ConfigError) as err:
        complete_for_version(given, version)
    message = err.value.message
    assert "rerank.output 'LOGITS' is not an output of model 'm' (outputs: EMBEDDING)" in message
    assert "rerank.pair_input 'TEXT_PAIR' is not an input of model 'm' (inputs: TEXT)" in message


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"classification": {}}, "classification.output 'LOGITS' is not an output"),
        (
            {"sparse": {}},
            "sparse.indices_output 'SPARSE_INDICES' is not an output of model 'm' "
            r"\(outputs: EMBEDDING\)",
        ),
        ({"embedding": {"output": "POOLED"}}, "embedding.output 'POOLED' is not an output"),
        ({"rerank": {"score_index": 3}}, "rerank.score_index 3 is past output 'LOGITS'"),
    ],
)
def test_each_section_is_checked_against_the_completed_tensors(tmp_path, section, match):
    task = "sequence-classification" if "rerank" in section else "feature-extraction"
    version = folder(tmp_path, ["BertForSequenceClassification"], **LABELS)
    with pytest.raises(ConfigError, match=match):
        complete_for_version(config(huggingface={"task": task}, **section), version)


def test_a_rerank_section_on_a_generative_model_is_refused_at_load(tmp_path):
    version = folder(tmp_path, ["LlamaForCausalLM"])
    (version / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="rerank.output 'LOGITS' is not an output of model 'm'"):
        complete_for_version(config(rerank={}), version)
