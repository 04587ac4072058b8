"""``text_embedding``: all-MiniLM-L6-v2 sentence embeddings (TEXT BYTES [B, 1] -> FP32 [B, 384]).

A user model on gpuserve's ``PythonModel`` hooks; its parameters (``model_dir``,
``max_seq_len``, ``execution``, ``unpadded``) are read by
:func:`gpuserve.models.text_embedding.load_embedder`.

A TEXT row that is not UTF-8 is refused at admission (400 naming the row and the byte), and a
text longer than ``max_seq_len`` tokens is cut there, before tokenisation (``admit``), so a
2 MB text costs what a ``max_seq_len``-token one does.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from gpuserve.backends.base import Admitted, LoadContext
from gpuserve.backends.python import PythonModel
from gpuserve.backends.text_admission import admit_texts
from gpuserve.config import ModelConfig
from gpuserve.models.sentence_embedding import SentenceEmbedder, TokenizedBatch, decode_texts
from gpuserve.models.text_embedding import load_embedder
from gpuserve.models.text_embedding_onnx import PythonExport, export_text_embedding


class Model(PythonModel):
    """Tokenise (CPU) -> BERT + mean pooling + L2 norm (device) -> numpy float32."""

    embedder: SentenceEmbedder

    def load(self, context: LoadContext) -> None:
        self.embedder = load_embedder(context)

    @property
    def unpadded_batches(self) -> bool:
        """Whether batches run packed (declared once after load)."""
        return self.embedder.unpadded

    def warmup(self) -> None:
        self.embedder.encode(["gpuserve warms up the text embedding model."])
        self.embedder.count_tokens(["gpuserve warms up the token counter."])

    def admit(self, inputs: dict[str, np.ndarray]) -> Admitted:
        """Each row's tokens after truncation; long texts cut before tokenisation."""
        return admit_texts(self.embedder.truncator(), inputs, "TEXT")

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens per text after truncation, as embedded (``usage`` of ``/v1/embeddings``)."""
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
