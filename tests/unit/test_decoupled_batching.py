"""Batches of decoupled requests below the server: which configurations batch, the pure
:class:`StreamBatcher` on a fake clock, a Triton model's ``execute`` with one sender per
request (``stream_batch``), and the parameters a BLS call carries."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpuserve.backends.streaming import StreamCall
from gpuserve.backends.triton_python import bls
from gpuserve.backends.triton_python import utils as pb_utils
from gpuserve.config import ModelConfig
from gpuserve.engine.request import InferenceRequest
from gpuserve.engine.streaming.batching import StreamBatcher, batches_streams
from gpuserve.errors import InvalidInputError, OverloadedError
from gpuserve.repository.triton.config import load_triton_config
from tests.unit.test_decoupled_backend import Sink, loaded

FIXTURES = Path(__file__).parents[1] / "fixtures"

IO = {
    "inputs": [{"name": "IN", "datatype": "INT32", "shape": [-1]}],
    "outputs": [{"name": "OUT", "datatype": "INT32", "shape": [1]}],
}


def config(**fields) -> ModelConfig:
    return ModelConfig(name="m", **IO, model_transaction_policy={"decoupled": True}, **fields)


def request(priority: int = 0) -> InferenceRequest:
    return InferenceRequest("m", None, {"IN": np.zeros((1, 1), np.int32)}, priority=priority)


# -- which models batch ---------------------------------------------------------------------


def test_only_a_decoupled_batching_model_with_dynamic_batching_batches_its_streams():
    assert batches_streams(config(max_batch_size=8, dynamic_batching={}))
    assert not batches_streams(config(max_batch_size=8))  # as Triton: no dynamic_batching
    assert not batches_streams(config(max_batch_size=0, dynamic_batching={}))
    plain = ModelConfig(name="m", **IO, max_batch_size=8, dynamic_batching={})
    assert not batches_streams(plain)  # not decoupled: the ordinary batcher's
    pbtxt = load_triton_config(FIXTURES / "decoupled_batch" / "batch_repeat" / "config.pbtxt")
    assert batches_streams(pbtxt)
    assert pbtxt.dynamic_batching.max_queue_delay_us == 100_000
    repeat = load_triton_config(FIXTURES / "decoupled" / "repeat_int32" / "config.pbtxt")
    assert not batches_streams(repeat)  # max_batch_size 0: one request per execute


# -- the pure batcher -----------------------------------------------------------------------


def test_queued_streams_form_batches_of_at_most_max_batch_size_rows_in_order():
    batcher: StreamBatcher[str] = StreamBatcher(
        config(max_batch_size=4, dynamic_batching={"max_queue_delay_us": 10_000})
    )
    for index in range(6):
        batcher.add(f"r{index}", request(), 1, now=0.0)
    assert batcher.next_batch(0.001) is not None  # 4 rows queued: full, sent at once
    assert len(batcher) == 2
    assert batcher.next_batch(0.002) is None  # 2 rows wait out the delay for company
    assert batcher.next_wakeup(True) == pytest.approx(0.010)
    late = batcher.next_batch(0.010)
    assert late is not None and late.jobs == ["r4", "r5"] and late.rows == 2


def test_the_first_batch_holds_the_oldest_requests_and_rows_count_per_request():
    batcher: StreamBatcher[str] = StreamBatcher(config(max_batch_size=4, dynamic_batching={}))
    batcher.add("a", request(), 3, now=0.0)
    batcher.add("b", request(), 2, now=0.0)  # 3 + 2 > 4: waits for the next call
    batcher.add("c", request(), 1, now=0.0)
    first = batcher.next_batch(0.0)
    assert first is not None and first.jobs == ["a", "c"] and first.rows == 4
    second = batcher.next_batch(0.0)
    assert second is not None and second.jobs == ["b"]


def test_a_removed_stream_leaves_the_queue_and_expired_ones_are_handed_back():
    batcher: StreamBatcher[str] = StreamBatcher(
        config(max_batch_size=4, dynamic_batching={"max_queue_delay_us": 50_000})
    )
    batcher.add("gone", request(), 1, now=0.0)
    batcher.add("late", request(), 1, now=0.0, deadline_s=0.02)
    batcher.add("kept", request(), 1, now=0.0)
    assert batcher.remove("gone") and not batcher.remove("gone")
    assert batcher.next_wakeup(True) == pytest.approx(0.02)  # the deadline comes first
    assert batcher.expired(0.01) == []
    assert batcher.expired(0.02) == ["late"]
    due = batcher.next_batch(0.05)
    assert due is not None and due.jobs == ["kept"] and len(batcher) == 0


def test_a_stream_whose_client_went_away_is_found_gone_not_batched():
    batcher: StreamBatcher[str] = StreamBatcher(config(max_batch_size=4, dynamic_batching={}))
    away = request()
    away.is_cancelled = lambda: True
    batcher.add("away", away, 1, now=0.0)
    batcher.add("here", request(), 1, now=0.0)
    batch = batcher.next_batch(0.0)
    assert batch is not None and batch.jobs == ["here"]
    assert batcher.gone() == ["away"] and batcher.gone() == []


def test_priority_levels_and_the_queue_bound():
    batcher: StreamBatcher[str] = StreamBatcher(
        config(max_batch_size=1, dynamic_batching={"priority_levels": 2, "max_queue_size": 2})
    )
    batcher.add("low", request(priority=2), 1, now=0.0)
    batcher.add("high", request(priority=1), 1, now=0.1)
    with pytest.raises(OverloadedError):
        batcher.add("more", request(), 1, now=0.2)
    first = batcher.next_batch(0.2)
    assert first is not None and first.jobs == ["high"]
    assert batcher.drain() == ["low"] and len(batcher) == 0


# -- a Triton model's execute with one sender per request -----------------------------------

BATCHED = """
import numpy as np
import triton_python_backend_utils as pb_utils

