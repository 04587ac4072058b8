"""``encoder``: INPUT_IDS, ATTENTION_MASK int64 [B, T] -> TOKEN_EMBEDDINGS fp32 [B, L, 384].

L is the batch's longest real sequence: the fixed-length padding of the tokenizer step costs
nothing. A batch of different lengths runs packed, without padding
(:meth:`~gpuserve.models.bert.BertEncoder.forward_packed`, as the one-model text_embedding
runs it; parameter ``unpadded: false`` runs it padded with a mask instead); its token
embeddings are then laid back out as [B, L, H] with zeros at the padded positions.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from gpuserve.backends.base import LoadContext
from gpuserve.backends.python import PythonModel
from gpuserve.models.bert import Packing, load_bert
from gpuserve.models.sentence_embedding import default_model_dir


class Model(PythonModel):
    def load(self, context: LoadContext) -> None:
        params = context.config.parameters
        model_dir = params.get("model_dir")
        folder = context.version_path / Path(model_dir) if model_dir else default_model_dir()
        self.device = torch.device(context.device)
        self.encoder = load_bert(folder, device=context.device, dtype=context.torch_dtype)
        self.unpadded = str(params.get("unpadded", "true")).lower() == "true"

    def forward(self, inputs: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        lengths = inputs["ATTENTION_MASK"].sum(axis=1)
        longest = max(int(lengths.max()), 1) if lengths.size else 1
        ids = torch.from_numpy(np.ascontiguousarray(inputs["INPUT_IDS"][:, :longest]))
        mask = torch.from_numpy(np.ascontiguousarray(inputs["ATTENTION_MASK"][:, :longest]))
        padded = bool((lengths < longest).any())
        with torch.inference_mode():
            if padded and self.unpadded:
                real = mask.bool()
                packing = Packing.of([int(n) for n in lengths], self.device)
                tokens = self.encoder.forward_packed(ids[real].to(self.device), packing)
                hidden = tokens.new_zeros((ids.shape[0], longest, tokens.shape[-1]))
                hidden[real.to(self.device)] = tokens
            else:
                ids, mask = ids.to(self.device), mask.to(self.device)
                hidden = self.encoder(ids, mask if padded else None)
        return {"TOKEN_EMBEDDINGS": hidden.float()}
