"""The ``text_embedding`` model as an ONNX graph: export, and the model that serves it.

ONNX has no tokenizer, so the exported model is two parts that follow the backend pipeline:

* the **graph** ``model.onnx``: BERT encoder + masked mean pooling + L2 normalisation;
  inputs ``input_ids`` and ``attention_mask`` int64 [batch, sequence] (both dimensions
  dynamic), output ``embedding`` float32 [batch, H] (H = 384 for all-MiniLM-L6-v2). With
  ``fp16`` the encoder's weights and compute are half precision; pooling and the output stay
  float32.
* the **served model**: backend ``python`` with ``model.py`` = :class:`OnnxTextEmbedding`,
  which tokenises in the CPU preprocess stage (``tokenizer.json`` beside the graph, the same
  fast tokenizer and truncation as ``text_embedding``) and runs the graph with the ``onnx``
  backend itself (:class:`~gpuserve.backends.onnx_backend.OnnxBackend`): same execution
  providers, session options (the config's ``onnx`` section) and I/O binding on a GPU. Its
  tensors are those of ``text_embedding``: TEXT BYTES [1] -> EMBEDDING FP32 [H].

``gpuserve export --model-repository DIR text_embedding`` writes it as ``text_embedding_onnx``
(the ``export_onnx`` hook of the default ``text_embedding`` model calls
:func:`export_text_embedding`)::

    DIR/text_embedding_onnx/config.yaml     backend python, same tensors/batching/instances
    DIR/text_embedding_onnx/1/model.onnx    the graph
    DIR/text_embedding_onnx/1/tokenizer.json
    DIR/text_embedding_onnx/1/model.py      from gpuserve.models.text_embedding_onnx import ...

Why not the plain ``onnx`` backend with a tokenizer option: its declared tensors are the
graph's (checked against ``model.onnx`` at load); a TEXT input that the graph does not have
would break that rule for one model family. Composition keeps both backends simple.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from gpuserve.backends.base import Admitted, LoadContext
from gpuserve.backends.python import PythonModel
from gpuserve.backends.text_admission import admit_texts
from gpuserve.config import ModelConfig, TensorSpec
from gpuserve.errors import BackendError, ConfigError
from gpuserve.models.bert_onnx import GRAPH_INPUTS, GRAPH_OUTPUT, export_graph
from gpuserve.models.sentence_embedding import (
    TOKENIZER_FILENAME,
    SentenceEmbedder,
    load_tokenizer,
)
from gpuserve.text.decode import decode_texts
from gpuserve.text.truncation import PrefixTruncator, bounded_texts

logger = logging.getLogger(__name__)

GRAPH_FILENAME = "model.onnx"
MIN_OPSET = 17
#: Largest |onnx - torch| accepted for an fp32 export (unit-norm embeddings).
FP32_MAX_ABS_DIFF = 1e-4

MODEL_PY = '''\
"""text_embedding exported to ONNX: tokenise (CPU stage), then model.onnx on ONNX Runtime.

