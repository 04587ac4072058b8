"""``simple``: element-wise sum and difference of two INT32 [16] inputs (numpy only)."""

from __future__ import annotations

import numpy as np

from gpuserve.backends.python import PythonModel


class Model(PythonModel):
    """OUTPUT0 = INPUT0 + INPUT1 and OUTPUT1 = INPUT0 - INPUT1, int32 [B, 16], wrapping."""

    def forward(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        a = batch["INPUT0"].astype(np.int32, copy=False)
        b = batch["INPUT1"].astype(np.int32, copy=False)
        return {"OUTPUT0": a + b, "OUTPUT1": a - b}
