"""The retrieval kinds of a model's config beside ``embedding:``: ``rerank:`` (a cross-encoder
scoring query/passage pairs), ``classification:`` (text in, labels with scores) and
``sparse:`` (SPLADE-style sparse embeddings), and the check of each against the model's
tensors.

Each section names the tensors the retrieval APIs (TEI's ``/rerank``, ``/predict``,
``/embed_sparse``; ``/v1/rerank``) send and read. They are automatic for the ``huggingface``
backend (its load-time completion fills them in from the folder's ``config.json``); any other
model (``onnx``, ``torch``, ``python``) opts in with the section.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field, model_validator

from gpuserve.config.base import Strict

if TYPE_CHECKING:
    from gpuserve.config.model import ModelConfig, TensorSpec


class RerankConfig(Strict):
    """Serve the model as a reranker (TEI ``POST /rerank``, ``POST /v1/rerank``).

    A call of one query and N passages is served as N rows, row i = (query, passage i), split
    into requests of at most ``max_batch_size`` rows that are batched with other traffic.

    Attributes:
        enabled: False keeps the model off the rerank APIs.
        text_input: BYTES ``[1]`` input taking the query of each row.
        pair_input: BYTES ``[1]`` input taking the passage of each row.
        output: FP32 ``[1]`` (or ``[n]``: column ``score_index`` is read) output of raw scores
            (logits); the APIs apply a sigmoid unless the client asks for raw scores.
        score_index: The column of ``output`` holding the relevance score.
        max_documents: Most passages one call may rank, when lower than the server's
            ``max_inputs_per_call`` (unset: that cap applies; more: 413).
    """

    enabled: bool = True
    text_input: str = Field(default="TEXT", min_length=1)
    pair_input: str = Field(default="TEXT_PAIR", min_length=1)
    output: str = Field(default="LOGITS", min_length=1)
    score_index: int = Field(default=0, ge=0)
    max_documents: int | None = Field(default=None, ge=1, le=1_000_000)

    @model_validator(mode="after")
    def _check(self) -> RerankConfig:
        if self.text_input == self.pair_input:
            raise ValueError(f"text_input and pair_input must differ, both are {self.text_input!r}")
        return self


class ClassificationConfig(Strict):
    """Serve the model as a text classifier (TEI ``POST /predict``).

    Attributes:
        enabled: False keeps the model off the classification API.
        text_input: BYTES ``[1]`` input taking one text per row.
        pair_input: BYTES ``[1]`` optional input taking the second text of a pair, or None:
            pair inputs are refused (400).
        output: FP32 ``[labels]`` output of raw scores (logits).
        labels: The label of each column of ``output``, in order (the huggingface backend
            fills them in from ``id2label``); empty: ``LABEL_<i>``.
        multi_label: Scores are a sigmoid per label (``problem_type:
            multi_label_classification``), else a softmax over labels.
        max_inputs: Most texts one call may classify, when lower than the server's
            ``max_inputs_per_call`` (unset: that cap applies; more: 413).
    """

    enabled: bool = True
    text_input: str = Field(default="TEXT", min_length=1)
    pair_input: str | None = "TEXT_PAIR"
    output: str = Field(default="LOGITS", min_length=1)
    labels: list[str] = Field(default_factory=list)
    multi_label: bool = False
    max_inputs: int | None = Field(default=None, ge=1, le=1_000_000)


class SparseConfig(Strict):
    """Serve the model's sparse embeddings (TEI ``POST /embed_sparse``).

    The model returns, per row, the ``k`` largest term weights: token ids in ``indices_output``
    (INT64 ``[k]``) and weights in ``values_output`` (FP32 ``[k]``), zero weights where a text
    has fewer than ``k`` non-zero terms; the API drops the zeros.

    Attributes:
        enabled: False keeps the model off the sparse API.
        text_input: BYTES ``[1]`` input taking one text per row.
        indices_output / values_output: The two outputs above.
        max_inputs: Most texts one call may embed, when lower than the server's
            ``max_inputs_per_call`` (unset: that cap applies; more: 413).
    """

    enabled: bool = True
    text_input: str = Field(default="TEXT", min_length=1)
    indices_output: str = Field(default="SPARSE_INDICES", min_length=1)
    values_output: str = Field(default="SPARSE_VALUES", min_length=1)
    max_inputs: int | None = Field(default=None, ge=1, le=1_000_000)


def model_label(config: ModelConfig) -> str:
    """``model 'NAME'`` once the config has its name (at load), else ``the model``."""
    return f"model {config.name!r}" if config.name else "the model"


def _names(specs: list[TensorSpec]) -> str:
    return ", ".join(t.name for t in specs) or "none"


def _input_problem(config: ModelConfig, field: str, name: str, optional: bool) -> str | None:
    spec = config.input(name)
    if spec is None:
        return (
            f"{field} {name!r} is not an input of {model_label(config)} "
            f"(inputs: {_names(config.inputs)})"
        )
    if spec.datatype != "BYTES" or spec.shape not in ([1], []):
        return f"{field} {name!r} is {spec.datatype} {spec.shape}; it must be BYTES [1]"
    if optional and not spec.optional:
        return f"{field} {name!r} must be an optional input (single texts omit it)"
    return None


def _output_problem(
    config: ModelConfig, field: str, name: str, datatypes: tuple[str, ...]
) -> str | None:
    out = next((t for t in config.outputs if t.name == name), None)
    if out is None:
        return (
            f"{field} {name!r} is not an output of {model_label(config)} "
            f"(outputs: {_names(config.outputs)})"
        )
    if out.datatype not in datatypes or len(out.shape) != 1:
        return (
            f"{field} {name!r} is {out.datatype} {out.shape}; it must be "
            f"{'/'.join(datatypes)} with shape [n]"
        )
    return None


def retrieval_problem(config: ModelConfig) -> str | None:
    """What is wrong with the ``rerank``/``classification``/``sparse`` sections for
    ``config``'s declared tensors, or None (tensors a backend fills in at load are checked
    once filled in). The message names each field that does not fit and the model's
    tensors, ``; ``-separated."""
    checks: list[str | None] = []
    rerank, classes, sparse = config.rerank, config.classification, config.sparse
    if rerank is not None and rerank.enabled:
        if config.inputs:
            checks.append(_input_problem(config, "rerank.text_input", rerank.text_input, False))
            checks.append(_input_problem(config, "rerank.pair_input", rerank.pair_input, False))
        if config.outputs:
            checks.append(_output_problem(config, "rerank.output", rerank.output, ("FP32", "FP16")))
            out = next((t for t in config.outputs if t.name == rerank.output), None)
            width = out.shape[0] if out is not None and len(out.shape) == 1 else -1
            if out is not None and width != -1 and rerank.score_index >= width:
                checks.append(
                    f"rerank.score_index {rerank.score_index} is past output {out.name!r} of "
                    f"{model_label(config)}, of width {width}"
                )
    if classes is not None and classes.enabled:
        if config.inputs:
            checks.append(
                _input_problem(config, "classification.text_input", classes.text_input, False)
            )
            if classes.pair_input is not None:
                checks.append(
                    _input_problem(config, "classification.pair_input", classes.pair_input, True)
                )
        if config.outputs:
            checks.append(
                _output_problem(config, "classification.output", classes.output, ("FP32", "FP16"))
            )
            out = next((t for t in config.outputs if t.name == classes.output), None)
            if (
                classes.labels
                and out is not None
                and out.shape
                and out.shape[0] not in (-1, len(classes.labels))
            ):
                checks.append(
                    f"classification.labels: {len(classes.labels)} labels for output "
                    f"{out.name!r} of {model_label(config)}, of width {out.shape[0]}"
                )
    if sparse is not None and sparse.enabled:
        if config.inputs:
            checks.append(_input_problem(config, "sparse.text_input", sparse.text_input, False))
        if config.outputs:
            for field, name, types in (
                ("sparse.indices_output", sparse.indices_output, ("INT64", "INT32")),
                ("sparse.values_output", sparse.values_output, ("FP32", "FP16")),
            ):
                checks.append(_output_problem(config, field, name, types))
    problems = [c for c in checks if c is not None]
    return "; ".join(problems) if problems else None
