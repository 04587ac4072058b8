"""Business-logic scripting into a decoupled model: ``InferenceRequest.exec(decoupled=True)`` and
``await async_exec(decoupled=True)`` return an iterator of the callee's responses, as Triton's
Python backend documents, each arriving as the callee sends it.

The callee is Triton's ``square_int32`` example: a decoupled Python model that sends ``IN``
responses of ``OUT = IN`` (here 0.15 s apart), then the final flag alone. The callers are
written in Triton's exact code shapes (``for infer_response in infer_request.exec(
decoupled=True)``; ``await asyncio.gather(*[r.async_exec(decoupled=True) ...])`` then
``for``; and ``async for``), and return the sum of the outputs, how many responses came (the
empty final one included) and when each came.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.fixtures.ensemble_models import write_model
from tests.helpers import InProcessServer

pytestmark = pytest.mark.timeout(120)

GAP_S = 0.15

SQUARE = f"""
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.respond, args=(request,)).start()
        return None

    def respond(self, request):
        sender = request.get_response_sender()
        count = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
        for _ in range(count):
            if request.is_cancelled():
                break
            out = pb_utils.Tensor("OUT", np.array([count], np.int32))
            sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
            time.sleep({GAP_S})
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

SQUARE_CONFIG = """
backend: python
max_batch_size: 0
inputs: [{name: IN, datatype: INT32, shape: [1]}]
outputs: [{name: OUT, datatype: INT32, shape: [1]}]
instance_group: [{count: 2, kind: cpu}]
model_transaction_policy: {decoupled: true}
"""

#: Triton's bls_decoupled sync_model.py shape, plus the arrival times.
SYNC = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            response_num = pb_utils.get_input_tensor_by_name(request, "IN")
            model = pb_utils.get_input_tensor_by_name(request, "MODEL").as_numpy()[0].decode()
            infer_request = pb_utils.InferenceRequest(
                model_name=model, inputs=[response_num], requested_output_names=["OUT"]
            )
            response_sum = np.array([0], np.int32)
            count, arrivals, start = 0, [], time.monotonic()
            for infer_response in infer_request.exec(decoupled=True):
                if infer_response.has_error():
                    raise pb_utils.TritonModelException(infer_response.error().message())
                count += 1
                arrivals.append(time.monotonic() - start)
                # the final response of a decoupled model may be empty
                if len(infer_response.output_tensors()) > 0:
                    response_sum += pb_utils.get_output_tensor_by_name(
                        infer_response, "OUT"
                    ).as_numpy()
            responses.append(outputs(response_sum, count, arrivals))
        return responses


def outputs(total, count, arrivals):
    return pb_utils.InferenceResponse(
        output_tensors=[
            pb_utils.Tensor("SUM", total.astype(np.int32)),
            pb_utils.Tensor("COUNT", np.array([count], np.int32)),
            pb_utils.Tensor("ARRIVALS", np.array(arrivals, np.float64)),
        ]
    )
"""

#: Triton's bls_decoupled async_model.py shape: two calls gathered, then read with ``for``.
ASYNC_GATHER = """
import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        response_num = pb_utils.get_input_tensor_by_name(requests[0], "IN")
        model = pb_utils.get_input_tensor_by_name(requests[0], "MODEL").as_numpy()[0].decode()
        inference_response_awaits = []
        for _ in range(2):
            infer_request = pb_utils.InferenceRequest(
                model_name=model, inputs=[response_num], requested_output_names=["OUT"]
            )
            inference_response_awaits.append(infer_request.async_exec(decoupled=True))
        async_responses = await asyncio.gather(*inference_response_awaits)
        response_sum = np.array([0], np.int32)
        count = 0
        for infer_responses in async_responses:
            for infer_response in infer_responses:
                if infer_response.has_error():
                    raise pb_utils.TritonModelException(infer_response.error().message())
                count += 1
                if len(infer_response.output_tensors()) > 0:
                    response_sum += pb_utils.get_output_tensor_by_name(
                        infer_response, "OUT"
                    ).as_numpy()
        return [
            pb_utils.InferenceResponse(
                output_tensors=[
                    pb_utils.Tensor("SUM", response_sum),
                    pb_utils.Tensor("COUNT", np.array([count], np.int32)),
                    pb_utils.Tensor("ARRIVALS", np.zeros(0, np.float64)),
                ]
            )
        ]
"""

#: ``async for`` over the iterator, cancelling it once the sum reaches MAX.
ASYNC_FOR_CANCEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        response_num = pb_utils.get_input_tensor_by_name(requests[0], "IN")
        model = pb_utils.get_input_tensor_by_name(requests[0], "MODEL").as_numpy()[0].decode()
        most = int(pb_utils.get_input_tensor_by_name(requests[0], "MAX").as_numpy()[0])
        infer_request = pb_utils.InferenceRequest(
            model_name=model, inputs=[response_num], requested_output_names=["OUT"]
        )
        response_stream = await infer_request.async_exec(decoupled=True)
        response_sum = np.array([0], np.int32)
        count = 0
        async for infer_response in response_stream:
            if infer_response.has_error():
                raise pb_utils.TritonModelException(infer_response.error().message())
            count += 1
            if len(infer_response.output_tensors()) > 0:
                response_sum += pb_utils.get_output_tensor_by_name(
                    infer_response, "OUT"
                ).as_numpy()
            if response_sum[0] >= most:
                response_stream.cancel()
        return [
            pb_utils.InferenceResponse(
                output_tensors=[
                    pb_utils.Tensor("SUM", response_sum),
                    pb_utils.Tensor("COUNT", np.array([count], np.int32)),
                    pb_utils.Tensor("ARRIVALS", np.zeros(0, np.float64)),
                ]
            )
        ]
"""

