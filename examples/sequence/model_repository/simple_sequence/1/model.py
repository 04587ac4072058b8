"""Triton's simple_sequence test model in Triton's Python backend API."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            start = pb_utils.get_input_tensor_by_name(request, "START").as_numpy()
            ready = pb_utils.get_input_tensor_by_name(request, "READY").as_numpy()
            out = np.where(ready != 0, value + start, 0).astype(np.int32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out)]))
        return responses
