"""Batches of decoupled requests below the server: which configurations batch, the scheduling
core running a decoupled model's requests on a fake clock (batches of streams formed by the
dynamic batcher, the execution counted when the call returns, each request finished when its
stream ends), a Triton model's ``execute`` with one sender per request (``stream_batch``),
and the parameters a BLS call carries."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from gpuserve.backends.base import Capabilities
from gpuserve.backends.streaming import StreamCall, sink_context
from gpuserve.backends.triton_python import bls
from gpuserve.backends.triton_python import utils as pb_utils
from gpuserve.config import ModelConfig
from gpuserve.engine.batch import BatchResult, Pending
from gpuserve.engine.batcher import batches_streams
from gpuserve.engine.request import InferenceRequest
from gpuserve.engine.scheduling import SchedulerCore
from gpuserve.engine.stats import BatchStats, RequestStats
from gpuserve.errors import CancelledRequestError, InvalidInputError, OverloadedError
from gpuserve.repository.triton.config import load_triton_config
from tests.unit.test_decoupled_backend import Sink, loaded

FIXTURES = Path(__file__).parents[1] / "fixtures"

IO = {
    "inputs": [{"name": "IN", "datatype": "INT32", "shape": [-1]}],
    "outputs": [{"name": "OUT", "datatype": "INT32", "shape": [1]}],
}

BATCHES = Capabilities(streams=True, streams_batches=True)


def config(**fields) -> ModelConfig:
    return ModelConfig(name="m", **IO, model_transaction_policy={"decoupled": True}, **fields)


def request(priority: int = 0, size: int = 1, **kwargs) -> InferenceRequest:
    x = np.zeros((1, size), np.int32)
    return InferenceRequest("m", None, {"IN": x}, priority=priority, **kwargs)


@dataclass(eq=False)
class Worker:
    name: str = "m:1#0"
    capacity: int = 1
    in_flight: int = 0


def core_of(cfg: ModelConfig, capabilities: Capabilities = BATCHES, workers: int = 1):
    core: SchedulerCore[Worker] = SchedulerCore(cfg, "1", capabilities)
    events: list[object] = []
    core.stats.listeners.append(events.append)
    core.attach([Worker(f"m:1#{index}") for index in range(workers)])
    return core, events


def admit(core, *requests: InferenceRequest, now: float = 0.0) -> list[Pending]:
    return [core.admit(r, now, Sink()) for r in requests]


def returned(record, at: float, call_s: float = 0.01, error=None) -> BatchResult:
    """What an instance reports when a batch of streams' call returns."""
    return BatchResult(
        record.batch,
        error=error,
        retryable=False,
        started_s=at,
        finished_s=at + call_s,
        forward_s=call_s,
    )


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


def test_a_backend_without_batches_of_streams_runs_one_request_per_call():
    cfg = config(max_batch_size=4, dynamic_batching={"max_queue_delay_us": 10_000})
    core, _ = core_of(cfg, Capabilities(streams=True), workers=2)
    admit(core, request(), request(), request())
    plan = core.schedule(0.0)  # no waiting for company: nobody could join
    assert [len(record.batch.items) for record in plan.dispatched] == [1, 1]
    assert core.queued == 1


# -- the scheduling core: batches of streams --------------------------------------------------


def test_queued_streams_form_batches_of_at_most_max_batch_size_rows_in_order():
    core, _ = core_of(config(max_batch_size=4, dynamic_batching={"max_queue_delay_us": 10_000}))
    items = admit(core, *(request(size=index + 1) for index in range(6)))  # any shapes
    first = core.schedule(0.001).dispatched
    assert [r.batch.items for r in first] == [items[:4]]  # 4 rows queued: full, sent at once
    assert all(item.sink is not None and item.started_s == 0.001 for item in items[:4])
    assert not core.schedule(0.002).dispatched  # the instance is busy
    core.complete(returned(first[0], at=0.001), 0.002)
    assert not core.schedule(0.003).dispatched  # 2 rows wait out the delay for company
    assert core.next_wakeup(0.003) == pytest.approx(0.010)
    late = core.schedule(0.010).dispatched
    assert [r.batch.items for r in late] == [items[4:]] and late[0].batch.rows == 2