PLAIN = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                output_tensors=[
                    pb_utils.Tensor(
                        "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() * 10
                    )
                ]
            )
            for r in requests
        ]
"""

PLAIN_CONFIG = """
backend: python
max_batch_size: 0
inputs: [{name: IN, datatype: INT32, shape: [1]}]
outputs: [{name: OUT, datatype: INT32, shape: [1]}]
"""

CALLER_CONFIG = """
backend: python
max_batch_size: 0
inputs:
  - {name: IN, datatype: INT32, shape: [1]}
  - {name: MODEL, datatype: BYTES, shape: [1]}
  - {name: MAX, datatype: INT32, shape: [1], optional: true}
outputs:
  - {name: SUM, datatype: INT32, shape: [1]}
  - {name: COUNT, datatype: INT32, shape: [1]}
  - {name: ARRIVALS, datatype: FP64, shape: [-1]}
instance_group: [{count: 2, kind: cpu}]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("bls_decoupled")
    write_model(root, "square_int32", SQUARE_CONFIG, SQUARE)
    write_model(root, "plain_int32", PLAIN_CONFIG, PLAIN)
    write_model(root, "bls_decoupled_sync", CALLER_CONFIG, SYNC)
    write_model(root, "bls_decoupled_async", CALLER_CONFIG, ASYNC_GATHER)
    write_model(root, "bls_decoupled_cancel", CALLER_CONFIG, ASYNC_FOR_CANCEL)
    running = InProcessServer(root)
    yield running
    running.stop()


def call(server, caller: str, n: int, model: str = "square_int32", most: int | None = None):
    inputs = [
        {"name": "IN", "datatype": "INT32", "shape": [1], "data": [n]},
        {"name": "MODEL", "datatype": "BYTES", "shape": [1], "data": [model]},
    ]
    if most is not None:
        inputs.append({"name": "MAX", "datatype": "INT32", "shape": [1], "data": [most]})
    answer = httpx.post(
        f"{server.url}/v2/models/{caller}/infer", json={"inputs": inputs}, timeout=60
    )
    return answer


def outputs(answer: httpx.Response) -> dict[str, list]:
    assert answer.status_code == 200, answer.text
    return {o["name"]: o["data"] for o in answer.json()["outputs"]}


def test_exec_decoupled_yields_each_response_as_the_model_sends_it(server):
    out = outputs(call(server, "bls_decoupled_sync", 4))
    assert out["SUM"] == [16]  # four responses of OUT = 4
    assert out["COUNT"] == [5]  # and the empty final one (the final flag sent alone)
    arrivals = out["ARRIVALS"]
    # streamed, not collected: the first came long before the last was sent
    assert arrivals[0] < GAP_S, arrivals
    assert arrivals[3] - arrivals[0] >= 3 * GAP_S * 0.8, arrivals


def test_async_exec_decoupled_gathered_then_read_with_for(server):
    out = outputs(call(server, "bls_decoupled_async", 3))
    assert out["SUM"] == [18]  # two calls of three responses of OUT = 3
    assert out["COUNT"] == [8]


def test_async_for_and_cancel_stop_the_callees_stream(server):
    started = time.monotonic()
    out = outputs(call(server, "bls_decoupled_cancel", 40, most=80))
    assert out["SUM"] == [80]  # cancelled after two responses of OUT = 40
    assert out["COUNT"] == [2]
    assert time.monotonic() - started < 40 * GAP_S / 2  # not the 40 responses' 6 s
    # the callee saw the cancellation and stopped: it serves the next call at once
    again = outputs(call(server, "bls_decoupled_sync", 1))
    assert again["SUM"] == [1] and again["COUNT"] == [2]


def test_a_model_that_is_not_decoupled_yields_its_one_response(server):
    out = outputs(call(server, "bls_decoupled_sync", 7, model="plain_int32"))
    assert out["SUM"] == [70]
    assert out["COUNT"] == [1]


def test_a_call_that_fails_yields_one_error_response(server):
    answer = call(server, "bls_decoupled_sync", 1, model="no_such_model")
    assert answer.status_code >= 400
    assert "no_such_model" in answer.text


def test_the_iterator_is_the_one_of_the_triton_shape_in_process(server):
    """``next()`` works on it too (Triton's tests read the first response so)."""
    from gpuserve.backends.triton_python import bls
    from gpuserve.backends.triton_python import utils as pb_utils

    request = pb_utils.InferenceRequest(
        model_name="square_int32", inputs=[pb_utils.Tensor("IN", np.array([2], np.int32))]
    )
    responses = bls.run_decoupled(request, None)
    first = next(responses)
    assert first.has_error() and "no model caller" in first.error().message()
    assert list(responses) == []
