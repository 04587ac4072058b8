"""The arrays a model holds, found by walking its objects (the floor under a measured
footprint that memory freed elsewhere in the process cannot lower)."""

from __future__ import annotations

import numpy as np
import torch

from gpuserve.repository.ondemand import held_arrays
from gpuserve.repository.ondemand.held_arrays import held_bytes


class Holder:
    def __init__(self) -> None:
        self.weights = np.ones(1000)  # 8,000 B
        self.view = self.weights[10:]  # the same buffer: counted once
        self.layer = torch.nn.Linear(100, 100)  # 10,000 + 100 float32 = 40,400 B
        self.nested = {"rows": [np.zeros(10, np.float32)], "shape": (3, 4)}  # 40 B
        self.name = "holder"


class Slotted:
    __slots__ = ("table",)

    def __init__(self) -> None:
        self.table = np.zeros(256, np.uint8)


def test_distinct_buffers_by_device_each_once() -> None:
    holder = Holder()
    assert held_bytes([holder, holder]) == {"cpu": 8_000 + 40_400 + 40}
    assert held_bytes([Slotted()]) == {"cpu": 256}
    assert held_bytes([object(), "text", 3]) == {}


def test_a_cycle_ends_and_views_of_foreign_buffers_are_not_held() -> None:
    a: dict[str, object] = {}
    b = {"a": a, "array": np.frombuffer(b"\0" * 64, np.uint8)}  # a view of bytes: not owned
    a["b"] = b
    a["own"] = np.empty(16, np.int64)
    assert held_bytes([a]) == {"cpu": 128}


def test_the_walk_is_bounded(monkeypatch) -> None:
    chain: list[object] = [np.ones(1)]
    for _ in range(50):
        chain = [chain]
    monkeypatch.setattr(held_arrays, "MAX_DEPTH", 10)
    assert held_bytes([chain]) == {}  # the array lies deeper than the walk goes
    monkeypatch.setattr(held_arrays, "MAX_DEPTH", 100)
    assert held_bytes([chain]) == {"cpu": 8}
