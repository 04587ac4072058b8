"""Running mean of a sequence: the state (sum, count) comes in as inputs and goes out as
outputs; the server keeps it between the requests of each sequence (one row per sequence)."""

import numpy as np

from gpuserve.backends.python import PythonModel


class Model(PythonModel):
    def forward(self, batch):
        total = batch["SUM_IN"] + batch["VALUE"].astype(np.float64)  # [B, 1]
        count = batch["COUNT_IN"] + 1  # [B, 1]; zeros at sequence_start
        return {
            "MEAN": (total / count).astype(np.float32),
            "COUNT": count,
            "SUM_OUT": total,
            "COUNT_OUT": count,
        }
