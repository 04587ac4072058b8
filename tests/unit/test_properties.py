"""Property tests: the decoders never fail with anything but InvalidInputError, and the batcher
never loses, duplicates or mixes requests, whatever the input."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuserve.config import ModelConfig, TensorSpec
from gpuserve.engine.batcher import DynamicBatcher, Pending
from gpuserve.engine.request import InferenceRequest
from gpuserve.errors import InvalidInputError, OverloadedError
from gpuserve.protocol import decode_infer_request

CONFIG = ModelConfig(
    name="m",
    max_batch_size=8,
    inputs=[
        TensorSpec(name="INPUT0", datatype="FP32", shape=[-1]),
        TensorSpec(name="TEXT", datatype="BYTES", shape=[1], optional=True),
        TensorSpec(name="IDS", datatype="INT64", shape=[2], optional=True),
    ],
    outputs=[TensorSpec(name="OUTPUT0", datatype="FP32", shape=[-1])],
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)

tensor = st.fixed_dictionaries(
    {
        "name": st.sampled_from(["INPUT0", "TEXT", "IDS", "NOPE"]),
        "datatype": st.sampled_from(["FP32", "BYTES", "INT64", "INT32", "BF16", "x"]),
        "shape": st.lists(st.integers(-2, 9) | st.floats() | st.text(max_size=2), max_size=3),
    },
    optional={
        "data": json_values,
        "parameters": st.fixed_dictionaries(
            {}, optional={"binary_data_size": st.integers(-4, 64) | st.text(max_size=3)}
        ),
    },
)

request_bodies = st.fixed_dictionaries(
    {"inputs": st.lists(tensor, max_size=3) | json_values},
    optional={
        "id": json_values,
        "outputs": st.lists(st.fixed_dictionaries({"name": st.text(max_size=8)}), max_size=2)
        | json_values,
        "parameters": st.dictionaries(
            st.sampled_from(["priority", "timeout", "binary_data_output", "x"]),
            json_values,
            max_size=3,
        ),
    },
)


def decode(body: bytes, header_length: int | None) -> None:
    try:
        decoded = decode_infer_request(body, header_length, CONFIG, "m", None)
    except InvalidInputError:
        return
    for name, array in decoded.request.inputs.items():
        assert CONFIG.input(name) is not None
        assert isinstance(array, np.ndarray)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request_bodies)
def test_json_decoder_accepts_or_refuses_cleanly(body):
    decode(json.dumps(body).encode(), None)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=200), st.one_of(st.none(), st.integers(-10, 300)))
def test_arbitrary_bytes_and_header_lengths_are_refused_cleanly(body, header_length):
    decode(body, header_length)


@settings(max_examples=150, deadline=None)
@given(request_bodies, st.binary(max_size=64), st.integers(-3, 3))
def test_binary_bodies_are_decoded_or_refused_cleanly(header, tail, skew):
    head = json.dumps(header).encode()
    decode(head + tail, max(0, len(head) + skew))


operations = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "add", "batch", "expire", "remove"]),
        st.integers(1, 8),  # rows
        st.integers(0, 2),  # shape key
        st.integers(1, 2),  # priority
        st.floats(0, 0.05),  # time step, seconds
        st.booleans(),  # has deadline
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(operations, st.sampled_from([0.0, 0.01]), st.sampled_from([[], [4]]))
def test_batcher_never_loses_duplicates_or_mixes_requests(ops, delay, preferred):
    batcher = DynamicBatcher(8, delay, preferred, max_queue_size=20, priority_levels=2)
    now = 0.0
    added: list[Pending] = []
    seen: dict[int, str] = {}
    for op, rows, key, priority, step, has_deadline in ops:
        now += step
        if op == "add":
            request = InferenceRequest("m", None, {"x": np.zeros((rows, 1))})
            item = Pending(request, rows, key, now, now + 0.02 if has_deadline else None, priority)
            try:
                batcher.add(item)
            except OverloadedError:
                assert len(batcher) == 20
                continue
            added.append(item)
        elif op == "batch":
            batch = batcher.next_batch(now)
            if batch is not None:
                assert 0 < batch.rows <= 8
                assert batch.rows == sum(i.rows for i in batch.items)
                assert len({i.shape_key for i in batch.items}) == 1
                for i in batch.items:
                    assert id(i) not in seen
                    seen[id(i)] = "batched"
        elif op == "expire":
            for i in batcher.expire(now):
                assert i.deadline_s is not None and i.deadline_s <= now
                assert id(i) not in seen
                seen[id(i)] = "expired"
        elif op == "remove" and added:
            victim = added[rows % len(added)]
            if batcher.remove(victim):
                assert id(victim) not in seen
                seen[id(victim)] = "removed"
        assert len(batcher) == sum(1 for i in added if id(i) not in seen)
    for i in batcher.drain():
        assert id(i) not in seen
        seen[id(i)] = "drained"
    assert set(seen) == {id(i) for i in added}
