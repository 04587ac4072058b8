"""``pooling``: TOKEN_EMBEDDINGS fp32 [B, L, H] + ATTENTION_MASK int64 [B, T >= L] ->
EMBEDDING fp32 [B, H], the masked mean of the token embeddings, L2-normalised (as
sentence-transformers' ``Pooling(mean) -> Normalize``).

Plain numpy on purpose: a torch op here would start a second OpenMP thread team beside the
encoder's on the same cores, and the two would slow each other down.
"""

from __future__ import annotations

import numpy as np

from gpuserve.backends.python import PythonModel


class Model(PythonModel):
    def forward(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        hidden = inputs["TOKEN_EMBEDDINGS"]  # float32 [B, L, H]
        mask = inputs["ATTENTION_MASK"][:, : hidden.shape[1]].astype(np.float32)  # [B, L]
        summed = (hidden * mask[:, :, None]).sum(axis=1)  # [B, H]
        pooled = summed / np.maximum(mask.sum(axis=1, keepdims=True), 1e-9)
        norms = np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return {"EMBEDDING": (pooled / norms).astype(np.float32)}
