"""Structured logs, the access-log switch, the timing keys shared by HTTP and gRPC, and the
NVTX tracer's no-op path on a CPU."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

from gpuserve.engine import tracing
from gpuserve.server import logs, timing


def record(message: str, *args, **extra) -> logging.LogRecord:
    rec = logging.LogRecord("gpuserve.access", logging.INFO, __file__, 1, message, args, None)
    rec.__dict__.update(extra)
    return rec


def test_json_formatter_writes_one_object_with_extras():
    line = logs.JsonFormatter().format(
        record("%s done", "req", model="m", rows=3, shapes={"X": [3, 4]})
    )
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["message"] == "req done"
    assert entry["level"] == "info" and entry["logger"] == "gpuserve.access"
    assert entry["ts"].endswith("+00:00")
    assert (entry["model"], entry["rows"], entry["shapes"]) == ("m", 3, {"X": [3, 4]})
    for standard in ("args", "msg", "levelno", "pathname", "thread"):
        assert standard not in entry


def test_json_formatter_keeps_tracebacks():
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        rec = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    entry = json.loads(logs.JsonFormatter().format(rec))
    assert "ValueError: boom" in entry["exc"]


def test_configure_logging_formats_and_access_switch():
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, logging.getLogger(logs.ACCESS_LOGGER).level)
    try:
        logs.configure_logging("warning", "json", access_log=True)
        assert isinstance(root.handlers[-1].formatter, logs.JsonFormatter)
        assert logging.getLogger(logs.ACCESS_LOGGER).isEnabledFor(logging.INFO)
        logs.configure_logging("info", "text", access_log=False)
        assert not isinstance(root.handlers[-1].formatter, logs.JsonFormatter)
        assert not logging.getLogger(logs.ACCESS_LOGGER).isEnabledFor(logging.INFO)
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        logging.getLogger(logs.ACCESS_LOGGER).setLevel(saved[2])


def test_timing_keys_are_shared_names_in_microseconds():
    assert timing.timing_metadata(0.0012349, 0.5, 1.0) == [
        ("x-queue-time-us", "1234"),
        ("x-compute-time-us", "500000"),
        ("x-total-time-us", "1000000"),
    ]
    assert timing.TOTAL_TIME_US_HEADER == b"x-total-time-us"


def test_nvtx_tracer_is_a_no_op_on_cpu():
    tracer = tracing.StageTracer("m:1", "cpu")
    assert tracer.nvtx is None
    job = SimpleNamespace(batch=SimpleNamespace(rows=4, items=[object()]))
    tracer.begin("preprocess", job)
    tracer.end()
    tracing.queue_enter(object(), "m")
    tracing.queue_exit([object()])
    assert tracing._queue_ranges == {}


def test_nvtx_ranges_with_a_fake_nvtx(monkeypatch):
    calls: list[tuple[str, object]] = []
    fake = SimpleNamespace(
        range_push=lambda msg: calls.append(("push", msg)),
        range_pop=lambda: calls.append(("pop", None)),
        range_start=lambda msg: calls.append(("start", msg)) or 7,
        range_end=lambda rid: calls.append(("end", rid)),
    )
    monkeypatch.setattr(tracing, "_nvtx", fake)
    tracer = tracing.StageTracer("m:1", "cuda:0")
    item = object()
    tracing.queue_enter(item, "m")
    job = SimpleNamespace(batch=SimpleNamespace(rows=4, items=[item]))
    tracer.begin("preprocess", job)
    tracer.end()
    assert calls == [
        ("start", "m queue"),
        ("end", 7),
        ("push", "m:1 preprocess 4 rows"),
        ("pop", None),
    ]
    assert tracing._queue_ranges == {}
