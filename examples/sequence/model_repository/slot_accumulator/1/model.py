"""A running sum per batch slot, kept in the model and indexed by row position.

Written for Triton's ``direct`` sequence strategy: request ``i`` of ``execute`` is batch slot
``i``, the same slot for every request of a sequence; a slot with nothing to run this time
comes as a request with READY = 0, whose inputs mean nothing and whose response goes to
nobody. Outputs: OUTPUT (the sequence's sum so far), SLOT (the row it ran in) and IDLE_SLOTS
(how many READY = 0 rows this execution had).
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        slots = json.loads(args["model_config"])["max_batch_size"]
        self.sums = np.zeros(slots, np.int64)  # one running sum per batch slot

    def execute(self, requests):
        ready = [
            int(pb_utils.get_input_tensor_by_name(r, "READY").as_numpy()[0, 0]) for r in requests
        ]
        idle = np.array([[ready.count(0)]], np.int32)
        responses = []
        for slot, request in enumerate(requests):
            if not ready[slot]:  # an idle slot: leave its sum alone
                responses.append(pb_utils.InferenceResponse([]))
                continue
            value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            if pb_utils.get_input_tensor_by_name(request, "START").as_numpy()[0, 0]:
                self.sums[slot] = 0
            self.sums[slot] += int(value[0, 0])
            outputs = [
                pb_utils.Tensor("OUTPUT", np.array([[self.sums[slot]]], np.int64)),
                pb_utils.Tensor("SLOT", np.array([[slot]], np.int32)),
                pb_utils.Tensor("IDLE_SLOTS", idle),
            ]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
