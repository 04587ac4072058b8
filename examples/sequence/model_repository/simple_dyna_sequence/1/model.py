"""Triton's simple_dyna_sequence test model in Triton's Python backend API."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:

            def get(name, request=request):
                return pb_utils.get_input_tensor_by_name(request, name).as_numpy()

            value = get("INPUT").astype(np.int64)
            out = value + get("START").astype(np.int64)
            out += np.where(get("END") != 0, get("CORRID").astype(np.int64), 0)
            out = np.where(get("READY") != 0, out, 0).astype(np.int32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out)]))
        return responses
