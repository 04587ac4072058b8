"""The route: default version, canary share by request-id hash (pure, no models loaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuserve.config import ModelConfig, TensorSpec
from gpuserve.repository.state import ModelVersion, Route, VersionState, split_point

CONFIG = ModelConfig(
    inputs=[TensorSpec(name="X", datatype="FP32", shape=[1])],
    outputs=[TensorSpec(name="Y", datatype="FP32", shape=[1])],
)


def version(number: int) -> ModelVersion:
    return ModelVersion("m", number, Path(str(number)), CONFIG, VersionState.READY)


def test_split_point_is_a_deterministic_hash_of_the_id():
    assert split_point("req-1") == split_point("req-1")
    assert 0.0 <= split_point("req-1") < 1.0
    assert split_point("req-1") != split_point("req-2")


@pytest.mark.parametrize("weight", [0.1, 0.5])
def test_canary_share_of_2000_ids_is_within_3_points(weight):
    v1, v2 = version(1), version(2)
    route = Route(v1, v2, weight)
    picks = [route.pick(f"req-{i}") for i in range(2000)]
    share = sum(p is v2 for p in picks) / len(picks)
    assert abs(share - weight) <= 0.03, share
    assert [route.pick(f"req-{i}") for i in range(2000)] == picks  # same id, same side


def test_requests_without_id_split_at_random_near_the_weight():
    v1, v2 = version(1), version(2)
    route = Route(v1, v2, 0.2)
    share = sum(route.pick(None) is v2 for _ in range(5000)) / 5000
    assert abs(share - 0.2) <= 0.03


def test_edge_weights_and_shares():
    v1, v2, v3 = version(1), version(2), version(3)
    assert all(Route(v1, v2, 0.0).pick(f"r{i}") is v1 for i in range(200))
    assert all(Route(v1, v2, 1.0).pick(f"r{i}") is v2 for i in range(200))
    assert Route(v1).pick("x") is v1 and Route().pick("x") is None
    route = Route(v1, v2, 0.25)
    assert (route.share(v1), route.share(v2), route.share(v3)) == (0.75, 0.25, 0.0)
    assert Route(v1).share(v1) == 1.0