Written by `gpuserve export`; see gpuserve.models.text_embedding_onnx.
"""

from gpuserve.models.text_embedding_onnx import OnnxTextEmbedding as Model

__all__ = ["Model"]
'''

CHECK_SENTENCES = (
    "gpuserve exports the text embedding model to ONNX.",
    "A short one.",
    "Tokenisation stays in Python; the encoder, pooling and normalisation run in the graph.",
)


@dataclass(slots=True)
class PythonExport:
    """What a python model's ``export_onnx`` hook wrote (see :mod:`gpuserve.cli.export`).

    Attributes:
        config_yaml: ``config.yaml`` text for the new model folder.
        max_abs_diff: Largest |ONNX Runtime - torch| over the check sentences, or None.
        note: Why the check did not run, or "".
    """

    config_yaml: str
    max_abs_diff: float | None
    note: str = ""


def _embedder_of(config: ModelConfig, version_path: Path, dtype: torch.dtype) -> SentenceEmbedder:
    """The torch model of a ``text_embedding`` version, read as its ``model.py`` reads it."""
    params = config.parameters
    model_dir = params.get("model_dir")
    max_seq_len = params.get("max_seq_len")
    return SentenceEmbedder.load(
        version_path / Path(model_dir) if model_dir is not None else None,
        dtype=dtype,
        max_seq_len=int(max_seq_len) if max_seq_len is not None else None,
    )


def export_text_embedding(
    config: ModelConfig,
    version_path: Path,
    folder: Path,
    *,
    fp16: bool = False,
    opset: int = MIN_OPSET,
) -> PythonExport:
    """Write the ONNX form of one ``text_embedding`` version into ``folder`` and check it.

    Args:
        config: The ``text_embedding`` config (its ``parameters`` name the weights).
        version_path: Its version folder.
        folder: The new version folder (exists, empty): ``model.onnx``, ``tokenizer.json``
            and ``model.py`` are written there.
        fp16: Half-precision encoder weights and compute; float32 pooling and output.
        opset: ONNX opset, at least 17.

    Returns:
        The config of the new model and the check: ONNX Runtime (CPU) against the fp32
        torch model on :data:`CHECK_SENTENCES`.

    Raises:
        ConfigError: opset too old, weights not found, onnx missing.
        BackendError: an fp32 graph disagrees with torch beyond :data:`FP32_MAX_ABS_DIFF`.
    """
    if opset < MIN_OPSET:
        raise ConfigError(f"opset {opset} is too old: use {MIN_OPSET} or later")
    reference = _embedder_of(config, version_path, torch.float32)
    expected = reference.encode(list(CHECK_SENTENCES))
    source = _embedder_of(config, version_path, torch.float16) if fp16 else reference
    # Two rows of different lengths: the trace sees padding, and no dimension is 1.
    sample = source.tokenize(["gpuserve exports to ONNX.", "A longer sample sentence, padded."])
    path = folder / GRAPH_FILENAME
    export_graph(source.encoder, (sample.input_ids, sample.attention_mask), str(path), opset)
    try:
        import onnx
    except ImportError:
        raise ConfigError("gpuserve export needs onnx: pip install 'gpuserve[onnx]'") from None
    # The exporter's shape inference leaves the width symbolic (after the L2 norm's division);
    # the model's signature should say [batch, H].
    model = onnx.load(str(path))
    model.graph.output[0].type.tensor_type.shape.dim[1].dim_value = reference.dimension
    onnx.save(model, str(path))
    onnx.checker.check_model(str(path), full_check=True)
    shutil.copyfile(_tokenizer_path(config, version_path), folder / TOKENIZER_FILENAME)
    (folder / "model.py").write_text(MODEL_PY, encoding="utf-8")

    diff, note = _compare(path, reference, expected)
    if diff is not None and not fp16 and diff > FP32_MAX_ABS_DIFF:
        raise BackendError(
            f"the exported graph disagrees with the torch model: max |diff| {diff:.3g} "
            f"(allowed {FP32_MAX_ABS_DIFF:.3g})"
        )
    return PythonExport(
        config_yaml=_config_yaml(config, reference, fp16),
        max_abs_diff=diff,
        note=note,
    )


def _tokenizer_path(config: ModelConfig, version_path: Path) -> Path:
    from gpuserve.models.sentence_embedding import default_model_dir

    model_dir = config.parameters.get("model_dir")
    folder = version_path / Path(model_dir) if model_dir is not None else default_model_dir()
    return folder / TOKENIZER_FILENAME


def _compare(
    path: Path, reference: SentenceEmbedder, expected: np.ndarray
) -> tuple[float | None, str]:
    """Max |ORT (CPU) - torch| on the check sentences, or (None, why it could not run)."""
    from gpuserve.backends.onnx_backend import import_ort

    ort = import_ort()
    options = ort.SessionOptions()
    options.log_severity_level = 3
    batch = reference.tokenize(list(CHECK_SENTENCES))
    feeds = {"input_ids": batch.input_ids.numpy(), "attention_mask": batch.attention_mask.numpy()}
    try:
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        (got,) = session.run([GRAPH_OUTPUT], feeds)
    except Exception as err:  # e.g. fp16 kernels the CPU provider lacks
        return None, f"ONNX Runtime (CPU) could not run the graph: {err}"
    return float(np.max(np.abs(got.astype(np.float64) - expected))), ""


def _config_yaml(config: ModelConfig, reference: SentenceEmbedder, fp16: bool) -> str:
    data = config.model_dump(
        mode="json", exclude_defaults=True, include={"dynamic_batching", "instance_group"}
    )
    data = {
        "backend": "python",
        "max_batch_size": config.max_batch_size,
        "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1]}],
        "outputs": [{"name": "EMBEDDING", "datatype": "FP32", "shape": [reference.dimension]}],
        **data,
        "parameters": {"max_seq_len": reference.max_seq_len},
    }
    note = "fp16 encoder, fp32 output" if fp16 else "fp32"
    header = (
        f"# Exported by `gpuserve export` from {config.name} ({note}): tokenisation in Python,\n"
        "# model.onnx on ONNX Runtime (session settings: the `onnx` section).\n"
    )
    return header + yaml.safe_dump(data, sort_keys=False, default_flow_style=None)


class OnnxTextEmbedding(PythonModel):
    """Served model of an exported version: tokenise (CPU) -> the ``onnx`` backend.

    Parameters (``config.yaml``): ``max_seq_len``, truncation length in tokens (default 256).
    The config's ``onnx`` section sets the session (threads, providers, optimisation level).
    ``precision`` must be ``fp32``; an fp16 graph comes from ``gpuserve export --fp16``.
    """

    def load(self, context: LoadContext) -> None:
        from gpuserve.backends.onnx_backend import OnnxBackend

        config = context.config
        max_seq_len = int({**config.parameters, **context.parameters}.get("max_seq_len", 256))
        self.tokenizer = load_tokenizer(context.version_path, max_seq_len)
        self.truncator = PrefixTruncator(self.tokenizer, max_seq_len)  # its own copy
        self.text_input = config.inputs[0].name
        self.output = config.outputs[0].name
        width = config.outputs[0].shape
        graph_config = config.model_copy(
            update={
                "backend": "onnx",
                "inputs": [
                    TensorSpec(name=name, datatype="INT64", shape=[-1]) for name in GRAPH_INPUTS
                ],
                "outputs": [TensorSpec(name=GRAPH_OUTPUT, datatype="FP32", shape=width)],
            }
        )
        # Checks the graph against the tensors this model feeds it (names, dtypes, widths).
        graph_config = OnnxBackend.complete_config(graph_config, context.version_path)
        self.graph = OnnxBackend()
        # the graph's own config; the graph calls no other model
        self.graph.load(replace(context, config=graph_config, caller=None))

    def warmup(self) -> None:
        text = np.array([[b"gpuserve warms up the ONNX text embedding model."]], dtype=object)
        self.postprocess(self.forward(self.preprocess({self.text_input: text})))

    def admit(self, inputs: dict[str, np.ndarray]) -> Admitted:
        """Admission step (admission threads): tokens per row, long texts cut before
        tokenisation, as ``text_embedding`` does (:mod:`gpuserve.text.truncation`)."""
        return admit_texts(self.truncator, inputs, self.text_input)

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens per text after truncation (``usage`` of ``/v1/embeddings``); thread-safe."""
        return [row.tokens for row in self.truncator.measure(list(texts))]

    def preprocess(self, inputs: dict[str, np.ndarray]) -> Any:
        """TEXT BYTES [B, 1] -> token ids and mask int64 [B, L] (on the device when bound)."""
        texts = bounded_texts(self.truncator, decode_texts(inputs[self.text_input]))
        encodings = self.tokenizer.encode_batch_fast(texts)
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        return self.graph.preprocess({"input_ids": ids, "attention_mask": mask})

    def forward(self, batch: Any) -> Any:
        return self.graph.forward(batch)

    def postprocess(self, outputs: Any) -> dict[str, np.ndarray]:
        return {self.output: self.graph.postprocess(outputs)[GRAPH_OUTPUT]}

    def unload(self) -> None:
        self.graph.unload()