def test_a_batch_of_streams_counts_its_call_when_it_returns_and_each_request_at_its_end():
    core, events = core_of(config(max_batch_size=4, dynamic_batching={}))
    a, b = admit(core, request(), request(), now=1.0)
    (record,) = core.schedule(1.5).dispatched
    done = core.complete(returned(record, at=1.5, call_s=0.25), 2.0)
    assert not done.finished and core.in_flight_requests == 2  # the streams go on
    batch = next(e for e in events if isinstance(e, BatchStats))
    assert (batch.batch_size, batch.requests, batch.forward_s, batch.ok) == (2, 2, 0.25, True)
    assert record.instance.in_flight == 0  # the instance is free for the next batch
    assert core.stream_ended(a, None, 3.0)
    assert core.stream_ended(b, CancelledRequestError("gone"), 3.5)
    assert not core.stream_ended(b, None, 4.0)  # finished once
    finished = [e for e in events if isinstance(e, RequestStats)]
    assert [(e.reason, e.queue_s, e.compute_s) for e in finished] == [
        (None, 0.5, 1.5),
        ("cancelled", 0.5, 2.0),
    ]
    assert core.in_flight_requests == 0


def test_a_failed_call_is_never_retried_in_halves():
    from gpuserve.errors import BackendError

    core, events = core_of(config(max_batch_size=4, dynamic_batching={}))
    items = admit(core, request(), request())
    (record,) = core.schedule(0.0).dispatched
    done = core.complete(returned(record, 0.0, error=BackendError("boom")), 0.1)
    assert not done.retried and core.retrying == [] and core.queued == 0
    assert [e.ok for e in events if isinstance(e, BatchStats)] == [False]
    assert all(item.outcome is None for item in items)  # their streams carry the error


def test_a_cancelled_queued_stream_leaves_the_queue_and_expired_ones_time_out():
    cfg = config(max_batch_size=4, dynamic_batching={"max_queue_delay_us": 50_000})
    core, _ = core_of(cfg)
    gone, late, kept = admit(core, request(), request(timeout_us=20_000), request())
    assert core.cancel(gone, 0.001) and not core.cancel(gone, 0.002)
    assert core.next_wakeup(0.01) == pytest.approx(0.02)  # the deadline comes first
    assert not core.schedule(0.01).finished
    assert list(core.schedule(0.02).finished) == [late]
    assert late.outcome is not None and late.outcome.reason == "timeout"
    (record,) = core.schedule(0.05).dispatched
    assert record.batch.items == [kept] and core.queued == 0


def test_a_stream_whose_client_went_away_is_found_gone_not_batched():
    core, _ = core_of(config(max_batch_size=4, dynamic_batching={}))
    away = request()
    away.is_cancelled = lambda: True
    gone, here = admit(core, away, request())
    plan = core.schedule(0.0)
    assert [r.batch.items for r in plan.dispatched] == [[here]]
    assert list(plan.finished) == [gone] and gone.outcome.reason == "cancelled"


def test_priority_levels_and_the_queue_bound():
    core, _ = core_of(
        config(max_batch_size=1, dynamic_batching={"priority_levels": 2, "max_queue_size": 2})
    )
    low, high = admit(core, request(priority=2), request(priority=1))
    with pytest.raises(OverloadedError):
        admit(core, request())
    (record,) = core.schedule(0.2).dispatched
    assert record.batch.items == [high]
    assert core.queued == 1 and low.queued


def test_the_watchdog_fails_the_streams_of_a_stuck_call_and_drops_its_instance():
    core, _ = core_of(config(max_batch_size=4, execution_timeout_s=1.0, dynamic_batching={}))
    (item,) = admit(core, request())
    (record,) = core.schedule(0.0).dispatched
    assert core.next_wakeup(0.5) == pytest.approx(1.0)
    (hung,) = core.hung(1.0, respawn=True)
    assert hung.finished == [item] and "execution_timeout_s" in item.outcome.message
    assert core.instances == [] and not core.stream_ended(item, None, 2.0)
    assert core.complete(returned(record, 0.0), 3.0).late


def test_the_token_budget_bounds_a_batch_of_streams():
    from gpuserve.engine.request import RequestCost

    cfg = config(max_batch_size=8, dynamic_batching={"max_batch_tokens": 8})
    core, _ = core_of(cfg)
    long = [request() for _ in range(3)]
    for r in long:
        r.cost = RequestCost((4,))
    admit(core, *long)
    (record,) = core.schedule(0.0).dispatched
    assert len(record.batch.items) == 2 and record.batch.padded_tokens == 8


def test_adaptive_batching_observes_a_batch_of_streams():
    cfg = config(max_batch_size=4, dynamic_batching={"adaptive": {"target_p99_ms": 50}})
    core, _ = core_of(cfg)
    assert core.adaptive is not None
    admit(core, request(), request())
    (record,) = core.schedule(0.0).dispatched
    core.complete(returned(record, 0.0, call_s=0.02), 0.02)
    assert core.adaptive.batches == 1


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
    backend.stream_batch(
        [StreamCall({"IN": a}, s, sink_context(s)) for a, s in zip(arrays, sinks, strict=True)]
    )
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