CALLS = []


class TritonPythonModel:
    def execute(self, requests):
        CALLS.append([(r.request_id(), r.correlation_id()) for r in requests])
        senders = [r.get_response_sender() for r in requests]
        values = [pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() for r in requests]
        for index in range(max(v.size for v in values)):  # interleaved, request by request
            for sender, value in zip(senders, values):
                if index < value.size and not sender.is_cancelled():
                    out = pb_utils.Tensor("OUT", value[:, index : index + 1])
                    sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
        for sender in senders:
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if any(v.size and v.flat[0] < 0 for v in values):
            raise pb_utils.TritonModelException("negative")
        return None
"""


def named_sink(request_id: str, sequence_id: int | None = None, cancel_after=None) -> Sink:
    sink = Sink(cancel_after)
    sink.request_id = request_id
    sink.parameters = {} if sequence_id is None else {"sequence_id": sequence_id}
    return sink


def test_one_execute_serves_a_batch_each_request_through_its_own_sender(tmp_path):
    backend = loaded(tmp_path, BATCHED, config(max_batch_size=4, dynamic_batching={}))
    assert backend.capabilities().streams_batches
    sinks = [named_sink("a", 7), named_sink("b"), named_sink("c", cancel_after=1)]
    arrays = [np.array([[1, 2, 3]], np.int32), np.array([[10]], np.int32)]
    arrays.append(np.array([[20, 21]], np.int32))
    backend.stream_batch([StreamCall({"IN": a}, s) for a, s in zip(arrays, sinks, strict=True)])
    calls = type(backend.model).execute.__globals__["CALLS"]
    assert calls == [[("a", 7), ("b", 0), ("c", 0)]]
    sent = [[(None if o is None else o["OUT"].tolist(), f) for o, f, _ in s.sent] for s in sinks]
    assert sent[0] == [([[1]], False), ([[2]], False), ([[3]], False), (None, True)]
    assert sent[1] == [([[10]], False), (None, True)]
    assert sent[2] == [([[20]], False)]  # cancelled after its first: nothing more, no final


def test_a_generator_model_has_no_batched_form(tmp_path):
    source = """
import numpy as np
from gpuserve import PythonModel

class Model(PythonModel):
    def generate(self, inputs):
        yield {"OUT": inputs["IN"][:, :1]}
"""
    backend = loaded(tmp_path, source, config(max_batch_size=4, dynamic_batching={}))
    assert not backend.capabilities().streams_batches
    sinks = [named_sink("a"), named_sink("b")]
    arrays = [np.array([[1]], np.int32), np.array([[2]], np.int32)]
    backend.stream_batch([StreamCall({"IN": a}, s) for a, s in zip(arrays, sinks, strict=True)])
    assert [[o["OUT"].tolist() for o, _, _ in s.sent[:1]] for s in sinks] == [[[[1]]], [[[2]]]]


def test_execute_raising_propagates_to_the_engine(tmp_path):
    backend = loaded(tmp_path, BATCHED, config(max_batch_size=4, dynamic_batching={}))
    sinks = [named_sink("a"), named_sink("b")]
    arrays = [np.array([[-1]], np.int32), np.array([[5]], np.int32)]
    with pytest.raises(pb_utils.TritonModelException, match="negative"):
        backend.stream_batch([StreamCall({"IN": a}, s) for a, s in zip(arrays, sinks, strict=True)])


# -- BLS: correlation id and sequence flags -------------------------------------------------


def test_a_bls_call_carries_its_correlation_id_flags_and_parameters():
    start_end = (
        pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
        | pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
    )
    call = pb_utils.InferenceRequest(
        model_name="seq", correlation_id=42, flags=start_end, parameters={"k": "v"}
    )
    assert bls.call_parameters(call) == {
        "k": "v",
        "sequence_id": 42,
        "sequence_start": True,
        "sequence_end": True,
    }
    named = pb_utils.InferenceRequest(model_name="seq", correlation_id="s-1", flags=0)
    assert bls.call_parameters(named) == {"sequence_id": "s-1"}
    assert bls.call_parameters(pb_utils.InferenceRequest(model_name="plain")) == {}
    with pytest.raises(InvalidInputError, match="correlation_id"):
        bls.call_parameters(pb_utils.InferenceRequest(model_name="seq", correlation_id=1.5))  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="parameters"):
        bls.call_parameters(pb_utils.InferenceRequest(model_name="seq", parameters="[1]"))


def test_a_bls_call_hands_the_parameters_to_the_caller():
    seen = {}

    def caller(model, inputs, **options):
        seen.update(model=model, **options)
        raise InvalidInputError("sequence id 5 is not active")

    call = pb_utils.InferenceRequest(
        model_name="seq",
        inputs=[pb_utils.Tensor("IN", np.zeros((1, 1), np.int32))],
        correlation_id=5,
    )
    response = bls.run(call, caller)
    assert seen["parameters"] == {"sequence_id": 5}
    assert response.has_error()
    assert response.error().code() == pb_utils.TritonError.INVALID_ARG
    assert "not active" in response.error().message()
