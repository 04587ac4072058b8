"""``tokenizer``: TEXT BYTES [B, 1] -> INPUT_IDS, ATTENTION_MASK int64 [B, max_seq_len].

The all-MiniLM-L6-v2 tokenizer (truncation at ``max_seq_len``), padded with id 0 to
``max_seq_len`` so that every request has the same shape (the encoder trims the padding).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gpuserve.backends.base import LoadContext
from gpuserve.backends.python import PythonModel
from gpuserve.models.sentence_embedding import (
    PAD_ID,
    decode_texts,
    default_model_dir,
    load_tokenizer,
)


class Model(PythonModel):
    def load(self, context: LoadContext) -> None:
        params = context.config.parameters
        model_dir = params.get("model_dir")
        folder = context.version_path / Path(model_dir) if model_dir else default_model_dir()
        self.max_seq_len = int(params.get("max_seq_len", 256))
        self.tokenizer = load_tokenizer(folder, self.max_seq_len)
        pad = self.tokenizer.id_to_token(PAD_ID) or "[PAD]"
        self.tokenizer.enable_padding(
            pad_id=PAD_ID, pad_type_id=0, pad_token=pad, length=self.max_seq_len
        )

    def forward(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # One text at a time, on this thread: the batch form fans out to a thread pool that
        # would compete with the encoder's threads for the same cores (the one-model
        # text_embedding tokenizes between its forwards, never beside them).
        encodings = [self.tokenizer.encode(text) for text in decode_texts(inputs["TEXT"])]
        ids = np.array([e.ids for e in encodings], dtype=np.int64).reshape(-1, self.max_seq_len)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        return {"INPUT_IDS": ids, "ATTENTION_MASK": mask.reshape(ids.shape)}
