"""The lock-free per-request series render exactly as prometheus_client's own do."""

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from gpuserve.metrics.loop_series import LoopCounter, LoopHistogram
from gpuserve.metrics.series import LATENCY_BUCKETS_S

VALUES = [0.0, 0.0001, 0.00011, 0.003, 0.0025, 0.02, 0.5, 59.0, 60.0, 61.0, 1e9]


def test_histogram_exposition_equals_prometheus_client():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = LoopHistogram("lat_seconds", "Latency.", ("model", "version"), LATENCY_BUCKETS_S, ours)
    ref = Histogram(
        "lat_seconds",
        "Latency.",
        ("model", "version"),
        buckets=LATENCY_BUCKETS_S,
        registry=theirs,
    )
    for i, value in enumerate(VALUES):
        mine.labels("m", str(i % 2)).observe(value)
        ref.labels("m", str(i % 2)).observe(value)
    ref_text = generate_latest(theirs).decode()
    ref_text = "\n".join(line for line in ref_text.splitlines() if "_created" not in line)
    assert generate_latest(ours).decode().strip() == ref_text.strip()


def test_counter_exposition_equals_prometheus_client():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = LoopCounter("reqs", "Requests.", ("model", "outcome"), ours)
    ref = Counter("reqs", "Requests.", ("model", "outcome"), registry=theirs)
    for amount, outcome in [(1, "success"), (3, "success"), (1, "failure"), (0.5, "failure")]:
        mine.labels("m", outcome).inc(amount)
        ref.labels("m", outcome).inc(amount)
    mine.labels("m", "never")  # a child created at zero shows at zero
    ref.labels("m", "never")
    ref_text = generate_latest(theirs).decode()
    ref_text = "\n".join(line for line in ref_text.splitlines() if "_created" not in line)
    assert generate_latest(ours).decode().strip() == ref_text.strip()


def test_wrong_label_count_and_unsorted_buckets_are_refused():
    registry = CollectorRegistry()
    counter = LoopCounter("c", "C.", ("a", "b"), registry)
    with pytest.raises(ValueError, match="expected labels"):
        counter.labels("only-one")
    with pytest.raises(ValueError, match="buckets must increase"):
        LoopHistogram("h", "H.", ("a",), (1.0, 0.5), registry)
