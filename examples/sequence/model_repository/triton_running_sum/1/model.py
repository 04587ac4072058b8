"""A running sum kept in Triton's implicit state (``sequence_batching.state``)."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            total = pb_utils.get_input_tensor_by_name(request, "SUM_IN").as_numpy() + value
            tensors = [pb_utils.Tensor("OUTPUT", total), pb_utils.Tensor("SUM_OUT", total)]
            responses.append(pb_utils.InferenceResponse(tensors))
        return responses
