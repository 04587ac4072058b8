"""Triton's simple_string_dyna_sequence test model in Triton's Python backend API.

The running sum lives in the model instance, by correlation id: the server sends every
request of a sequence to the same instance (its slot) for the sequence's life."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def __init__(self):
        self.sums = {}  # correlation id -> running sum

    def execute(self, requests):
        responses = []
        for request in requests:

            def get(name, request=request):
                return pb_utils.get_input_tensor_by_name(request, name).as_numpy()

            corrid = get("CORRID")[0, 0].decode()
            value = int(get("INPUT")[0, 0])
            total = value if get("START")[0, 0] else self.sums[corrid] + value
            self.sums[corrid] = total
            out = total
            if get("END")[0, 0]:
                out += int(corrid)
                del self.sums[corrid]
            array = np.array([[out]], dtype=np.int32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", array)]))
        return responses
